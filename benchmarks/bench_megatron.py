#!/usr/bin/env python3
"""Megatron snapshots: `inspect` vs a full `dist_checkpointing.load`, and route 1's forward + backward vs
megatron-core's own on the same batch.

A Qwen3-MoE GPTModel (default: hidden 512, 4 layers, 32 experts of 1 024, vocab 32 000: ~0.27 G parameters,
~1.1 GB in fp32) is saved by megatron-core's `dist_checkpointing.save` from one gloo process and wrapped into a
spike snapshot (metadata, run config, a batch and grad info per rank). Then, side by side in one run:

- inspect: `inspect_snapshot` in a fresh process (headers only: `.metadata`, `metadata.json`, rank files) vs a
  fresh process that builds the GPTModel and runs `dist_checkpointing.load` of the same checkpoint (the naive way
  to see what is in it). The time of the call itself on both sides (start-up and model build not counted), each
  side the best of its fresh processes (`--inspect-runs`, `--load-runs`): on a shared box one run of either can
  wait seconds for a core. Each side's CPU time is printed too. Our own format's `bench_inspect.py` uses a 2.25 GiB
  snapshot; `--experts 64 --expert-ffn 1536` gives a Megatron checkpoint of 2.39 GiB to compare at that size.
- compute: in one gloo process, the same batch (4 x 256 tokens, routes forced) through route 1 (the transformers
  model loaded from the checkpoint by `models.mcore.megatron_weights`: forward, the snapshot's loss, backward) and
  through megatron-core's GPTModel (its forward, the same loss, backward), alternating, median of `--runs`.

Targets: inspect >= 100x faster than the load; route 1 <= 1.3x Megatron's own forward + backward.

Usage: .venv/bin/python benchmarks/bench_megatron.py [--hidden 512] [--layers 4] [--experts 32] [--runs 5]
       [--inspect-runs 5] [--load-runs 2] [--no-compute]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "mcp_server"))


def section(args: argparse.Namespace) -> dict[str, Any]:
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

    doc = tiny_section()
    doc.pop("experts_implementation")  # route 1's default for Megatron snapshots (grouped_mm)
    doc["config"].update(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_experts=args.experts,
        moe_intermediate_size=args.expert_ffn,
        intermediate_size=4 * args.hidden,
        vocab_size=args.vocab,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        max_position_embeddings=4096,
    )
    return doc


def make_snapshot(root: Path, doc: dict[str, Any]) -> Path:
    """The checkpoint saved by megatron-core, wrapped into a spike snapshot (world size 1)."""
    import shutil

    import torch

    from axrl_spike_replay.capture.snapshot_writer import RankPayload, write_snapshot
    from axrl_spike_replay.snapshot.metadata import AxrlMetadata, ParallelLayout
    from axrl_spike_replay.testing.megatron_checkpoints import LAYOUTS, save_checkpoints

    checkpoint = root / "checkpoint"
    save_checkpoints(doc, [(LAYOUTS["tp1"], checkpoint)], None)
    batch = make_batch(doc)
    meta = AxrlMetadata(
        job_name="bench-megatron",
        role="actor",
        iteration=1,
        grad_norm=1.0,
        median_norm=0.1,
        spike_ratio=10.0,
        parallel=ParallelLayout(),
    )
    run_config = {
        "model": doc,
        "loss": {"is_base_logprobs": "old"},
        "routing": {"replay": "off"},
        "parallel": {"world_size": 1, "dp": 1},
    }

    def copy_weights(directory: Path) -> None:
        for path in checkpoint.iterdir():
            shutil.copy2(path, directory / path.name)

    ranks = {0: RankPayload(batch, {"grad_norm": 1.0, "param_grad_norms": {}})}
    snapshot = write_snapshot(root / "snapshots", meta, run_config, {}, ranks, weights_writer=copy_weights)
    torch.save(batch, root / "batch.pt")
    return snapshot


def make_batch(doc: dict[str, Any], samples: int = 4, seq: int = 256) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, int(doc["config"]["vocab_size"]), (samples, seq), generator=gen)
    mask = torch.zeros(samples, seq)
    mask[:, seq // 4 :] = 1.0
    old = -torch.rand(samples, seq, generator=gen) * mask
    return {"tokens": tokens, "loss_mask": mask, "advantages": torch.randn(samples, generator=gen), "old_logprobs": old}


INSPECT = """
import json, sys, time
import torch  # start-up, as the load's side has its imports and model built before its clock starts
sys.path.insert(0, {src!r})
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
start, cpu = time.perf_counter(), time.process_time()
found = inspect_snapshot({snapshot!r})
print(json.dumps({{"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu,
                  "problems": found.problems, "tensors": len(found.megatron["tensors"])}}))
