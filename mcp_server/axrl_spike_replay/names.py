"""Plain names: which names from outside (jobs, method slugs, names read off directories) may become a file name."""

from __future__ import annotations

import re

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError

_PLAIN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~+-]*")
MAX_NAME = 200


def check_plain_name(name: str, what: str) -> str:
    """`name` if it is a plain, visible file name (no separators, not `.`/`..`); else ConfigError."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{what} is empty; give a plain file name such as 'tis-clip-2'")
    if "/" in name or "\\" in name or "\x00" in name:
        raise ConfigError(f"{what} {shown(name)} is not a plain file name: it contains a path separator")
    if name.startswith("."):
        raise ConfigError(f"{what} {shown(name)} is not a plain file name: it is hidden or a relative path")
    # fullmatch: `$` would let a trailing newline through
    if len(name) > MAX_NAME or not _PLAIN_NAME_RE.fullmatch(name):
        raise ConfigError(
            f"{what} {shown(name)} is not a plain file name: use letters, digits and . _ ~ + - "
            f"(at most {MAX_NAME} characters)"
        )
    return name
