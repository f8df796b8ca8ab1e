"""Warm replay service: long-lived rank processes that run replay jobs, with the snapshot weights kept loaded.

A cold replay spawns its ranks, imports torch and DCP in each, forms the process group, loads the
weights, computes for a fraction of a second and tears everything down. A long-lived server (MCP)
keeps all of that instead: `WarmService.run_job` runs a `WorkerJob` (the same `worker.compute`, so
the results are bit-identical to a cold run) on a pool of processes that stay up between calls.

- One pool per (processes, device, collective timeout, slot); pools idle longer than `idle_s` shut down.
  A sweep that runs configs in parallel uses one slot per pool (slot `s` of `n` processes computes on
  devices `s*n ...`, see `launch.process_device`).
- Each process keeps built models in an LRU cache keyed by the weights dir, the model config and
  the path, size, mtime and inode of every file under the dir: a rewritten or touched snapshot is
  loaded again. The cache holds at most `memory_bytes` (default a quarter of RAM) over all processes.
- Cancelling a call stops every rank at the same point (they agree over the group before each
  config), so the pool survives; a rank that does not stop in time gets its pool killed.
- A pool whose process died is restarted and the job rerun once (a replay only reads its inputs).
- A one-process job runs in the calling process (no spawn at all), with the same weight cache.

Pool processes come from `process_starts` (forked from a server that imported torch once: a pool starts in a
fraction of a second after the first) and die with the server however it dies (see
`process_starts.die_with_launcher`); `close` stops them. Where they are spawned instead, the kernel ties that to
the thread that started them, so pools are started from one long-lived thread of the service, never from a
caller's (short-lived worker threads would take their pools with them).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.files.temp_janitor import owned_temp_dir
from axrl_spike_replay.processes.rank_processes import RankProcessError, RunCancelled

if TYPE_CHECKING:
    from collections.abc import Callable

    from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob

_POLL_S = 0.2
_START_TIMEOUT_S = 300.0  # spawning, importing torch and forming the group, on a loaded machine
_CANCEL_GRACE_S = 10.0  # how long ranks get to reach their next cancel point before the pool is killed
_STOP_GRACE_S = 5.0
_PEER_DEATH_S = 1.0  # after a rank's error, how long to look for a peer whose death caused it
DEFAULT_IDLE_S = 900.0
MEMORY_FRACTION = 0.25


def default_memory_bytes() -> int:
    """A quarter of this machine's RAM (4 GiB where it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * MEMORY_FRACTION)
    except (ValueError, OSError, AttributeError):
        return 4 << 30


WEIGHT_FILE_NAMES = (".metadata", "config.json")
WEIGHT_FILE_SUFFIXES = (".distcp", ".safetensors")


def files_signature(directory: str) -> tuple[tuple[str, int, int, int, int], ...]:
    """(name, size, mtime ns, device, inode) of every weights file under `directory` (DCP `.metadata` and
    `*.distcp`; an HF directory's `config.json` and `*.safetensors`).

    Those are the files the weights are read from: the signature changes when any of them is rewritten
    or touched. Names relative to the dir and file identity (device, inode), not the dir's path, so a
    legacy snapshot read through a fresh dir of links on each call still hits the cache.
    """
    out: list[tuple[str, int, int, int, int]] = []
    stack = [Path(directory)]
    while stack:
        current = stack.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                    continue
                if entry.name not in WEIGHT_FILE_NAMES and not entry.name.endswith(WEIGHT_FILE_SUFFIXES):
                    continue
                st = entry.stat()  # a link is keyed by what it points to: that is what DCP reads
                name = os.path.relpath(entry.path, directory)
                out.append((name, st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino))
    return tuple(sorted(out))


