#!/usr/bin/env python3
"""Memory of one replayed forward + backward against sequence length: eager attention with the full-vocabulary head
(the engine before), sdpa, sdpa with the head in chunks, and that with checkpointed layers; each side in its own fresh
process, CPU, float32, beside what the plan (`replay.process_memory.activation_bytes`) predicts for it.

The policy keeps Qwen3-30B-A3B's vocabulary (151,936) and head shape (128-wide heads, 8 query heads per KV head)
at a reduced width so it runs on a shared 2-core machine: hidden 512, 8 query heads and 1 KV head of 64;
2 layers of 16 experts, top-4, width 256 (~0.17B parameters). The full width (hidden 2,048, 32 and 4 heads, ~0.8B
parameters) is `benchmarks/gpu_real_length.py`'s, for a GPU node. Memory: the process's resident high-water
mark during the step above its resident size just before (the kernel's peak reset through /proc/self/clear_refs).
The loss is the response's mean log-prob plus the router losses, with recorded routes forced on half the tokens.

Prints, per length and side: measured MiB, the plan's MiB and their ratio; then eager / each side, and how each
side grows from the shortest length to 4x it (linear: <= 4.5x; eager's scores: quadratic).

Usage: .venv/bin/python benchmarks/bench_real_length.py [--tokens 512 2048] [--hidden 512]
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
import ctypes, gc, json, sys
import torch
from axrl_spike_replay.models.layer_checkpoint import checkpoint_layers
from axrl_spike_replay.models.policy import build_policy, parse_model_config, policy_forward
from axrl_spike_replay.models.tiny_moe import RoutingControl, token_logprobs
from axrl_spike_replay.replay.process_memory import activation_bytes, model_facts

side, n, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(2)
config = {
    "vocab_size": 151936, "hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": hidden // 128 * 2,
    "num_key_value_heads": max(1, hidden // 512), "head_dim": 64, "intermediate_size": 768,
    "moe_intermediate_size": 256,
    "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
kernel = "eager" if side == "eager_full_head" else "sdpa"
spec = parse_model_config({"kind": "hf", "architecture": "qwen3_moe", "config": config, "attn_implementation": kernel})
torch.manual_seed(0)
model = build_policy(spec)
if side == "sdpa_chunked_ckpt":
    checkpoint_layers(model)
g = torch.Generator().manual_seed(1)
tokens = torch.randint(3, 151936, (1, n), generator=g)
mask = torch.zeros(1, n); mask[:, n // 4:] = 1.0
batch = {"tokens": tokens, "loss_mask": mask, "attention_mask": torch.ones_like(tokens)}
with torch.no_grad():
    routes = policy_forward(model, batch, RoutingControl(), need_entropy=False).routes
replay = torch.rand(1, n, generator=g) < 0.5
routing = RoutingControl(routes=routes, replay_tokens=replay)


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
if side in ("eager_full_head", "sdpa_full_head"):  # the head as the engine took it before: every logit, float32
    out = model(tokens, routing, attention_mask=batch["attention_mask"], logits_to_keep=n - n // 4 + 1)
    logits = out.logits[:, :-1].float().log_softmax(-1)
    logp = logits.gather(-1, tokens[:, n // 4:, None]).squeeze(-1)
    loss = -logp.mean() + 1e-3 * out.z_loss + 1e-2 * out.aux_loss
else:
    out = policy_forward(model, batch, routing, need_entropy=False)
    loss = -(out.logprobs * mask).sum() / mask.sum() + 1e-3 * out.z_loss + 1e-2 * out.aux_loss
loss.backward()
peak = status("VmHWM:")
facts = model_facts(spec)
planned = activation_bytes(facts, 1, n, 4, attention=kernel, checkpointed=side == "sdpa_chunked_ckpt")
if side.endswith("full_head"):  # the plan counts the chunked head; the old head kept ~4 float32 [T, V] copies
    from axrl_spike_replay.models.chunked_head import CHUNK_COPIES, chunk_tokens
    planned += (n - n // 4) * facts.vocab * 4 * 4 - min(chunk_tokens(facts.vocab), n) * facts.vocab * 4 * CHUNK_COPIES
grads = sum(p.numel() * 4 for p in model.parameters())  # the gradient the backward makes, beside the activations
print(json.dumps({"extra": peak - before, "planned": planned + grads, "loss": float(loss)}))
"""

SIDES = ("eager_full_head", "sdpa_full_head", "sdpa_chunked", "sdpa_chunked_ckpt")


def _side(side: str, tokens: int, hidden: int) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO / "mcp_server")}
    done = subprocess.run(
        [sys.executable, "-c", SIDE, side, str(tokens), str(hidden)], capture_output=True, text=True, env=env
    )
    if done.returncode:
        raise SystemExit(f"{side} at {tokens} tokens failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    mib = float(1 << 20)
    results: dict[tuple[str, int], dict[str, float]] = {}
    print(f"{'tokens':>6} {'side':>18} {'measured':>10} {'plan':>10} {'plan/meas':>9} {'eager/side':>10}")
    for n in args.tokens:
        for side in SIDES:
            results[side, n] = r = _side(side, n, args.hidden)
            eager = results["eager_full_head", n]["extra"]
            print(
                f"{n:>6} {side:>18} {r['extra'] / mib:>9.0f}M {r['planned'] / mib:>9.0f}M "
                f"{r['planned'] / r['extra']:>9.2f} {eager / r['extra']:>10.2f}",
                flush=True,
            )
    low, high = min(args.tokens), max(args.tokens)
    if low != high:
        print(f"growth from {low} to {high} tokens ({high / low:.0f}x the tokens):")
        for side in SIDES:
            print(f"  {side:>18}: {results[side, high]['extra'] / results[side, low]['extra']:.2f}x")


if __name__ == "__main__":
    main()
