#!/usr/bin/env python3
"""Replay of a transformers MoE spike vs one bare forward + backward of the same model, per architecture.

For each of the six architectures at the tests' tiny sizes (hidden 64, 8 experts, top-2, vocab 1024), a spike
snapshot is recorded as the tests record it (`axrl_spike_replay.testing.hf_snapshot`: saved world size 2, 4
samples of 40 tokens per rank). Then, each in a fresh process:

Start-up is the interpreter and the imports (torch, transformers and the architecture's modeling module, on
both sides; the replay also imports the library).

- replay: `run_replay(snapshot, nproc=1)` (reduced layout, in-process: no rank processes), split into start-up,
  load (weights from the DCP checkpoint and
  the rank batches) and recompute (both ranks' forward + loss + backward, reduction, norms), plus the rest of
  the call ("other": reading and checking the snapshot and its config, the verdict), and the interpreter's exit;
- bare: the physical limit, a process that imports torch and transformers, builds the same model with
  transformers, loads the same weights from one `torch.save` file, and runs one forward + backward of the same
  token batches (`logits_to_keep` as the replay) with a plain mean log-prob loss.

Peak RSS is each process's own `ru_maxrss`. Prints per architecture the times, RSS, and the ratios
replay / bare (wall, recompute vs forward+backward, peak RSS).

Usage: .venv/bin/python benchmarks/bench_replay_models.py [--only ARCH ...] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PYTHONPATH = str(REPO / "mcp_server")

REPLAY = r"""
import importlib, json, resource, sys, time
import torch, transformers  # noqa: F401
from transformers import AutoModelForCausalLM  # noqa: F401
importlib.import_module(f"transformers.models.{sys.argv[2]}.modeling_{sys.argv[2]}")
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
torch.set_num_threads(1)
ready = time.time()
t = time.perf_counter()
result = run_replay(replay_request(What(sys.argv[1]), how=How(nproc=1)))
wall = time.perf_counter() - t
print(json.dumps({"ready": ready, "call": wall, "load": result.timings["load"], "compute": result.timings["compute"],
                  "rel_diff": result.rel_diff, "verdict": str(result.verdict),
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

BARE = r"""
import importlib, json, resource, sys, time
import torch, transformers
from transformers import AutoModelForCausalLM
importlib.import_module(f"transformers.models.{sys.argv[3]}.modeling_{sys.argv[3]}")
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
torch.set_num_threads(1)
ready = time.time()
t = time.perf_counter()
data = torch.load(sys.argv[1], weights_only=True)
spec = json.loads(sys.argv[2])
config = CONFIG_MAPPING[spec["architecture"]](**spec["config"])
model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
model.load_state_dict(data["state"], strict=True)
load = time.perf_counter() - t
t = time.perf_counter()
for tokens, mask, keep in zip(data["tokens"], data["masks"], data["keep"]):
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=tokens, attention_mask=mask, position_ids=position_ids, use_cache=False,
                   logits_to_keep=int(keep)).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, tokens[:, -logits.shape[1]:, None]).squeeze(-1)
    (-logp.mean()).backward()
compute = time.perf_counter() - t
print(json.dumps({"ready": ready, "load": load, "compute": compute,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _run(code: str, *args: str) -> dict[str, Any]:
    """Run `code` in a fresh interpreter; its JSON line plus `startup` (launch to ready) and `wall`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    start = time.time()
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False, cwd=REPO
    )
    wall = time.time() - start
    if done.returncode != 0:
        raise SystemExit(f"benchmark process failed:\n{done.stderr[-3000:]}")
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    doc["startup"] = doc["ready"] - start
    doc["wall"] = wall
    return doc


def _prepare(root: Path, architecture: str) -> tuple[Path, Path, str]:
    """(the recorded snapshot, the bare process's weights + batches file, its model spec as JSON)."""
    import torch

    from axrl_spike_replay.models.hf_policy import response_start
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot, seeded_policy, tiny_config

    snapshot = record_hf_snapshot(root / architecture, architecture, world_size=2)
    _, model = seeded_policy(architecture)  # the snapshot's weights (the recorder seeds the same way)
    batches = [load_rank_batch(str(snapshot), rank) for rank in range(2)]
    bare = root / f"{architecture}-bare.pt"
    torch.save(
        {
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "tokens": [b["tokens"] for b in batches],
            "masks": [b["attention_mask"].long() for b in batches],
            "keep": [torch.tensor(b["tokens"].shape[1] - response_start(b["loss_mask"]) + 1) for b in batches],
        },
        bare,
    )
    return snapshot, bare, json.dumps({"architecture": architecture, "config": tiny_config(architecture)})


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def main() -> None:
    from axrl_spike_replay.models.architectures import ARCHITECTURES

    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("--only", nargs="*", default=list(ARCHITECTURES), choices=ARCHITECTURES)
    parser.add_argument("--runs", type=int, default=1, help="fresh processes per side and architecture (medians)")
    args = parser.parse_args()
    print(
        f"{'architecture':<12} {'side':<6} {'start-up':>9} {'load':>7} {'recompute':>10} {'other':>7} "
        f"{'exit':>6} {'wall':>7} {'peak RSS':>9}"
    )
    summary = []
    with tempfile.TemporaryDirectory(prefix="bench-replay-models-") as tmp:
        for architecture in args.only:
            snapshot, bare_file, spec = _prepare(Path(tmp), architecture)
            replays, bares = [], []
            for _ in range(args.runs):  # interleaved, so load on the box hits both sides alike
                replays.append(_run(REPLAY, str(snapshot), architecture))
                bares.append(_run(BARE, str(bare_file), spec, architecture))
            r = {k: _median(replays, k) for k in ("startup", "load", "compute", "call", "wall", "rss_mib")}
            b = {k: _median(bares, k) for k in ("startup", "load", "compute", "wall", "rss_mib")}
            r_other = r["call"] - r["load"] - r["compute"]
            r["exit"] = r["wall"] - r["startup"] - r["call"]
            b["exit"] = b["wall"] - b["startup"] - b["load"] - b["compute"]
            for side, row, other in (("replay", r, r_other), ("bare", b, 0.0)):
                print(
                    f"{architecture:<12} {side:<6} {row['startup']:>8.2f}s {row['load']:>6.3f}s "
                    f"{row['compute']:>9.3f}s {other:>6.2f}s {row['exit']:>5.2f}s "
                    f"{row['wall']:>6.2f}s {row['rss_mib']:>6.0f} MiB"
                )
            check = replays[0]
            print(f"{'':<12} replay verdict {check['verdict']}, rel_diff {check['rel_diff']:.1e} (reduced layout)")
            ratios = (
                r["wall"] / b["wall"],
                r["compute"] / b["compute"],
                r["load"] / b["load"],
                r["rss_mib"] / b["rss_mib"],
            )
            summary.append((architecture, *ratios))
    print("\nreplay / bare (the physical limit), per architecture:")
    for architecture, wall, compute, load, rss in summary:
        print(
            f"  {architecture:<12} wall ratio {wall:.2f}x, recompute vs forward+backward ratio {compute:.2f}x, "
            f"load ratio {load:.2f}x, peak RSS ratio {rss:.2f}x"
        )


if __name__ == "__main__":
    main()