class ModelCache:
    """Built policies keyed by weights dir + model config + device + the dir's file signature; LRU in bytes."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._models: OrderedDict[tuple[Any, ...], tuple[Any, int]] = OrderedDict()
        self.hits = 0
        self.loads = 0

    def model(self, cfg: Any, weights_dir: str, device: str, placement: Any = None) -> Any:
        """The policy for these weights: from the cache while the files are unchanged, else built (`build_model`).

        A sharded model (its placement says so) lives in the pool's process group, which outlives it: every rank
        of the pool keeps its own shards under the same key, so all hit or all build together."""
        from axrl_spike_replay.replay.compute.model_build import build_model

        signature = files_signature(weights_dir)
        hf_path = getattr(cfg, "path", None)  # an HF model may read its weights from the spec's own directory
        if hf_path is not None and Path(hf_path).is_dir():
            signature += files_signature(str(hf_path))
        key = (repr(cfg), device, repr(placement), signature)
        if key in self._models:
            self._models.move_to_end(key)
            self.hits += 1
            return self._models[key][0]
        model = build_model(cfg, weights_dir, device, placement)
        self.loads += 1
        size = _held_bytes(model)
        if size <= self.budget_bytes:
            self._models[key] = (model, size)
            while sum(s for _, s in self._models.values()) > self.budget_bytes:
                self._models.popitem(last=False)
        return model

    def __len__(self) -> int:
        return len(self._models)


def _held_bytes(model: Any) -> int:
    """Bytes a process holds of a model's state: a sharded one's whole size over the group (the same number on
    every rank, so every rank of a pool caches, evicts and rebuilds it alike: a build is a collective)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    state = model.state_dict().values()
    total = sum(t.numel() * t.element_size() for t in state)
    if any(isinstance(t, DTensor) for t in state) and dist.is_initialized():
        return -(-total // dist.get_world_size())
    return total


class _AgreedCancel(threading.Event):
    """A cancel flag every rank reads the same way: `is_set` takes the max of all ranks' views over the group.

    `worker.compute` checks cancellation at the same points in every rank (before each config), so
    all ranks stop together and the group stays usable.
    """

    def __init__(self, shared: Any) -> None:
        super().__init__()
        self.shared = shared

    def is_set(self) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.shared.is_set() else 0], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _serve_rank(
    rank: int,
    nproc: int,
    conn: Any,
    cancel: Any,
    device: str,
    store_dir: str,
    timeout_s: float,
    budget_bytes: int,
    environment: dict[str, str],
    first_device: int = 0,
) -> None:
    """A pool process: join the group, then run jobs from `conn` until told to stop (None) or orphaned."""
    import faulthandler

    from axrl_spike_replay.processes.process_starts import adopt_environment, die_with_launcher

    die_with_launcher()
    adopt_environment(environment)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # the import a cold replay pays on every call

    from axrl_spike_replay.replay.compute.worker import compute
    from axrl_spike_replay.replay.compute.worker_job import WorkerJob
    from axrl_spike_replay.replay.jobs.job_runner import backend_for, prepare_device, process_device

    faulthandler.enable()
    torch.set_num_threads(1)
    local_device = process_device(device, first_device + rank)
    prepare_device(local_device)
    store = dist.FileStore(str(Path(store_dir) / "store"), nproc)  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group(
        backend_for(device, nproc), store=store, rank=rank, world_size=nproc, timeout=timedelta(seconds=timeout_s)
    )
    cache = ModelCache(budget_bytes)
    agreed = _AgreedCancel(cancel)
    conn.send(("ready", rank))
    try:
        while True:
            job = conn.recv()
            if job is None:
                break
            local = WorkerJob(**{**{n: getattr(job, n) for n in job.__dataclass_fields__}, "device": local_device})
            try:
                outcomes = compute(
                    local, rank, agreed, models=cache.model, progress=lambda line: conn.send(("progress", line))
                )
                conn.send(("done", [asdict(o) for o in outcomes] if rank == 0 else None))
            except RunCancelled:
                conn.send(("cancelled", None))
            except AxrlError as exc:
                conn.send(("error", f"replay {rank}: {exc}"))
            except Exception:
                conn.send(("trace", traceback.format_exc()))
    except (EOFError, OSError):
        pass  # the server went away
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _PoolDied(RankProcessError):
    """A pool process exited while the pool was in use."""


@dataclass(frozen=True)
class PoolKey:
    """What makes a pool: processes, device, the collective timeout its group was made with, and its slot."""

    nproc: int
    device: str
    timeout_s: float
    slot: int = 0  # parallel sweeps: one pool per slot, on devices slot * nproc ...


