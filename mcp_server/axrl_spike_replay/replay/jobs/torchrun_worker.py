"""The replay's worker under torchrun: `python -m axrl_spike_replay.replay.jobs.torchrun_worker REQUEST.json`.

torchrun starts it (on this machine, over SSH on several nodes, or under `srun` in a Slurm allocation) once per
replay process; torchrun's environment says which process it is (`launch_worker.worker_context`). Each runs the
engine's `worker.compute` for its assigned saved ranks, exactly as a process of our spawn launcher does (one
intra-op thread, the same device choice, the same reduction), and rank 0 writes the outcomes, process 0's view
after the reduction, atomically as the launch's result.

The request's payload holds the job (`job_document`), the process-group backend and timeout, and the size of
the snapshot's checkpoint metadata as the sender saw it: a node that does not see the same file at the same path
(no shared storage there, or another copy) fails at once with a message that names its host. An expected failure
(bad input) prints one line `@@axrl-replay-error ...` and no traceback; the launcher turns it into the error
(`@@axrl-replay-crash ...` after the traceback of anything else).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import socket
import sys
import traceback
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from axrl_spike_replay.errors import AxrlError, ConfigError, SnapshotError
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.processes.launch_worker import WorkerContext, worker_context, write_result

ERROR_MARK = "@@axrl-replay-error"  # an expected failure (bad input), in one line
CRASH_MARK = "@@axrl-replay-crash"  # anything else (its traceback comes before it)
RESULT_KIND = "axrl-replay-outcomes"
EXIT_FAILED = 3


def payload_for(
    job_doc: Mapping[str, Any], *, backend: str, timeout_s: float, snapshot_check: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The request payload this worker reads (the launcher's side of it)."""
    return {"job": dict(job_doc), "backend": backend, "timeout_s": timeout_s, "snapshot_check": snapshot_check}


def snapshot_check(replay_dir: str | Path) -> dict[str, Any] | None:
    """What every node must see of the snapshot: its checkpoint metadata's path and size here (None: none here)."""
    from axrl_spike_replay.snapshot.layout import DCP_METADATA

    path = Path(replay_dir) / DCP_METADATA
    try:
        return {"path": str(path), "bytes": path.stat().st_size}
    except OSError:
        return None


def check_snapshot_seen(check: Mapping[str, Any] | None, host: str) -> None:
    """SnapshotError naming `host` unless it sees the checkpoint metadata at the same path with the same size."""
    if not check:
        return
    path, size = Path(str(check["path"])), int(check["bytes"])
    try:
        here = path.stat().st_size
    except OSError as exc:
        raise SnapshotError(
            f"host {host} does not see the snapshot: {path}: {exc.strerror or exc}; every node must read the "
            "snapshot at the same path (shared storage)"
        ) from None
    if here != size:
        raise SnapshotError(
            f"host {host} sees another snapshot at {path}: {here} bytes there, {size} where the replay was "
            "started; every node must read the same snapshot (shared storage)"
        )


def run(ctx: WorkerContext) -> list[dict[str, Any]]:
    """This process's share of the job; on rank 0 the outcomes of every config (process 0's view)."""
    import torch
    import torch.distributed as dist

    from axrl_spike_replay.processes.rank_processes import leave_collectives
    from axrl_spike_replay.replay.compute.worker import compute
    from axrl_spike_replay.replay.jobs.job_document import job_of_document
    from axrl_spike_replay.replay.jobs.job_runner import prepare_device, process_device

    payload = ctx.payload
    check_snapshot_seen(payload.get("snapshot_check"), socket.gethostname())
    job = job_of_document(payload["job"])
    if len(job.assignment) != ctx.world_size:
        raise ConfigError(
            f"the job assigns saved ranks to {len(job.assignment)} process(es) but torchrun started {ctx.world_size}"
        )
    torch.set_num_threads(1)  # as every replay process: deterministic reductions, the same as the trainer's ranks
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    local = dataclasses.replace(job, device=process_device(job.device, ctx.local_rank))
    prepare_device(local.device)
    backend = str(payload.get("backend") or "gloo")
    timeout = timedelta(seconds=float(payload.get("timeout_s") or RUN_TIMEOUT_S))
    dist.init_process_group(backend, init_method="env://", timeout=timeout)
    try:

        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        outcomes = compute(local, ctx.rank, progress=say)
        where = {"rank": ctx.rank, "host": socket.gethostname(), "device": local.device}
        placed: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(placed, where)
        dist.barrier()  # every process is done with its work
        # and has returned from that barrier before any tears the group down (`rank_processes`' ordered teardown)
        leave_collectives(dist.distributed_c10d._get_default_store(), ctx.world_size, timeout.total_seconds())
    finally:
        dist.destroy_process_group()
    if ctx.is_rank0:
        doc = {"kind": RESULT_KIND, "outcomes": [dataclasses.asdict(o) for o in outcomes], "processes": placed}
        write_result(ctx, doc)
    return [dataclasses.asdict(o) for o in outcomes]


def main(argv: Sequence[str] | None = None) -> int:
    """The worker's entry: 0 when its share is done, EXIT_FAILED with one line saying why otherwise."""
    faulthandler.enable()  # a native abort (gloo, NCCL) still prints where Python was
    rank = os.environ.get("RANK", "?")
    host = socket.gethostname()
    try:
        run(worker_context(argv))
    except AxrlError as exc:
        _say(ERROR_MARK, f"process {rank} on {host}: {exc}")
        return EXIT_FAILED
    except Exception as exc:  # a bug, or the group broke under us (a peer died): its trace, then the one line
        traceback.print_exc()
        _say(CRASH_MARK, f"process {rank} on {host}: {type(exc).__name__}: {exc}")
        return EXIT_FAILED
    return 0


def _say(mark: str, text: str) -> None:
    print(f"{mark} {' '.join(text.split())}", file=sys.stderr, flush=True)


def leave(code: int) -> NoReturn:
    """End the worker with `code` without the interpreter's finalization: the group is destroyed and the result
    written by then, and finalizing with gloo's threads still around can abort a process whose work is done
    ('terminate called without an active exception'), which torchrun reports as the job's failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
