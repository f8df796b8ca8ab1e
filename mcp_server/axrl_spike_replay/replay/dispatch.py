"""The one place a replay or sweep picks where it runs; both faces call these.

`torch` on target `local` runs the built-in engine in this process tree. Everything else (the
torch engine on an SSH target, the `command` backend) goes to `axrl_spike_replay.remote.dispatch`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.replay.engine import ReplayOptions, run_replay
from axrl_spike_replay.replay.result import ReplayResult
from axrl_spike_replay.replay.sweep import SweepResult, run_sweep

BACKENDS = ("torch", "command")


def runs_here(options: ReplayOptions, remote: Any = None) -> bool:
    """True for the built-in torch engine on this machine; checks that `remote` options fit that."""
    if options.backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {options.backend!r}")
    here = options.backend == "torch" and options.target == "local"
    if here and remote is not None:
        remote.check_local_torch()
    return here


def replay(snapshot: str | Path, options: ReplayOptions, remote: Any = None) -> ReplayResult:
    """Replay a snapshot with the backend and on the target `options` name (`remote`: RemoteOptions)."""
    if runs_here(options, remote):
        return run_replay(snapshot, options)
    from axrl_spike_replay.remote.dispatch import replay_elsewhere

    # replay_elsewhere returns ReplayResult | SweepResult; verb="replay" always gives a ReplayResult
    return replay_elsewhere(snapshot, options, remote, verb="replay")  # type: ignore[return-value]


def sweep(
    snapshot: str | Path, configs: Sequence[Mapping[str, Any]], options: ReplayOptions, remote: Any = None
) -> SweepResult:
    """Sweep mitigation configs on a snapshot with the backend and on the target `options` name."""
    if runs_here(options, remote):
        return run_sweep(snapshot, configs, options)
    from axrl_spike_replay.remote.dispatch import replay_elsewhere

    # verb="sweep" always gives a SweepResult (replay_elsewhere's return type covers both verbs)
    return replay_elsewhere(snapshot, options, remote, verb="sweep", configs=configs)  # type: ignore[return-value]
