#!/usr/bin/env python3
"""Per-token log-probs with `logits_to_keep` (our path, `models.hf_policy.hf_logprobs`) vs full logits: peak memory
of one forward + backward at vocab 32k and 1k tokens, CPU, each side in its own fresh process.

The model is the tiny qwen3_moe of the tests (hidden 64, 8 experts, top-2) with vocab 32 000, so the logits
dominate as they do in real runs. One sequence of 1 024 tokens: a prompt and a response; the loss is the mean
response log-prob. Full logits: the policy's forward with every position's logits, then the log-softmax over all
of them and a gather (what a trainer without `logits_to_keep` does). Ours: only the logits that predict response
tokens are materialised. Memory: the process's resident high-water mark during the forward + backward above its
resident size just before (the kernel's peak is reset through /proc/self/clear_refs after freeing what the build
left; where that is not allowed, ru_maxrss over the pre-forward RSS). Prints the ratio full / ours per split.

Usage: .venv/bin/python benchmarks/bench_logprobs_memory.py [--vocab 32000] [--tokens 1024] [--responses 256 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SIDE = r"""
import ctypes, gc, json, resource, sys
import torch
from axrl_spike_replay.models.hf_policy import hf_logprobs
from axrl_spike_replay.models.policy import build_policy, parse_model_config
from axrl_spike_replay.models.tiny_moe import RoutingControl, token_logprobs
from axrl_spike_replay.testing.hf_snapshot import model_section

side, vocab, tokens_n, response = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
config = dict(model_section("qwen3_moe")["config"], vocab_size=vocab, max_position_embeddings=tokens_n)
spec = parse_model_config(dict(model_section("qwen3_moe"), config=config))
torch.manual_seed(0)
model = build_policy(spec)
tokens = torch.randint(3, vocab, (1, tokens_n))
loss_mask = torch.zeros(1, tokens_n)
loss_mask[:, tokens_n - response:] = 1.0
batch = {"tokens": tokens, "loss_mask": loss_mask, "attention_mask": torch.ones(1, tokens_n, dtype=torch.long)}


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024  # MiB
    raise KeyError(key)


gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = status("VmRSS:")
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the resident high-water mark
    how = "VmHWM after clear_refs"
except OSError:
    how = "ru_maxrss"
if side == "ours":
    logp, _, _ = hf_logprobs(model, batch, RoutingControl(), False)
else:
    out = model(tokens, RoutingControl(), attention_mask=batch["attention_mask"])
    logp = token_logprobs(out.logits, tokens)
loss = -(logp * loss_mask).sum() / loss_mask.sum()
loss.backward()
peak = status("VmHWM:") if how != "ru_maxrss" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"before": before, "peak": peak, "extra": peak - before, "how": how, "loss": float(loss)}))
"""


def _side(side: str, vocab: int, tokens: int, response: int) -> dict[str, float | str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "mcp_server")}
    done = subprocess.run(
        [sys.executable, "-c", SIDE, side, str(vocab), str(tokens), str(response)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{side} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--responses", type=int, nargs="+", default=[256, 512], help="response lengths to measure")
    args = parser.parse_args()
    print(f"vocab {args.vocab}, {args.tokens} tokens (one sequence), forward + backward, fresh process per side")
    for response in args.responses:
        full, ours = (_side(side, args.vocab, args.tokens, response) for side in ("full", "ours"))
        assert abs(float(full["loss"]) - float(ours["loss"])) <= 1e-4 * abs(float(full["loss"])), (full, ours)
        logits_mib = (args.tokens * args.vocab * 4 / 2**20, (response + 1) * args.vocab * 4 / 2**20)
        print(
            f"response {response:>4} / prompt {args.tokens - response:>4}: peak above the model "
            f"full {float(full['extra']):7.1f} MiB, ours {float(ours['extra']):7.1f} MiB "
            f"(process peaks {float(full['peak']):.0f} vs {float(ours['peak']):.0f} MiB; one fp32 logits tensor "
            f"{logits_mib[0]:.0f} vs {logits_mib[1]:.0f} MiB; {full['how']})"
        )
        print(
            f"  logits_to_keep memory ratio (full / ours): {float(full['extra']) / float(ours['extra']):.2f}x "
            f"above the model, {float(full['peak']) / float(ours['peak']):.2f}x whole process"
        )


if __name__ == "__main__":
    main()
