"""Showing untrusted values: bounded length and no raw control characters (no terminal escapes)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

DEFAULT_LIMIT = 200


def clean_text(text: str) -> str:
    """`text` with control characters (ESC, CR, NUL, ...) escaped, so it cannot drive a terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def shown(value: Any, limit: int = DEFAULT_LIMIT, quote: bool = True) -> str:
    """A short, printable rendering of `value` for messages: repr (or the plain text), cut at `limit`."""
    if isinstance(value, str):
        head = value[: limit + 1]
        text = repr(head) if quote else clean_text(head)
        total = len(value)
    else:
        try:
            text = repr(value)
        except Exception:  # a hostile __repr__ must not break an error message
            text = f"<{type(value).__name__}>"
        text = clean_text(text)
        total = len(text)
    if total > limit:
        return f"{text[:limit]}… ({total} characters)"
    return text


NAME_LIMIT = 40  # a key or section name quoted from a file we did not write
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def shown_names(names: Iterable[Any], limit: int = 8) -> str:
    """Names read from a file we did not write (unknown keys, sections), for messages: `['a', 'b']`, each a plain
    name of at most NAME_LIMIT characters, at most `limit` of them; the rest counted, never quoted. So a file read
    by mistake (a run config that is some other file) shows nothing of its lines."""
    listed = [str(name) for name in names]
    plain = [name for name in listed if len(name) <= NAME_LIMIT and _PLAIN_NAME.fullmatch(name)]
    other = len(listed) - len(plain)
    parts = [f"[{', '.join(repr(name) for name in plain[:limit])}]"] if plain else []
    if len(plain) > limit:
        parts.append(f"{len(plain) - limit} more")
    if other:
        parts.append(f"{other} not shown (not {'a plain name' if other == 1 else 'plain names'})")
    return " and ".join(parts) or "[]"
