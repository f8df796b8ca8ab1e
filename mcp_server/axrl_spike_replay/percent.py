"""Fractions shown as percentages, one rule for every face: a change against a baseline is signed (`-96.3%`),
a share of a whole is not (`82.8%`). Results keep the fractions; only what people read is in percent."""

from __future__ import annotations

import math
from typing import Any


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def pct(value: Any) -> str:
    """A relative change as a signed percentage (`-63.2%`), `n/a` when missing."""
    return f"{value * 100:+.1f}%" if _finite(value) else "n/a"


def pct_plain(value: Any) -> str:
    """A fraction as an unsigned percentage (`8.7%`), `n/a` when missing."""
    return f"{value * 100:.1f}%" if _finite(value) else "n/a"
