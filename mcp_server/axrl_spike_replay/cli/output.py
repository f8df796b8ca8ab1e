"""Shaping results for people (tables, lines) and for programs (one JSON document on stdout)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from axrl_spike_replay.display import clean_text
from axrl_spike_replay.jsonable import to_jsonable


def emit(result: Any, as_json: bool, render: Callable[[Any], str]) -> None:
    """Print `result` as one JSON document (`as_json`) or through `render` for people."""
    if as_json:
        json.dump(to_jsonable(result), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        text = for_terminal(render(result))
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def for_terminal(text: str) -> str:
    """`text` with control characters escaped on each line: names and values from snapshots cannot drive
    the terminal (escape codes in a job name are shown, not obeyed)."""
    return "\n".join(clean_text(line) for line in text.split("\n"))


def print_error(command: str, message: str) -> None:
    """The one-line-prefixed error of a failed verb on stderr, control characters escaped."""
    print(f"axrl-spike-replay {command}: error: {for_terminal(message)}", file=sys.stderr)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def progress(message: str) -> None:
    """A progress line for people, on stderr so stdout stays machine-readable."""
    print(for_terminal(message), file=sys.stderr, flush=True)


def add_json_flag(parser: Any) -> None:
    parser.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
