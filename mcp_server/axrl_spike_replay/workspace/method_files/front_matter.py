"""The machine-readable YAML front matter of a method file, written and read without parsing markdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.untrusted.untrusted_yaml import load_untrusted_yaml

FENCE = "---"
MARKER = "axrl_method"


def dump(fields: dict[str, Any]) -> str:
    """`---\\n<yaml>---\\n`: the block that opens a method file."""
    return f"{FENCE}\n{yaml.safe_dump(fields, sort_keys=False, allow_unicode=True, width=1000)}{FENCE}\n"


def load(path: Path) -> dict[str, Any] | None:
    """The front matter of `path`, or None when it has none written by this tool (or cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.startswith(FENCE + "\n"):
        return None
    end = text.find(f"\n{FENCE}\n", len(FENCE))
    if end < 0:
        return None
    try:  # a method file can be edited by anyone: read it as untrusted YAML (no aliases, bounded)
        fields = load_untrusted_yaml(text[len(FENCE) + 1 : end + 1], str(path))
    except ConfigError:
        return None
    return fields if isinstance(fields, dict) and MARKER in fields else None
