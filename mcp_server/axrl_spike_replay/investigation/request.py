"""One replay request, built and validated in one place; the CLI and MCP faces only map their arguments onto it.

A request says what to replay (snapshot, mitigations, repeat; a sweep's configs; an attribution's top
and method), where (here, an SSH target, the external command backend, and how to connect) and how
(processes, device). `replay_request` checks every field and every combination of them before
anything connects or is written. Adding an option is one field here and one check in `_check`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError

VERBS = ("replay", "sweep", "attribute")
BACKENDS = ("torch", "command")
DEVICES = ("cpu", "cuda")
METHODS = ("jvp", "per_sample_backward")
MAX_REPEAT = 100  # a determinism check needs a handful of recomputations; each one is a whole replay


@dataclass(frozen=True, kw_only=True)
class ReplayRequest:
    """What to replay, where and how. Build it with `replay_request`, which validates it."""

    verb: str = "replay"  # replay | sweep | attribute
    snapshot: Path
    # what
    mitigations: Mapping[str, Any] = field(default_factory=dict)  # one config {name: value}, normalised
    repeat: int = 1
    configs: tuple[Mapping[str, Any], ...] = ()  # sweep: the configs to compare, normalised and distinct
    clear_threshold: float | None = None  # replay/sweep: spike-ratio threshold for verdicts (None: the detector's)
    top: int = 10  # attribute: samples to list
    method: str = "jvp"  # attribute: jvp | per_sample_backward
    # where
    target: str = "local"  # "local" or an SSH target (a spike-replay.yaml name or as typed)
    backend: str = "torch"  # torch (built-in engine) | command (the workspace's external replay command)
    patches: tuple[str, ...] = ()  # unified diffs applied in order in a temporary worktree (command backend)
    remote_python: str | None = None
    known_hosts: str | None = None
    accept_new_host_key: bool = False
    timeout_s: float | None = None  # kill the run (its process group) after this many seconds
    # how
    nproc: int | None = None  # None: the saved world size (full fidelity)
    device: str = "cpu"
    parallel_configs: int | None = None  # sweep: pools running configs side by side (None: 1 on CPU, GPUs/nproc)
    # recorded where
    workspace: Path | None = None  # None: nothing is written
    job: str | None = None  # default: the snapshot's job name
    command: str | None = None  # the command line for command.txt (default: the equivalent CLI)
    progress: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    cancel: threading.Event | None = field(default=None, compare=False, repr=False)  # set: stop the run

    @property
    def runs_here(self) -> bool:
        """True for the built-in torch engine on this machine; False for a node or the command backend."""
        return self.backend == "torch" and self.target == "local"

    def engine_options(self) -> Any:
        """The engine's options for a local torch run."""
        from axrl_spike_replay.replay.engine import ReplayOptions

        return ReplayOptions(
            nproc=self.nproc,
            device=self.device,
            parallel_configs=self.parallel_configs,
            mitigations=dict(self.mitigations),
            repeat=self.repeat,
            clear_threshold=self.clear_threshold,
            job=self.job,
            command=self.command,
            progress=self.progress,
            cancel=self.cancel,
        )

    def remote_options(self) -> Any:
        """The connection and external-command settings for a run on a node or with the command backend."""
        from axrl_spike_replay.remote.options import RemoteOptions

        return RemoteOptions(
            remote_python=self.remote_python,
            known_hosts=self.known_hosts,
            accept_new_host_key=self.accept_new_host_key,
            timeout_s=self.timeout_s,
            patches=self.patches,
            cancel=self.cancel,
        )


def replay_request(
    snapshot: str | Path,
    *,
    verb: str = "replay",
    mitigations: Mapping[str, Any] | None = None,
    repeat: int = 1,
    configs: Sequence[Mapping[str, Any]] = (),
    clear_threshold: float | None = None,
    top: int = 10,
    method: str = "jvp",
    target: str | None = None,
    backend: str = "torch",
    patch: str | Path | Sequence[str | Path] | None = None,
    patches: Sequence[str | Path] = (),
    remote_python: str | None = None,
    known_hosts: str | Path | None = None,
    accept_new_host_key: bool = False,
    timeout_s: float | None = None,
    nproc: int | None = None,
    device: str = "cpu",
    parallel_configs: int | None = None,
    workspace: str | Path | None = None,
    job: str | None = None,
    command: str | None = None,
    progress: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
) -> ReplayRequest:
    """The validated request for a replay, sweep or attribution; ConfigError (naming the parameter) otherwise.

    `patch` (one path or several) and `patches` combine, in that order, into one patch set.
    """
    from axrl_spike_replay.replay.mitigations import check_distinct, parse_config

    _check(verb, backend, device, nproc, repeat, top, method, timeout_s)
    where = target or "local"
    patch_set = _patch_set(patch, patches)
    _check_combination(verb, where, backend, patch_set, timeout_s)
    _check_clear_threshold(clear_threshold, verb, where, backend)
    _check_parallel_configs(parallel_configs, verb, where, backend)
    normalised = tuple(parse_config(c, f"config {i + 1}") for i, c in enumerate(configs))
    if verb == "sweep":
        check_distinct(normalised)
    return ReplayRequest(
        verb=verb,
        snapshot=Path(snapshot),
        mitigations=parse_config(mitigations) if mitigations else {},
        repeat=repeat,
        configs=normalised,
        clear_threshold=float(clear_threshold) if clear_threshold is not None else None,
        top=top,
        method=method,
        target=where,
        backend=backend,
        patches=patch_set,
        remote_python=remote_python,
        known_hosts=str(known_hosts) if known_hosts else None,
        accept_new_host_key=bool(accept_new_host_key),
        timeout_s=timeout_s,
        nproc=nproc,
        device=device,
        parallel_configs=parallel_configs,
        workspace=Path(workspace) if workspace is not None else None,
        job=job,
        command=command,
        progress=progress,
        cancel=cancel,
    )


