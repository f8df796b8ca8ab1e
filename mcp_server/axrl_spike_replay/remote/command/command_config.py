"""The command backend's settings, as the `command_backend:` section of `spike-replay.yaml` gives them (parsed, with
the rest of the file, by `remote.workspace_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

# `grad_norm` as a whole word (`actor/grad_norm:`, not `max_grad_norm: 1.0`), then a number, nan or inf
DEFAULT_GRAD_NORM_REGEX = r"\bgrad_norm[=: ]+([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?(?:nan|inf))"


@dataclass(frozen=True)
class CommandBackendConfig:
    """The external replay command (e.g. AXRL's `MegatronWorker.reproduce_spike(snapshot_dir)` wrapper)."""

    workdir: str
    command: str
    result_json: str | None = "{out}/replay_result.json"
    grad_norm_regex: str = DEFAULT_GRAD_NORM_REGEX
    env: dict[str, str] = field(default_factory=dict)
    mitigations: dict[str, str] = field(default_factory=dict)  # our mitigation name -> override template
