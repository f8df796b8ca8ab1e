"""Streamed replay on one GPU of a few layers of DeepSeek-V3's width: peak CUDA memory, read throughput against the
disk's own, and the time split between reading and computing.

For a lent GPU machine (nothing outside it reachable): a deepseek_v3 policy of DeepSeek-V3's widths (hidden 7168,
its attention, expert width 2048, vocab 129 280) but `--layers` decoder layers (the first dense) and `--experts`
routed experts, random weights, is recorded at saved world size `--world` by `testing.hf_snapshot` (the trainer's
own rank step, on the CPU, float32; DCP weights on local disk). Then, in this process:

- the disk's own read speed: `dd` of the weights file with `iflag=direct` (the page cache bypassed);
- the streamed replay on `cuda` (`replay.streamed.streamed_job.compute_streamed`) without its read ahead (each
  layer read, then computed), then with it, timed: the reads (`StreamedWeights.read.seconds`, each layer's read
  into the device on the read thread), the time the compute waited for them (`read.waited`), peak CUDA memory
  (`torch.cuda.max_memory_allocated`), and the grad norm's rel_diff to the recorded one;
- with `--processes N` (N GPUs): the saved ranks split over N processes, one GPU each (NCCL,
  `streamed_processes`), its wall and whether its grad norm is the one-GPU replay's exactly.

Prints one JSON line (also written to $OUT/gpu_streamed_replay.json when $OUT is set).

Usage: python benchmarks/gpu_streamed_replay.py [--layers 3] [--experts 32] [--world 2] [--workdir DIR]
       [--processes N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.vocabulary import Shard


def deepseek_width(layers: int, experts: int) -> dict[str, object]:
    """DeepSeek-V3's published widths with `layers` decoder layers and `experts` routed experts."""
    from axrl_spike_replay.testing.config_only_snapshot import DEEPSEEK_V3

    groups = max(1, min(8, experts // 8))
    return {
        **DEEPSEEK_V3,
        "num_hidden_layers": layers,
        "first_k_dense_replace": 1,
        "n_routed_experts": experts,
        "n_group": groups,
        "topk_group": max(1, min(4, groups)),
        "max_position_embeddings": 256,
    }


def disk_read_speed(path: Path) -> float:
    """Bytes per second `dd` reads `path` at with the page cache bypassed."""
    done = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], capture_output=True, text=True, check=False
    )
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", done.stderr)
    if not match:
        raise SystemExit(f"dd gave no speed: {done.stderr[-500:]}")
    return int(match.group(1)) / float(match.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--processes", type=int, default=0, help="also split the saved ranks over this many GPUs")
    args = parser.parse_args()
    import torch

    from axrl_spike_replay.replay.engine import replay_session
    from axrl_spike_replay.replay.streamed import layer_weights
    from axrl_spike_replay.replay.streamed.settings import StreamSettings
    from axrl_spike_replay.replay.streamed.streamed_job import compute_streamed
    from axrl_spike_replay.replay.streamed.streamed_processes import run_streamed_processes
    from axrl_spike_replay.snapshot.metadata import read_metadata
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    if not torch.cuda.is_available():
        raise SystemExit("no GPU visible: this benchmark is for a GPU machine")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="axrl-gpu-streamed-"))
    t = time.perf_counter()
    snapshot = record_hf_snapshot(root, "deepseek_v3", world_size=args.world,
                                  config=deepseek_width(args.layers, args.experts))  # fmt: skip
    record_s = time.perf_counter() - t
    data = max(snapshot.glob("*.distcp"), key=lambda p: p.stat().st_size)
    disk = disk_read_speed(data)
    with replay_session(replay_request(What(snapshot), how=How(shard=Shard.OFF)), [], "replay") as session:
        job = session.worker_job()
    job = dataclasses.replace(job, device="cuda", assignment=(tuple(range(job.world_size)),))
    reads: list[layer_weights.ReadFigures] = []
    original = layer_weights.StreamedWeights.close

    def kept(self: layer_weights.StreamedWeights) -> None:
        reads.append(self.read)
        original(self)

    layer_weights.StreamedWeights.close = kept
    t = time.perf_counter()
    serial = compute_streamed(job, settings=StreamSettings(read_ahead=False))[0]  # each read before its compute
    torch.cuda.synchronize()
    serial_wall = time.perf_counter() - t
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    outcome = compute_streamed(job)[0]
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    read = reads[-1]
    split: dict[str, object] = {}
    if args.processes > 1:
        t = time.perf_counter()
        several = run_streamed_processes(job, args.processes)[0]
        split = {
            "processes": args.processes,
            "split_wall_s": time.perf_counter() - t,
            "split_grad_norm_equal": several.grad_norms == outcome.grad_norms,
        }
    recorded = read_metadata(snapshot)[0].grad_norm
    figures = {
        "device": torch.cuda.get_device_name(0),
        "layers": args.layers,
        "experts": args.experts,
        "world_size": args.world,
        "weights_bytes": sum(p.stat().st_size for p in snapshot.glob("*.distcp")),
        "record_s": record_s,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated(),
        "wall_s": wall,
        "wall_without_read_ahead_s": serial_wall,
        "without_read_ahead_grad_norm_equal": serial.grad_norms == outcome.grad_norms,
        "read_s": read.seconds,  # on the read thread, overlapping the compute
        "read_wait_s": read.waited,  # the compute waiting for a read
        "compute_s": wall - read.waited,
        "bytes_read": read.bytes_read,
        "read_bytes_per_s": read.bytes_read / read.seconds if read.seconds else None,
        "disk_bytes_per_s": disk,
        "grad_norm": outcome.grad_norms[0],
        "rel_diff_to_recorded": abs(outcome.grad_norms[0] - recorded) / recorded,
        **split,
    }
    print(json.dumps(figures))
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_streamed_replay.json").write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
