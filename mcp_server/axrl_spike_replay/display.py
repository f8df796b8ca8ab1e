"""Showing untrusted values: bounded length and no raw control characters (no terminal escapes)."""

from __future__ import annotations

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
