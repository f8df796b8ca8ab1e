"""How the CLI spells the request parameters that library messages name neutrally (`top` -> `--top`)."""

from __future__ import annotations

import re

# request field -> the CLI option that sets it, where the two differ in more than `--` and dashes
_FLAGS = {
    "mitigations": "--mitigation",
    "configs": "--mitigation",
    "timeout_s": "--timeout",
    "roots": "--root",
    "gpu_memory_gib": "--gpu-memory",
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
}
_NAMED = re.compile(r"`([a-z_]+)`")


def cli_flag(parameter: str) -> str:
    """The option that sets a request field: `top` -> `--top`, `timeout_s` -> `--timeout`."""
    return _FLAGS.get(parameter, "--" + parameter.replace("_", "-"))


def for_cli(message: str) -> str:
    """A library message with every parameter it names in backquotes spelled as its CLI option."""
    return _NAMED.sub(lambda m: cli_flag(m[1]) if m[1] in _PARAMETERS else m[0], message)
