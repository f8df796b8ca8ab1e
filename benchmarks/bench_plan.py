#!/usr/bin/env python3
"""The replay plan's predicted peak memory per process vs the measured one, for N = 1, 2, 4 replay processes.

A qwen3_moe spike snapshot saved at world size 4 is made from the tests' recorded one, with a larger model
(hidden 1024, 8 experts of width 1024, vocab 32000: ~125M parameters, float32) and longer rank batches (4 x 512
tokens; routing replay off, so no routes are needed). For each layout, whole model in each process (`--shard off`)
and sharded with FSDP2 (`--shard on`), each on N = 1, 2, 4, in a fresh process, `plan` predicts the peak of one
replay process, then the CLI runs `replay --nproc N --shard ...` and the measured peak is the largest `ru_maxrss`
of that run's processes (the CLI process itself for the whole model at N = 1, which replays in process; the
largest rank process otherwise). Prints predicted, measured, their ratio, and the plan's parts.

The target: predicted within 20 % of measured for each N.

Usage: .venv/bin/python benchmarks/bench_plan.py [--hidden 1024] [--seq 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHONPATH = str(REPO / "mcp_server")

MAKE = r"""
import sys, shutil
from pathlib import Path
import torch, yaml
from axrl_spike_replay.models.policy import build_policy, parse_model_config
from axrl_spike_replay.snapshot.layout import batch_file, RUN_CONFIG
from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot, save_dcp
root, hidden, seq = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
snap = record_hf_snapshot(root, "qwen3_moe", world_size=4)
cfg = yaml.safe_load((snap / RUN_CONFIG).read_text())
cfg["model"]["config"].update(hidden_size=hidden, moe_intermediate_size=hidden, intermediate_size=hidden,
    num_attention_heads=16, num_key_value_heads=4, head_dim=hidden // 16, vocab_size=32000,
    max_position_embeddings=4096)
cfg["routing"] = {"replay": "off"}
(snap / RUN_CONFIG).write_text(yaml.safe_dump(cfg))
spec = parse_model_config(cfg["model"])
torch.manual_seed(0)
model = build_policy(spec)
for p in snap.glob("*.distcp"):
    p.unlink()
(snap / ".metadata").unlink()
save_dcp(snap, model.state_dict())
for p in snap.glob("routing_payload_rank*.pt"):
    p.unlink()
gen = torch.Generator().manual_seed(0)
b, prompt = 4, 16
for rank in range(4):
    tokens = torch.randint(3, 32000, (b, seq), generator=gen)
    mask = torch.zeros(b, seq); mask[:, prompt:] = 1.0
    old = -(torch.rand(b, seq, generator=gen) + 0.5) * mask
    batch = {"tokens": tokens, "loss_mask": mask, "attention_mask": torch.ones(b, seq, dtype=torch.long),
             "advantages": torch.randn(b, generator=gen), "old_logprobs": old, "ref_logprobs": old,
             "rollout_logprobs": old, "rewards": torch.rand(b, generator=gen)}
    torch.save(batch, snap / batch_file(rank))
print(snap)
"""

MEASURE = r"""
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
if done.returncode:
    sys.exit("replay failed:\n" + done.stderr[-3000:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""

PLAN = r"""
import json, sys
from axrl_spike_replay.replay.plans.replay_plan import plan_replay
plan = plan_replay(sys.argv[1], nproc=int(sys.argv[2]), shard=sys.argv[3])
m = plan.chosen.memory
assert plan.chosen.sharded == (sys.argv[3] == "on"), plan.text()
print(json.dumps({"peak": m.peak, "parameters": m.parameters, "gradients": m.gradients,
                  "activations": m.activations, "gathered": m.gathered, "runtime": m.runtime, "loading": m.loading,
                  "model": plan.model, "params": plan.parameters, "tokens": plan.tokens_per_rank}))
"""


def _python(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    gib = 1 << 30
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        snap = _python(MAKE, tmp, str(args.hidden), str(args.seq))
        workspace = Path(tmp) / "ws"
        workspace.mkdir()
        measured_rows = []
        for shard in ("off", "on"):
            for nproc in (1, 2, 4):
                cli = [sys.executable, "-m", "axrl_spike_replay", "replay", snap, "--nproc", str(nproc)]
                cli += ["--shard", shard, "--workspace", str(workspace), "--json"]
                started = time.perf_counter()
                measured = int(_python(MEASURE, *cli))
                measured_rows.append((shard, nproc, measured))
                wall = time.perf_counter() - started
                print(
                    f"measured shard {shard} N={nproc}: {measured / gib:.2f} GiB in {wall:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        # the plan reads no weight and runs nothing: made for every layout once the runs are measured
        rows = [
            (shard, nproc, json.loads(_python(PLAN, snap, str(nproc), shard)), measured, 0.0)
            for shard, nproc, measured in measured_rows
        ]
        first = rows[0][2]
        print(f"model {first['model']}: {first['params'] / 1e6:.0f}M parameters, {first['tokens']} tokens per rank")
        print(f"{'replay':>8} {'N':>3} {'predicted':>10} {'measured':>10} {'ratio':>6}   parts (GiB)")
        worst = 0.0
        for shard, nproc, plan, measured, _wall in rows:
            ratio = plan["peak"] / measured
            worst = max(worst, abs(ratio - 1))
            parts = ", ".join(
                f"{k} {plan[k] / gib:.2f}"
                for k in ("parameters", "gradients", "activations", "gathered", "runtime", "loading")
            )
            how = "sharded" if shard == "on" else "whole"
            print(f"{how:>8} {nproc:>3} {plan['peak'] / gib:>9.2f}G {measured / gib:>9.2f}G {ratio:>6.2f}   {parts}")
        print(f"largest deviation {worst:.1%} (target: within 20%)")


if __name__ == "__main__":
    main()
