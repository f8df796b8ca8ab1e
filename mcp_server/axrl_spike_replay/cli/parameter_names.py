"""How the CLI spells the request parameters that library messages name neutrally (`top` -> `--top`)."""

from __future__ import annotations

import re

from axrl_spike_replay.experiment.request.request_fields import declared_fields
from axrl_spike_replay.investigation.request import How, What, Where

# the request fields whose CLI options are generated from their declarations: each option as declared
_DECLARED = {name: d.option(name) for name, d, _ in declared_fields(What, Where, How) if d.cli}
# request field -> the CLI option that sets it, where the two differ in more than `--` and dashes
_FLAGS = {
    "mitigations": "--mitigation",
    "configs": "--mitigation",
    "roots": "--root",
    "gpu_memory_gib": "--gpu-memory",
    **{name: flag for name, flag in _DECLARED.items() if flag != "--" + name.replace("_", "-")},
}
# fields with no option of the same name on any verb stay as the library wrote them
_PARAMETERS = {
    "snapshot",
    "nproc",
    "device",
    "repeat",
    "top",
    "method",
    "backend",
    "target",
    "patch",
    "remote_python",
    "known_hosts",
    "accept_new_host_key",
    "workspace",
    "job",
    "allow_reduced",
    "parallel_configs",
    "clear_threshold",
    "host",
    "http",
    "token_file",
    "no_auth",
    "gpus",
    *_FLAGS,
    *_DECLARED,
}
_NAMED = re.compile(r"`([a-z_]+)`")


def cli_flag(parameter: str) -> str:
    """The option that sets a request field: `top` -> `--top`, `timeout_s` -> `--timeout`."""
    return _FLAGS.get(parameter, "--" + parameter.replace("_", "-"))


def for_cli(message: str) -> str:
    """A library message with every parameter it names in backquotes spelled as its CLI option."""
    return _NAMED.sub(lambda m: cli_flag(m[1]) if m[1] in _PARAMETERS else m[0], message)
