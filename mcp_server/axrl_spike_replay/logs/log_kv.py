"""Runs of key=value log lines of one layout (verl: `step:12 - actor/grad_norm:3.1 - actor/pg_loss:0.01 - ...`),
read with one C-level match a line instead of the reference parsers.

A line's layout is the line with each maximal run of ASCII digits standing for any non-empty run of digits,
but for the digits inside its keys, which stay as written. A line the reference parsers read is the prototype:
its layout becomes a pattern (`Layout`) that matches exactly the lines of that layout and captures the values
the prototype's step, grad norm and loss come from. The lines after it that the pattern matches read as it does:
- Same pairs: no pattern of `log_lines` has a digit in it or tells one ASCII digit from another (digits are
  only met through `\\d`, `\\w` and `[\\w./-]`), and none can start or end a match inside a digit run: a pair
  starts after a non-`[\\w./-]` character or at the previous pair's end, its key and number are possessive or
  greedy inside an atomic group (a run is taken whole), and `(?![\\w.])` fails inside one. So the pairs of a
  line of the same layout are at the same places, with the same keys (their digits are pinned) and values
  whose digit runs alone differ; `_plan` of the same keys picks the same pairs.
- Same error kind (none): `error_kind`'s words and patterns hold no digit and meet digits only through `\\w`
  (a run stays a non-empty run of word characters), so whether they match depends only on the bytes around
  the digit runs, which are the prototype's; a prototype with an error kind makes no pattern.
- Same parser: `terat`, which `parse_line` needs to try its Megatron pattern, is in neither (else in both).
- Same text: the lines are ASCII, so the bytes are the text the reference reads.
The values are then converted as `parse_line` converts them (`int(float(step))`, which may fail for `1e999`
or `nan`, and `float`). Lines the pattern does not match are left to the caller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from axrl_spike_replay.logs.log_lines import error_kind, key_values, pair_spans, parse_line, plan
from axrl_spike_replay.logs.log_series import SeriesBuilder

MAX_PROTOTYPE_BYTES = 4096  # longer lines are read by the reference parsers alone (bounded pattern size)
_DIGITS = b"0123456789"
_DIGIT_RUN = re.compile(rb"[0-9]+")
_MAX_LAYOUTS = 64
# Making a layout costs about as much as reading a hundred lines by the reference parsers: layouts are made
# while they pay, `_FREE_LAYOUTS` and then one per `_LINES_PER_LAYOUT` lines they read (a log whose layouts
# change every line or two is read at about the reference parsers' pace, not slower)
_FREE_LAYOUTS, _LINES_PER_LAYOUT = 16, 64


@dataclass(frozen=True)
class Layout:
    """A pattern matching b"\\n" + a line of one layout (before its newline), with groups `s`, `g`, `l`: the
    step, grad norm and loss values (an empty group for one the layout has none of)."""

    pattern: re.Pattern[bytes]
    both: bool  # a grad norm and a loss in every line

    @property
    def groups(self) -> tuple[int, int, int]:
        """Where the step, grad norm and loss are in `findall`'s tuples."""
        index = self.pattern.groupindex
        return index["s"] - 1, index["g"] - 1, index["l"] - 1


def layout_of(line: bytes) -> Layout | None:
    """The layout of `line` (a line without its newline), or None when it is no prototype: not ASCII, long,
    with an error kind or no point, or a Megatron line."""
    return _prototype(line)[0]


def _prototype(line: bytes) -> tuple[Layout | None, bool]:
    """(`layout_of(line)`, whether a line that differs from `line` only in its digits has no layout either)."""
    if len(line) > MAX_PROTOTYPE_BYTES or not line.isascii():
        return None, False
    text = line.decode("ascii")
    read = text + "\n"  # as the text reader gives it
    if "terat" in text.lower() or error_kind(read) is not None:
        return None, True
    spans = pair_spans(text)
    if [(text[slice(*key)], text[slice(*value)]) for key, value in spans] != key_values(text):
        return None, False  # (never so: `pair_spans` finds the pairs `parse_line` reads)
    step, grad, loss = plan(tuple(text[slice(*key)] for key, _ in spans))
    if step is None or (grad is None and loss is None) or parse_line(read) is None:
        return None, False  # (keys' digits may differ; a step that is no integer, `1e999`, too)
    groups = {"s": spans[step][1]}
    if grad is not None:
        groups["g"] = spans[grad][1]
    if loss is not None:
        groups["l"] = spans[loss][1]
    pattern = _pattern(line, [key for key, _ in spans], groups)
    return (None if pattern is None else Layout(pattern, grad is not None and loss is not None)), False


def _pattern(line: bytes, keys: list[tuple[int, int]], groups: dict[str, tuple[int, int]]) -> re.Pattern[bytes] | None:
    """The pattern of `line`'s layout: its bytes, each digit run outside `keys` as `[0-9]++`, the value `groups`
    captured (a value starts and ends at the edge of a digit run or at another byte). None if it does not read
    `line` as it should (never so)."""
    opens = {span[0]: name for name, span in groups.items()}
    closes = {span[1] for span in groups.values()}
    parts = [b"\\n", *(b"(?P<%s>)" % name.encode() for name in "sgl" if name not in groups)]
    at = 0
    for run in [*_DIGIT_RUN.finditer(line), None]:
        stop = len(line) if run is None else run.start()
        for index in range(at, stop):  # the bytes up to the run
            parts += _edges(index, opens, closes)
            parts.append(re.escape(line[index : index + 1]))
        if run is None:
            break
        parts += _edges(run.start(), opens, closes)
        in_key = any(begin <= run.start() < end for begin, end in keys)
        parts.append(run[0] if in_key else b"[0-9]++")
        at = run.end()
    parts += _edges(len(line), opens, closes)
    parts.append(rb"(?=\n)")
    try:
        pattern = re.compile(b"".join(parts))
    except re.error:
        return None
    found = pattern.match(b"\n" + line + b"\n")
    if (
        found is None
        or found.end() != len(line) + 1
        or any(found.span(name) != (span[0] + 1, span[1] + 1) for name, span in groups.items())
    ):
        return None
    return pattern


