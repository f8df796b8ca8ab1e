"""A replay on CUDA, whole on one GPU and then sharded (FSDP2, NCCL) over every GPU there is, against the CPU replay.

Not part of CI (it needs a GPU machine). For a snapshot (default: a spike of a tiny qwen3_moe recorded here at
saved world size 2 by `axrl_spike_replay.testing.hf_snapshot`; or `--snapshot DIR`, e.g. the one
`bench_sharded_replay.py --workdir DIR` writes), prints per run the device, processes, whether it sharded, the
precision that ran, the wall time, the grad norm and its rel_diff to the CPU replay of the same layout kind, and
the verdict. The CPU replay is the reference: CUDA kernels round differently, so a few 1e-7 (float32) is the
expected distance, not 0.

Usage: python benchmarks/gpu_sharded_replay.py [--snapshot DIR] [--gpus N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.vocabulary import Device, Shard


def _replay(snapshot: Path, nproc: int, device: str, shard: str) -> tuple[float, ReplayResult]:
    from axrl_spike_replay.replay.engine import run_replay

    start = time.perf_counter()
    result = run_replay(replay_request(What(snapshot), how=How(nproc=nproc, device=Device(device), shard=Shard(shard))))
    return time.perf_counter() - start, result


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--snapshot", default=None, help="snapshot dir (default: a tiny qwen3_moe spike recorded here)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to shard over (default: every visible one)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: this script is for a GPU machine")
    if args.snapshot is None:
        from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

        snapshot = record_hf_snapshot(Path(tempfile.mkdtemp(prefix="axrl-gpu-")), "qwen3_moe", world_size=2)
    else:
        snapshot = Path(args.snapshot)
    from axrl_spike_replay.replay.reading.inputs import load_inputs

    saved = load_inputs(snapshot, snapshot, False).world_size
    gpus = min(args.gpus or torch.cuda.device_count(), saved)
    print(
        f"snapshot {snapshot} (saved world size {saved}); {torch.cuda.device_count()} GPU(s): "
        f"{torch.cuda.get_device_name(0)}"
    )
    cpu_s, cpu = _replay(snapshot, 1, "cpu", "off")
    reference = cpu.grad_norm
    runs = [("cpu", 1, cpu_s, cpu)]
    for nproc, shard in ((1, "off"), (gpus, "on")):
        seconds, result = _replay(snapshot, nproc, "cuda", shard)
        runs.append(("cuda", nproc, seconds, result))
    for device, nproc, seconds, result in runs:
        norm = result.grad_norm
        rel = abs(norm - reference) / abs(reference) if norm is not None and reference else float("nan")
        precision = result.precision or {}
        print(
            f"{device:>4} N={nproc} {'sharded' if result.sharded else 'whole':>7}: {seconds:7.2f} s, "
            f"grad norm {norm!r}, rel_diff vs CPU {rel:.2e}, verdict {result.verdict}, "
            f"precision param {precision.get('param_dtype')} / reduce {precision.get('reduce_dtype')}"
        )


if __name__ == "__main__":
    main()
