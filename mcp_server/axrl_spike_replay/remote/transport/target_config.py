"""Named nodes of `spike-replay.yaml` and what a `--target` resolves to: the target types every remote module shares
(`workspace_config` parses them, `launch_config` and `launch_job` use them), below all of them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from axrl_spike_replay.remote.transport.target import SshTarget, parse_target

DEFAULT_PYTHON = "python3"


@dataclass(frozen=True)
class TargetConfig:
    """A named node: how to reach it and how to run Python there."""

    name: str
    ssh: SshTarget
    python: str = DEFAULT_PYTHON
    setup: tuple[str, ...] = ()
    known_hosts: str | None = None


@dataclass(frozen=True)
class ResolvedTarget:
    """What `--target` names: a configured target, or a literal ssh string (python and setup by default)."""

    ssh: SshTarget
    python: str = DEFAULT_PYTHON
    setup: tuple[str, ...] = ()
    known_hosts: str | None = None
    name: str | None = None

    @property
    def label(self) -> str:
        """The target as given: its name in spike-replay.yaml, else the ssh text."""
        return self.name or self.ssh.spec or self.ssh.label


def resolve_named(text: str, targets: Mapping[str, TargetConfig], remote_python: str | None = None) -> ResolvedTarget:
    """The target named `text` in `targets`, else `text` as a literal ssh string; `remote_python` overrides python."""
    configured = targets.get(text.strip()) if isinstance(text, str) else None
    if configured is not None:
        return ResolvedTarget(
            ssh=configured.ssh,
            python=remote_python or configured.python,
            setup=configured.setup,
            known_hosts=configured.known_hosts,
            name=configured.name,
        )
    return ResolvedTarget(ssh=parse_target(text), python=remote_python or DEFAULT_PYTHON)
