"""JSON we did not write: bounded depth (checked before parsing) and bounded integers (read it with
`untrusted_bytes.read_bounded`).

Python's json recurses once per nesting level and converts integers of any length, so a hostile
document can exhaust the stack or the CPU; these checks refuse it first. Errors are ValueErrors
with short, printable reasons; callers prefix the file name and choose the error class.
"""

from __future__ import annotations

import json
import re
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError, utf8_text

MAX_JSON_INT_DIGITS = 20  # any count or id fits in 64 bits; Python refuses ints over 4300 digits anyway
# A string runs to its closing quote, or to the end of an unterminated one (then the text is no JSON, and the
# scan ends there): every match succeeds from its quote, so no text is scanned twice and the count stays linear.
# Brackets come in runs (`[[[[`, `]}]`): one match per run, so deep nesting costs a few matches, not one per level.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)|[\[{]+|[\]}]+', re.DOTALL)


class UntrustedJsonError(UntrustedInputError):
    """A document that is not usable: the message says why, without the file name."""


def json_depth(text: str) -> int:
    """Deepest nesting of objects and arrays in `text`, counted without recursion (strings skipped)."""
    depth = deepest = 0
    for match in _JSON_TOKEN.finditer(text):
        first = match.group()[0]
        if first in "[{":
            depth += match.end() - match.start()
            deepest = max(deepest, depth)
        elif first != '"':
            depth -= match.end() - match.start()
    return deepest


def json_within(text: str, limit: int) -> tuple[str, bool]:
    """`text` with each array or object nested deeper than `limit` replaced by `null` (strings skipped), and whether
    anything was cut; one pass, without recursion: what is left parses within `limit` levels, and what is cut is
    never parsed."""
    pieces: list[str] = []
    depth, copied, cut_at = 0, 0, -1
    for match in _JSON_TOKEN.finditer(text):
        first, start, run = match.group()[0], match.start(), match.end() - match.start()
        if first in "[{":
            if depth <= limit < depth + run:  # this run opens the level below the limit
                cut_at = start + limit - depth
                pieces.append(text[copied:cut_at])
            depth += run
        elif first != '"':
            if depth > limit >= depth - run and cut_at >= 0:  # this run closes it again
                pieces.append("null")
                copied, cut_at = start + depth - limit, -1
            depth -= run
    if not pieces:
        return text, False
    pieces.append(text[copied:] if cut_at < 0 else "null")
    return "".join(pieces), True


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise UntrustedJsonError(f"holds an integer of {len(digits)} digits (more than {MAX_JSON_INT_DIGITS})")
    return int(digits)


def parse_untrusted_json(data: bytes, max_depth: int) -> Any:
    """The document in `data` (UTF-8 JSON, nesting at most `max_depth`); UntrustedJsonError saying why not."""
    text = utf8_text(data)
    if json_depth(text) > max_depth:
        raise UntrustedJsonError(f"nests deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise UntrustedJsonError(f"is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except UntrustedJsonError:
        raise
    except (ValueError, RecursionError) as exc:
        raise UntrustedJsonError(f"is not valid JSON ({shown(str(exc), 120, quote=False)})") from None