def _edges(index: int, opens: dict[int, str], closes: set[int]) -> list[bytes]:
    """The group ends and starts at `index` (value spans are disjoint: ends first)."""
    return [b")"] * (index in closes) + ([b"(?P<%s>" % opens[index].encode()] if index in opens else [])


class KeyValueRuns:
    """Reads, after a line the reference parsers read, the lines of its layout that follow it."""

    def __init__(self) -> None:
        self.layouts: dict[bytes, Layout] = {}  # by a line without its digits
        self.never: set[bytes] = set()  # lines without their digits that no line of the look makes a layout of
        self.made = 0  # layouts made
        self.read_lines = 0  # lines read by layouts

    def read(self, data: bytes, start: int, end: int, series: SeriesBuilder) -> int:
        """Read into `series` the lines after the one opened at `start` (a b"\\n") that have its layout, up to
        `end` (a b"\\n" or the end of `data`); returns where the first line not read opens."""
        pos = data.find(b"\n", start + 1, end)
        after = data.find(b"\n", pos + 1, end) if pos >= 0 else -1
        if after < 0:
            return end if pos < 0 else pos
        digitless = data[start + 1 : pos].translate(None, _DIGITS)
        if data[pos + 1 : after].translate(None, _DIGITS) != digitless:  # not a run: no layout built
            return pos
        if pos - start > MAX_PROTOTYPE_BYTES or not digitless.isascii():
            return pos
        if digitless in self.never:  # lines of this look have no layout
            return pos
        layout = self.layouts.get(digitless)
        if layout is None or not layout.pattern.match(data, pos):
            if self.made >= _FREE_LAYOUTS + self.read_lines // _LINES_PER_LAYOUT:
                return pos
            self.made += 1
            layout, never = _prototype(data[start + 1 : pos])
            if len(self.layouts) + len(self.never) >= _MAX_LAYOUTS:
                self.layouts.clear()
                self.never.clear()
            if layout is not None:
                self.layouts[digitless] = layout
            elif never:
                self.never.add(digitless)
            if layout is None:
                return pos
        read = _run(layout, data, pos, end, series, pos - start)
        self.read_lines += data.count(b"\n", pos, read)
        return read


def _run(layout: Layout, data: bytes, pos: int, end: int, series: SeriesBuilder, width: int) -> int:
    """Read the lines of `layout` from the one opened at `pos` on, up to `end`; returns where the first line not
    read opens. Windows of lines (`width` bytes a line, about) are read by one `findall` when every line in them
    matches (as many matches as lines: a match is one whole line), growing while they do; the window where one
    does not is read line by line up to it."""
    lines = 4
    while pos < end:
        stop = data.find(b"\n", min(pos + lines * width, end), end)
        stop = end if stop < 0 else stop
        found = layout.pattern.findall(data, pos, stop + 1)  # (a match ends before a b"\n": none past `stop`)
        lines_in = data.count(b"\n", pos, stop) - (stop == len(data) and data.endswith(b"\n"))  # (not: the end)
        if len(found) != lines_in or not _read_all(layout, found, series):
            return _stepwise(layout, data, pos, end, series)
        pos = stop
        lines = min(2 * lines, 1024)
    return pos


def _read_all(layout: Layout, found: list[tuple[bytes, ...]], series: SeriesBuilder) -> bool:
    """Add the points of these lines' values (`findall`'s groups), or nothing and False when a step is not read
    (`int(float(...))` fails: `_stepwise` then reads them)."""
    step_at, grad_at, loss_at = layout.groups
    try:
        steps = [int(float(values[step_at])) for values in found]
    except (ValueError, OverflowError):
        return False
    if layout.both:
        series.extend_read(
            steps, [float(values[grad_at]) for values in found], [float(values[loss_at]) for values in found]
        )
    else:
        for step, values in zip(steps, found, strict=True):
            series.append(
                step,
                float(values[grad_at]) if values[grad_at] else None,
                float(values[loss_at]) if values[loss_at] else None,
            )
    return True


def _stepwise(layout: Layout, data: bytes, pos: int, end: int, series: SeriesBuilder) -> int:
    steps: list[int] = []
    grads: list[float] = []
    losses: list[float] = []
    match = layout.pattern.match
    while (found := match(data, pos)) is not None and found.end() <= end:
        step, grad, loss = found.group("s", "g", "l")
        pos = found.end()
        try:
            iteration = int(float(step))
        except (ValueError, OverflowError):  # `parse_line` reads no point
            continue
        if layout.both:
            steps.append(iteration)
            grads.append(float(grad))
            losses.append(float(loss))
        else:
            series.append(iteration, float(grad) if grad else None, float(loss) if loss else None)
    series.extend_read(steps, grads, losses)
    return pos
