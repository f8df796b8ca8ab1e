"""One process of a two-process TRL GRPO run (torchrun starts two; accelerate joins them over gloo on the CPU):
the tiny run of trl_run.py with the spike guard attached, writing its snapshot under argv[1]. Each process's part
of the snapshot is written collectively; rank 0 prints the snapshot's path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist
from trl_run import RunSpec, trainer

from axrl_spike_replay.capture.detectors import MedianRatioDetector
from axrl_spike_replay.capture.trl_callback import attach_spike_guard
from axrl_spike_replay.processes.rank_processes import leave_collectives


def main() -> None:
    out = Path(sys.argv[1])
    run = trainer(out, RunSpec())
    callback = attach_spike_guard(
        run, out / "spikes", detector=MedianRatioDetector(window=4, threshold=5.0, warmup=3), job_name="trl-ddp"
    )
    run.train()
    tripped = [d.step for d in callback.decisions if d.tripped]
    if run.accelerator.process_index == 0:
        print(f"TRIPPED {tripped} SNAPSHOTS {[str(p) for p in callback.guard.snapshots]}", flush=True)
    end_in_order()


def end_in_order() -> None:
    """Tear the group down only once every process has left its last collective: a process that exits while its
    peer is still inside one makes the peer abort in gloo (`terminate called without an active exception`)."""
    if not dist.is_initialized():
        return
    dist.barrier()
    leave_collectives(dist.distributed_c10d._get_default_store(), dist.get_world_size(), 120.0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