class RankPool:
    """`nproc` long-lived processes in one process group, running one job at a time."""

    def __init__(self, key: PoolKey, budget_bytes: int) -> None:
        import torch.multiprocessing  # noqa: F401  (its pickling of tensors, as torch's own spawn uses)

        from axrl_spike_replay.processes.process_starts import launcher_environment, rank_context

        self.key = key
        self.last_used = time.monotonic()
        self.lock = threading.Lock()
        self._stack = ExitStack()
        store_dir = self._stack.enter_context(owned_temp_dir("axrl-warm-"))
        ctx = rank_context()
        environment = launcher_environment()
        self._cancel = ctx.Event()
        self.conns: list[Any] = []
        self.processes: list[Any] = []
        try:
            for rank in range(key.nproc):
                parent, child = ctx.Pipe()
                args = (rank, key.nproc, child, self._cancel, key.device, store_dir, key.timeout_s)
                process = ctx.Process(
                    target=_serve_rank,
                    args=(*args, max(budget_bytes // key.nproc, 0), environment, key.slot * key.nproc),
                    name=f"axrl-warm-{rank}",
                    daemon=True,
                )
                process.start()
                child.close()
                self.conns.append(parent)
                self.processes.append(process)
            self._await_ready()
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """The pool's process ids, rank order."""
        return [p.pid for p in self.processes if p.pid is not None]

    def alive(self) -> bool:
        """True while every process of the pool runs."""
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    def _await_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        for rank, conn in enumerate(self.conns):
            while not conn.poll(_POLL_S):
                if not self.processes[rank].is_alive():
                    raise _PoolDied(f"warm replay process {rank} exited while starting")
                if time.monotonic() > deadline:
                    raise RankProcessError(f"warm replay process {rank} did not start in {_START_TIMEOUT_S:g} s")
            conn.recv()

    def run(
        self, job: WorkerJob, cancel: threading.Event | None, progress: Callable[[str], None] | None
    ) -> list[ConfigOutcome]:
        """Outcomes of `job` (process 0's); raises as a cold run would. A failed job closes the pool."""
        from multiprocessing.connection import wait

        from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome

        if not self.alive():
            raise _PoolDied("a warm replay process is gone")
        self._cancel.clear()
        try:
            for conn in self.conns:
                conn.send(job)
        except OSError as exc:
            raise _PoolDied(f"a warm replay process is gone ({exc})") from None
        replies: dict[int, tuple[str, Any]] = {}
        cancelled_at: float | None = None
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        while waiting:
            if cancel is not None and cancel.is_set() and cancelled_at is None:
                self._cancel.set()
                cancelled_at = time.monotonic()
            if cancelled_at is not None and time.monotonic() - cancelled_at > _CANCEL_GRACE_S:
                self.close()
                raise RunCancelled("replay cancelled; its warm processes were stopped")
            for ready in wait([*waiting, *sentinels], timeout=_POLL_S):
                if ready in sentinels:
                    rank = sentinels[ready]
                    if self.processes[rank].exitcode is not None and self.conns[rank] in waiting:
                        if self.conns[rank].poll():  # it replied before dying: read that first
                            continue
                        self.close()
                        raise _PoolDied(f"warm replay process {rank} died (exit code {self.processes[rank].exitcode})")
                    continue
                rank = waiting[ready]
                try:
                    kind, value = self.conns[rank].recv()
                except (EOFError, OSError):
                    self.close()
                    raise _PoolDied(f"warm replay process {rank} died") from None
                if kind == "progress":
                    if progress is not None:
                        progress(value)
                    continue
                replies[rank] = (kind, value)
                del waiting[ready]
                if kind in ("error", "trace"):
                    dead = self._dead_peer()  # a peer that died mid-job makes the others fail: the death is the cause
                    self.close()  # the others may wait in a collective: this group cannot be trusted again
                    if dead is not None:
                        raise _PoolDied(f"warm replay process {dead} died during the job")
                    if kind == "error":
                        raise RankProcessError(value)
                    last = value.strip().splitlines()[-1] if value.strip() else "unknown error"
                    raise RankProcessError(f"replay {rank}: {last}", value)
        self.last_used = time.monotonic()
        if any(kind == "cancelled" for kind, _ in replies.values()):
            raise RunCancelled("replay cancelled")
        return [ConfigOutcome(**item) for item in replies[0][1]]

    def _dead_peer(self) -> int | None:
        """The first pool process that has exited, waiting briefly: pool processes only exit when they crash."""
        from multiprocessing.connection import wait

        wait([p.sentinel for p in self.processes], timeout=_PEER_DEATH_S)
        return next((rank for rank, p in enumerate(self.processes) if p.exitcode is not None), None)

    def close(self) -> None:
        """Stop every process (ask, then terminate, then kill) and remove the pool's temp dir."""
        for conn in self.conns:
            with suppress(OSError, ValueError):
                conn.send(None)
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in self.processes:
            process.join(timeout=max(deadline - time.monotonic(), 0.0))
            if process.is_alive():
                process.terminate()
                process.join(timeout=_STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []
        self._stack.close()


class WarmService:
    """Pools of warm replay processes for a long-lived server; `run_job` is a drop-in for `job_runner.run_job`."""

    def __init__(self, memory_bytes: int | None = None, idle_s: float = DEFAULT_IDLE_S) -> None:
        self.memory_bytes = default_memory_bytes() if memory_bytes is None else memory_bytes
        self.idle_s = idle_s
        self.local_cache = ModelCache(self.memory_bytes)  # one-process jobs, run in this process
        self._pools: dict[PoolKey, RankPool] = {}
        self._lock = threading.Lock()
        self._local_lock = threading.Lock()
        self._stopped = threading.Event()  # ends the reaper (the process is exiting)
        # Pool processes die with the thread that started them (PR_SET_PDEATHSIG): start them from this one.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warm-pool-spawner")
        self.restarts = 0
        self._reaper = threading.Thread(target=self._reap, name="warm-pool-reaper", daemon=True)
        self._reaper.start()

    def run_job(
        self,
        job: WorkerJob,
        timeout_s: float = RUN_TIMEOUT_S,
        cancel: threading.Event | None = None,
        progress: Callable[[str], None] | None = None,
        *,
        slot: int = 0,
    ) -> list[ConfigOutcome]:
        """Outcomes of `job`, as `job_runner.run_job` gives them, on a warm pool (or here for one process in slot 0).

        `slot` picks one of several pools of the same layout (a sweep running configs in parallel)."""
        from axrl_spike_replay.replay.jobs.job_runner import run_job

        nproc = len(job.assignment)
        if nproc == 1 and slot == 0 and not job.shard:  # a sharded one needs a process group: a pool of one
            with self._local_lock:  # the cache and torch's thread settings are this process's
                return run_job(job, timeout_s, cancel, models=self.local_cache.model, progress=progress)
        key = PoolKey(nproc, job.device, timeout_s, slot)
        for attempt in range(2):
            pool = self._pool(key, progress)
            with pool.lock:
                try:
                    return pool.run(job, cancel, progress)
                except _PoolDied as died:
                    self._forget(key, pool)
                    if attempt == 1:
                        raise RankProcessError(str(died)) from None
                    self.restarts += 1
                    if progress is not None:
                        progress(f"{died}; restarting the warm processes and running again (a replay only reads)")
                except RunCancelled:
                    if not pool.alive():
                        self._forget(key, pool)
                    raise
                except BaseException:
                    if not pool.alive():
                        self._forget(key, pool)
                    raise
        raise AssertionError("unreachable")

    def _pool(self, key: PoolKey, progress: Callable[[str], None] | None) -> RankPool:
        with self._lock:
            pool = self._pools.get(key)
            if pool is not None and pool.alive():
                return pool
            if pool is not None:
                if progress is not None:
                    progress("a warm replay process is gone; restarting the pool")
                self.restarts += 1
                pool.close()
            if progress is not None:
                progress(f"starting {key.nproc} warm replay process(es) on {key.device} (kept for later calls)")
            pool = self._spawner.submit(RankPool, key, self.memory_bytes).result()
            self._pools[key] = pool
            return pool

    def _forget(self, key: PoolKey, pool: RankPool) -> None:
        with self._lock:
            if self._pools.get(key) is pool:
                del self._pools[key]
        pool.close()

    def pools(self) -> dict[PoolKey, list[int]]:
        """The live pools and their process ids."""
        with self._lock:
            return {key: pool.pids for key, pool in self._pools.items()}

    def _reap(self) -> None:
        while not self._stopped.wait(min(self.idle_s / 4, 30.0)):
            now = time.monotonic()
            with self._lock:
                idle = [(k, p) for k, p in self._pools.items() if now - p.last_used > self.idle_s]
            for key, pool in idle:
                if pool.lock.acquire(blocking=False):  # never a pool in use
                    try:
                        self._forget(key, pool)
                    finally:
                        pool.lock.release()

    def close(self) -> None:
        """Shut every pool down (their processes exit); a later call starts a fresh pool."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
