"""A real torchrun worker for the launcher tests: a gloo all-reduce over every process of the job, then rank 0
writes what each process saw (through the launch contract, atomically).

Knobs, from the request's payload: `ready_dir` (each process leaves a file there once the all-reduce is done),
`gate` (hold the job open until that file exists), `ignore_sigterm` (a worker that shrugs off TERM, as one busy
saving a checkpoint would: only KILL ends it); from the node's environment: AXRL_TEST_CRASH (this node's
processes exit with status 3 once ready, as a worker that crashes mid-run).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from axrl_spike_replay.processes.launch_worker import worker_context, write_result


def main() -> None:
    ctx = worker_context()
    if ctx.payload.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo", init_method="env://")
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    me = {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "group_rank": ctx.group_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "request_path": str(ctx.request_path),
        "launch_tag": os.environ.get("AXRL_LAUNCH_ID"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
    seen: list[object] = [None] * ctx.world_size
    dist.all_gather_object(seen, me)
    ready = ctx.payload.get("ready_dir")
    if ready:
        (Path(ready) / f"rank{ctx.rank}").write_text(str(os.getpid()))
    if os.environ.get("AXRL_TEST_CRASH"):
        print(f"rank {ctx.rank}: crashing on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    gate = ctx.payload.get("gate")
    while gate and not Path(gate).exists():
        time.sleep(0.05)
    dist.barrier()
    write_result(
        ctx,
        {"sum": total.item(), "world_size": ctx.world_size, "master_addr": ctx.master_addr, "processes": seen},
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
