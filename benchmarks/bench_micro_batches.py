#!/usr/bin/env python3
"""A rank's step replayed micro-batch by micro-batch vs flattened into one batch: peak memory and fidelity.

One snapshot, saved world size 1, one rank of `--sequences` sequences of `--tokens` tokens (responses of uneven
length), split by the trainer into `--micro` micro-batches (the batch file's `micro_batches`). The policy is the
project's tiny MoE at a width and vocabulary where the activations and the [T, V] logits are most of a process
(`--hidden`, `--vocab`). The recorded step is the trainer's step functions run as Megatron-core's schedule runs
them: each micro-batch's loss (token-mean over its own tokens) divided by the micro-batch count, accumulated.

Each side is a `replay` (one process, in a fresh interpreter): micro-batched (the recorded split, the default) and
flattened (the run config's `micro_batches: {split: whole}`, the replay before micro-batches). Memory: the
resident high-water mark during the replay above the resident size just before it (the kernel's peak reset
through /proc/self/clear_refs; where that is not allowed, ru_maxrss over the pre-replay RSS), and the whole
process's peak. Fidelity: the replay's grad norm against the recorded one (rel_diff). Prints each side and the
ratio flattened / micro-batched.

Usage: .venv/bin/python benchmarks/bench_micro_batches.py [--sequences 8] [--tokens 512] [--micro 4]
       [--hidden 128] [--vocab 16384] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent

SIDE = r"""
import ctypes, gc, json, resource, sys
import torch
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay

torch.set_num_threads(1)


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
        f.write("5")
    how = "VmHWM after clear_refs"
except OSError:
    how = "ru_maxrss"
result = run_replay(replay_request(What(sys.argv[1]), how=How(nproc=1)))
peak = status("VmHWM:") if how != "ru_maxrss" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"above": peak - before, "peak": status("VmHWM:"), "how": how,
                  "grad_norm": result.grad_norm, "recorded": result.recorded_grad_norm, "rel_diff": result.rel_diff}))
"""


def write_snapshot(root: Path, args: argparse.Namespace) -> Path:
    """The snapshot described in the module doc; its directory."""
    import torch

    from axrl_spike_replay.capture.snapshot_writer import RankPayload
    from axrl_spike_replay.capture.snapshot_writer import write_snapshot as write
    from axrl_spike_replay.models.tiny_moe import RoutingControl, TinyMoEConfig, TinyMoEPolicy, token_logprobs
    from axrl_spike_replay.snapshot.metadata import AxrlMetadata, DetectorSpec, ParallelLayout
    from axrl_spike_replay.training.loss_config import LossConfig
    from axrl_spike_replay.training.micro_batches import MicroBatch, take
    from axrl_spike_replay.training.rank_step import global_grad_norm, rank_forward_backward

    b, t = args.sequences, args.tokens
    cfg = TinyMoEConfig(
        vocab_size=args.vocab,
        d_model=args.hidden,
        n_layers=2,
        n_heads=4,
        d_ff=2 * args.hidden,
        n_experts=4,
        top_k=2,
        max_seq_len=t,
    )
    torch.manual_seed(0)
    model = TinyMoEPolicy(cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    prompt = t // 4
    tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    mask = torch.zeros(b, t)
    for s in range(b):  # responses from a few tokens to the whole width: micro-batches of uneven token counts
        mask[s, prompt : prompt + int((t - prompt) * (s + 1) / b)] = 1.0
    with torch.no_grad():
        old = token_logprobs(model(tokens, RoutingControl()).logits, tokens)
    adv = torch.randn(b, generator=gen)
    batch = {
        "tokens": tokens,
        "loss_mask": mask,
        "advantages": adv,
        "old_logprobs": old,
        "rollout_logprobs": old - 0.1 * torch.rand(b, t, generator=gen),
        "ref_logprobs": old,
    }
    loss_doc = {"loss_agg_mode": "token-mean", "normalization": "per_rank"}
    loss = LossConfig.from_dict(loss_doc)
    size = b // args.micro
    plan = [MicroBatch(tuple(range(i, i + size)), t, 1.0 / args.micro) for i in range(0, b, size)]
    total = [torch.zeros_like(p) for p in model.parameters()]
    for mb in plan:  # the trainer: Megatron-core's schedule over the micro-batches
        model.zero_grad(set_to_none=True)
        rank_forward_backward(model, take(batch, mb), loss, RoutingControl())
        for acc, p in zip(total, model.parameters(), strict=True):
            if p.grad is not None:
                acc.add_(p.grad, alpha=mb.scale)
    for p, acc in zip(model.parameters(), total, strict=True):
        p.grad = acc
    grad_norm = global_grad_norm(model)
    parts = [take(batch, mb) for mb in plan]
    run_config = {
        "model": cfg.to_dict(),
        "loss": loss_doc,
        "routing": {"replay": "off"},
        "parallel": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "ep": 1, "etp": 1, "cp": 1},
    }
    meta = AxrlMetadata(
        job_name="bench-micro",
        role="actor",
        iteration=5,
        grad_norm=grad_norm,
        median_norm=grad_norm / 8,
        spike_ratio=8.0,
        detector=DetectorSpec(kind="median_ratio", window=10, threshold=5.0),
        parallel=ParallelLayout(world_size=1, dp=1),
    )
    split: dict[str, Any] = {"micro_batches": parts}  # the writer saves a batch file's dict as it is
    payload = RankPayload(batch=split, grad_info={"grad_norm": grad_norm})
    return write(root, meta, run_config, state, {0: payload})


def flattened(snapshot: Path, root: Path) -> Path:
    """A copy of `snapshot` replayed as one batch (`micro_batches: {split: whole}`)."""
    copy = root / "flattened" / snapshot.name
    shutil.copytree(snapshot, copy)
    doc = yaml.safe_load((copy / "run_config.yaml").read_text())
    doc["micro_batches"] = {"split": "whole"}
    (copy / "run_config.yaml").write_text(yaml.safe_dump(doc))
    return copy


def side(snapshot: Path) -> dict[str, float]:
    env_path = str(REPO / "mcp_server")
    out = subprocess.run(
        [sys.executable, "-c", SIDE, str(snapshot)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.sequences % args.micro:
        parser.error("--sequences must be a multiple of --micro")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-micro-"))
    try:
        snapshot = write_snapshot(root / "snapshots", args)
        flat = flattened(snapshot, root)
        micro, whole = side(snapshot), side(flat)
        print(
            f"{args.sequences} x {args.tokens} tokens, {args.micro} micro-batches, hidden {args.hidden}, "
            f"vocab {args.vocab} ({micro['how']})"
        )
        for name, row in (("micro-batched", micro), ("flattened", whole)):
            print(
                f"  {name:14s} peak above start {row['above']:8.1f} MiB  process peak {row['peak']:8.1f} MiB  "
                f"grad norm {row['grad_norm']:.6g} vs recorded {row['recorded']:.6g}  rel_diff {row['rel_diff']:.2e}"
            )
        print(
            f"  ratio flattened / micro-batched: {whole['above'] / micro['above']:.2f}x above start, "
            f"{whole['peak'] / micro['peak']:.2f}x process peak"
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