"""


def _inspect_in_child(snapshot: Path) -> dict[str, Any]:
    """One fresh process's inspect of the snapshot: its time, problems and tensor count."""
    proc = subprocess.run(
        [sys.executable, "-c", INSPECT.format(src=str(REPO / "mcp_server"), snapshot=str(snapshot))],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _load_rank(rank: int, world: int, payload: tuple[dict[str, Any], str, str]) -> None:
    from megatron.core import dist_checkpointing

    from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.mcore.megatron_gpt import MegatronParallel, build_gpt_model, init_parallel

    doc, checkpoint, out = payload
    with megatron_on_cpu():
        init_parallel(MegatronParallel())
        model = build_gpt_model(MegatronModelConfig.from_dict(doc))
        start, cpu = time.perf_counter(), time.process_time()
        state = dist_checkpointing.load(model.sharded_state_dict(), checkpoint)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        count = sum(t.numel() for t in state.values() if hasattr(t, "numel"))
    Path(out).write_text(json.dumps({"seconds": seconds, "cpu": cpu, "elements": count}))


def _compute_rank(rank: int, world: int, payload: tuple[dict[str, Any], str, str, int]) -> None:
    import torch

    from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.mcore.megatron_gpt import MegatronParallel, build_gpt_model, init_parallel
    from axrl_spike_replay.models.mcore.megatron_policy import force_routes, install_trace, megatron_logprobs
    from axrl_spike_replay.models.policy import build_policy, load_policy_weights, policy_forward
    from axrl_spike_replay.models.tiny_moe import RoutingControl
    from axrl_spike_replay.snapshot.trainer_formats.megatron_routes import to_router_replay
    from axrl_spike_replay.training.policy_loss import LossConfig, policy_loss

    doc, snapshot, out, runs = payload
    spec = MegatronModelConfig.from_dict(doc)
    loss_cfg = LossConfig.from_dict({"is_base_logprobs": "old"})
    batch = torch.load(Path(snapshot).parent.parent / "batch.pt", weights_only=True)
    policy = build_policy(spec)
    load_policy_weights(policy, spec, snapshot)
    times: dict[str, list[float]] = {"route1": [], "megatron": []}
    with megatron_on_cpu():
        from megatron.core import dist_checkpointing

        init_parallel(MegatronParallel())
        gpt = build_gpt_model(spec)
        gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), snapshot), strict=False)
        trace = install_trace(gpt)
        force_routes(gpt, None)
        routes = megatron_logprobs(gpt, trace, batch).routes.detach()  # both sides take these routes
        layers = sorted(trace.used)
        for _ in range(runs + 1):  # the first round warms both up
            start = time.perf_counter()
            force_routes(gpt, dict(zip(layers, to_router_replay(routes), strict=True)))
            result = megatron_logprobs(gpt, trace, batch)
            policy_loss(
                result.logprobs, batch, loss_cfg, aux_loss=result.aux_loss, z_loss=result.z_loss
            ).loss.backward()
            times["megatron"].append(time.perf_counter() - start)
            gpt.zero_grad(set_to_none=True)
            start = time.perf_counter()
            ours = policy_forward(policy, batch, RoutingControl(routes=routes), need_entropy=False)
            policy_loss(ours.logprobs, batch, loss_cfg, aux_loss=ours.aux_loss, z_loss=ours.z_loss).loss.backward()
            times["route1"].append(time.perf_counter() - start)
            policy.zero_grad(set_to_none=True)
    Path(out).write_text(json.dumps({k: v[1:] for k, v in times.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--expert-ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--inspect-runs", type=int, default=5, help="fresh inspect processes (the best counts)")
    parser.add_argument("--load-runs", type=int, default=2, help="fresh load processes (the best counts)")
    parser.add_argument("--no-compute", action="store_true", help="only inspect vs load (for large checkpoints)")
    args = parser.parse_args()

    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_unavailable_reason
    from axrl_spike_replay.processes.rank_processes import spawn_ranks

    reason = megatron_unavailable_reason()
    if reason is not None:
        print(f"bench_megatron: skipped: {reason}")
        return
    doc = section(args)
    with tempfile.TemporaryDirectory(prefix="bench-megatron-") as tmp:
        root = Path(tmp)
        snapshot = make_snapshot(root, doc)
        size = sum(p.stat().st_size for p in snapshot.glob("__*.distcp"))
        inspections, loads = [], []
        for run in range(max(args.inspect_runs, args.load_runs)):  # alternating, so both sides see the same box
            if run < args.inspect_runs:
                inspections.append(_inspect_in_child(snapshot))
            if run < args.load_runs:
                spawn_ranks(_load_rank, 1, (doc, str(snapshot), str(root / "load.json")), timeout_s=900, label="load")
                loads.append(json.loads((root / "load.json").read_text()))
        inspected = min(inspections, key=lambda found: found["seconds"])
        loaded = min(loads, key=lambda found: found["seconds"])
        compute = None
        if not args.no_compute:
            payload = (doc, str(snapshot), str(root / "compute.json"), args.runs)
            spawn_ranks(_compute_rank, 1, payload, timeout_s=1800, label="compute")
            compute = json.loads((root / "compute.json").read_text())
    ratio = loaded["seconds"] / inspected["seconds"]
    print(
        f"checkpoint: {loaded['elements'] / 1e6:.0f} M parameters, {size / 2**30:.2f} GiB in .distcp files; "
        f"inspect found {inspected['tensors']} tensors, problems {inspected['problems']}"
    )
    print(
        f"inspect {inspected['seconds']:.4f} s vs dist_checkpointing.load {loaded['seconds']:.3f} s: "
        f"{ratio:.0f}x (target >= 100x); best of {len(inspections)} and {len(loads)} fresh processes"
    )
    inspect_times = sorted(found["seconds"] for found in inspections)
    load_times = sorted(found["seconds"] for found in loads)
    print(
        f"  every run: inspect {', '.join(f'{t:.4f}' for t in inspect_times)} s; "
        f"load {', '.join(f'{t:.3f}' for t in load_times)} s; "
        f"medians {statistics.median(load_times) / statistics.median(inspect_times):.0f}x"
    )
    inspect_cpu, load_cpu = min(found["cpu"] for found in inspections), min(found["cpu"] for found in loads)
    print(
        f"  CPU time (what a loaded box's wall time hides): inspect {inspect_cpu:.4f} s vs load {load_cpu:.3f} s: "
        f"{load_cpu / inspect_cpu:.0f}x"
    )
    if compute is None:
        return
    route1, megatron = statistics.median(compute["route1"]), statistics.median(compute["megatron"])
    print(
        f"forward + loss + backward, median of {args.runs}: route 1 (transformers) {route1:.3f} s vs megatron-core "
        f"{megatron:.3f} s: {route1 / megatron:.2f}x (target <= 1.3x)"
    )


if __name__ == "__main__":
    main()