def _check(
    verb: str, backend: str, device: str, nproc: Any, repeat: Any, top: Any, method: str, timeout_s: Any
) -> None:
    """Each field on its own."""
    if verb not in VERBS:
        raise ConfigError(f"verb must be one of {', '.join(VERBS)}, got {shown(verb)}")
    if backend not in BACKENDS:
        raise ConfigError(f"`backend` must be one of {', '.join(BACKENDS)}, got {shown(backend)}", "backend")
    if device not in DEVICES:
        raise ConfigError(f"`device` must be one of {', '.join(DEVICES)}, got {shown(device)}", "device")
    if nproc is not None and (not _is_int(nproc) or nproc < 1):
        raise ConfigError(f"`nproc` must be an integer >= 1, got {shown(nproc)}", "nproc")
    if not _is_int(repeat) or not 1 <= repeat <= MAX_REPEAT:
        raise ConfigError(f"`repeat` must be an integer from 1 to {MAX_REPEAT}, got {shown(repeat)}", "repeat")
    if not _is_int(top) or top < 1:
        raise ConfigError(f"`top` must be an integer >= 1, got {shown(top)}", "top")
    if method not in METHODS:
        raise ConfigError(f"`method` must be one of {', '.join(METHODS)}, got {shown(method)}", "method")
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
    ):
        raise ConfigError(f"`timeout_s` must be a positive number of seconds, got {shown(timeout_s)}", "timeout_s")


def _patch_set(patch: Any, patches: Any) -> tuple[str, ...]:
    """`patch` (a path or a sequence of them) then `patches`, as one ordered tuple of path strings."""
    items: list[Any] = []
    for value in (patch, patches):
        if value is None or value == "":
            continue
        items += [value] if isinstance(value, (str, Path)) else list(value)
    for item in items:
        if not isinstance(item, (str, Path)) or not str(item).strip():
            raise ConfigError(f"`patch` must be the path of a unified diff file, got {shown(item)}", "patch")
    return tuple(str(item) for item in items)


def _check_combination(verb: str, target: str, backend: str, patches: tuple[str, ...], timeout_s: Any) -> None:
    """Options that cannot work together, refused before anything connects or is written. (Which mitigations
    the command backend can run is the workspace's `spike-replay.yaml`'s to say: `investigation.elsewhere`.)"""
    if verb == "attribute" and (target != "local" or backend != "torch"):
        raise ConfigError("`target`: attribution runs here with the built-in torch engine", "target")
    if backend != "command" and patches:
        raise ConfigError(
            "`patch` applies to the training checkout the command backend runs; add `backend` command", "patch"
        )
    if target == "local" and backend == "torch" and timeout_s is not None:
        raise ConfigError("`timeout_s` applies to runs on a `target` or with `backend` command", "timeout_s")


def _check_clear_threshold(value: Any, verb: str, target: str, backend: str) -> None:
    """The user's verdict threshold: a finite ratio > 0, for replays and sweeps of the local torch engine."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"`clear_threshold` must be a finite spike ratio > 0 (grad norm / median), got {shown(value)}",
            "clear_threshold",
        )
    if verb == "attribute":
        raise ConfigError(
            "`clear_threshold` judges replays and sweeps; attribution gives no verdict", "clear_threshold"
        )
    if target != "local" or backend != "torch":
        raise ConfigError(
            "`clear_threshold` applies to the built-in torch engine run here; a run on a `target` or with `backend` "
            "command is judged by the snapshot's detector threshold",
            "clear_threshold",
        )


def _check_parallel_configs(value: Any, verb: str, target: str, backend: str) -> None:
    """Pools for a sweep's configs: an integer >= 1, for sweeps of the built-in torch engine run here."""
    if value is None:
        return
    if not _is_int(value) or value < 1:
        raise ConfigError(f"`parallel_configs` must be an integer >= 1, got {shown(value)}", "parallel_configs")
    if verb != "sweep" or target != "local" or backend != "torch":
        raise ConfigError(
            "`parallel_configs` spreads a sweep's configs over pools of the built-in torch engine run here",
            "parallel_configs",
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
