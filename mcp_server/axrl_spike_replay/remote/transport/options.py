"""Options shared by every remote verb: which interpreter, host keys, timeout, patch."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from axrl_spike_replay.errors import ConfigError


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach and use a node (and the external-command knobs that also apply locally)."""

    remote_python: str | None = None  # the node's interpreter (default: spike-replay.yaml's, else python3)
    known_hosts: str | None = None  # known_hosts file to check and record in
    accept_new_host_key: bool = False  # record the key of a host not yet known (OpenSSH's accept-new)
    timeout_s: float | None = None  # kill the run (its whole process group) after this many seconds
    patches: tuple[str, ...] = ()  # unified diffs applied in order in a temporary worktree (command backend)
    cancel: threading.Event | None = field(default=None, compare=False, repr=False)  # set: stop the run

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"`timeout_s` must be a positive number of seconds, got {self.timeout_s!r}", "timeout_s")
