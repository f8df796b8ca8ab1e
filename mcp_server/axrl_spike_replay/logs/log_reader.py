"""Streaming a training log at disk speed: large binary reads, one pattern over many lines, per-line Python
work only for lines that can carry a training step or an error.

Results are those of reading the file as text (UTF-8, bad bytes replaced, universal newlines) and giving
every line to `log_lines.parse_line` and `log_lines.error_kind`:
- Lines in the common Megatron shape (printable ASCII, `iteration N/ M | key: value | ...` with only
  `grad norm`, `lm loss` and `loss scale` among the keys that name a norm or a loss, and none of the
  error words) are read by one pattern (`_MEGATRON_LINE`) over the whole block.
- Every other line is given to the reference parsers only when a trigger (`_TRIGGER`) finds in it a word
  that those parsers need: `iteration` + space, a step key + `=`/`:`, an error word, `:`/`=` + nan/inf.
  The triggers spell out the non-ASCII letters and spaces that case-insensitive Unicode patterns match
  (ı and İ for i; Unicode white space), so no line they would match is passed over.
- Runs of such lines of one width whose bytes differ only in digits are read by columns (`log_columns`).
- After a key=value line given to the reference parsers, the lines of its layout (the same bytes but for the
  digit runs outside its keys) are read by one pattern made from it (`log_kv`).
The blocks come from `log_blocks`: memory stays flat in the file size (one buffer for the whole file, and at
most `HEAD_BYTES` of a line longer than `MAX_LINE_CHARS` characters: its start is still checked for errors).
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.logs.log_blocks import HEAD_BYTES, MAX_LINE_CHARS, ByteSource, LineBlocks
from axrl_spike_replay.logs.log_columns import Run, column_values, lines_of_width, same_but_digits
from axrl_spike_replay.logs.log_kv import KeyValueRuns
from axrl_spike_replay.logs.log_lines import error_kind, parse_line
from axrl_spike_replay.logs.log_series import SeriesBuilder
from axrl_spike_replay.logs.log_values import has_marker, head_starts, read_floats, read_heads
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError, open_regular

MAX_ERRORS = 200

# -- the trigger: a line without a match cannot parse to a step nor report an error -----------------------
_I = rb"(?:i|\xc4[\xb0\xb1])"  # i, I, İ, ı (IGNORECASE folds the last two onto i)
# `\s` of a str pattern, in UTF-8 (newlines are gone by then): ASCII, then U+0085, U+00A0, U+1680, U+2000-200A,
# U+2028, U+2029, U+202F, U+205F, U+3000
_WS = (
    rb"(?:[\t\x0b\x0c\x1c-\x1f ]|\xc2[\x85\xa0]|\xe1\x9a\x80|\xe2\x80[\x80-\x8a\xa8\xa9\xaf]|\xe2\x81\x9f"
    rb"|\xe3\x80\x80)"
)
_TRIGGER = (
    rb"(?P<hit>" + _I + rb"terat" + _I + rb"on" + _WS  # Megatron: `\biteration\s+`
    + rb"|(?:step|it(?:er(?:ation)?)?)" + _WS + rb"*[=:]"  # a step key (its leaf ends so) then `\s*[=:]`
    + rb"|traceback|exception|error|fatal|nccl|cuda out of memory|cr" + _I + rb"t" + _I + rb"cal"
    + rb"|[:=]" + _WS + rb"*[-+]?(?:nan|" + _I + rb"nf))"
)  # fmt: skip

# -- the common Megatron line, read whole by one pattern (no IGNORECASE: classes spell both cases) ----------


def _ci(word: bytes) -> bytes:
    return b"".join(b"[%c%c]" % (c, c ^ 32) if 97 <= c <= 122 else re.escape(bytes([c])) for c in word)


_NUM = rb"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"  # what `float` always reads
# `:`/`=` not followed by nan/inf (the non_finite error); in parts, `loss`/`norm` only in the keys read here;
# before `iteration`, no other `iteration` (the first one is the one the reference pattern reads).
_SEP = rb"[:=](?! *[-+]?(?:" + _ci(b"nan") + b"|" + _ci(b"inf") + rb"))"
_OTHER = (
    rb"(?:[^\x00-\x1f\x7f-\xff|lLnN:=]++|[lL](?!" + _ci(b"oss") + rb")|[nN](?!" + _ci(b"orm") + b")|" + _SEP + b")*+"
)
_PREFIX = rb"(?:[^\x00-\x1f\x7f-\xff:=iI]++|[iI](?!" + _ci(b"teration") + b")|" + _SEP + b")*+"
_PART = (
    rb"(?: *" + _ci(b"grad norm") + rb" *: *(?P<grad>" + _NUM + rb") *| *" + _ci(b"lm loss") + rb" *: *(?P<loss>"
    + _NUM + rb") *| *" + _ci(b"loss scale") + rb" *: *" + _NUM + rb" *|" + _OTHER + rb")"
)  # fmt: skip
_END = rb"(?=\n|\Z)"
_MEGATRON_LINE = re.compile(
    rb"\n" + _PREFIX + rb"(?<![A-Za-z0-9_])" + _ci(b"iteration") + rb" +(?P<it>[0-9]+) */ *[0-9]+ *\|(?:" + _PART
    + rb"(?:\||" + _END + rb"))*+" + _END
)  # fmt: skip
_TRIGGERS = re.compile(_TRIGGER, re.IGNORECASE)
# Words (lower case) one of which a line needs to match `_TRIGGER`; found at C speed in a lowered block.
_ERROR_WORDS = (b"traceback", b"exception", b"error", b"fatal", b"nccl", b"cuda out of memory", b"critical")
_NON_ASCII_I = (b"\xc4\xb0", b"\xc4\xb1")
# (the common words first: they are looked for until one is found)
_TRIGGER_WORDS = (b"it", b"step", b"nan", b"inf", *_ERROR_WORDS, *_NON_ASCII_I, b"iteration")
_LOWER = bytes.maketrans(bytes(range(65, 91)), bytes(range(97, 123)))

# -- the fast path: a block of plain Megatron lines, read with a few passes in C ------------------------------
# The literal word first (the pattern is then found by a prefix search), its left edge checked after it; a
# head spelt otherwise (`Iteration`) reads no value here and its block goes to `_exact_lines`.
_ITERATION_VALUE = re.compile(rb"iteration(?<![A-Za-z0-9_]iteration) +([0-9]+) */ *[0-9]+ *\|")
_SKELETON_HEAD = b"iteration/|"
_LM_LOSS_VALUE = re.compile(rb"\| lm loss: *(" + _NUM + rb") *(?=[|\n]|\Z)")
_GRAD_NORM_VALUE = re.compile(rb"\| grad norm: *(" + _NUM + rb") *(?=[|\n]|\Z)")
# A line's skeleton: lower case, without digits, spaces, `.`, `+`, `-`. The Megatron lines of one log share a
# skeleton, checked once per block. Deleting characters can make a word appear, never disappear, so a skeleton
# without a word proves its lines lack it.
_SKELETON_DELETE = b"0123456789 .+-"
_NON_FINITE_SKELETON = (b":nan", b"=nan", b":inf", b"=inf")
_NOT_PRINTABLE = bytes(range(32, 127))  # deleted by translate: what is left is not printable ASCII


def _plain_head_skeleton(skeleton: bytes) -> bool:
    """Whether the lines with this skeleton are plain Megatron lines (`_plain_skeleton`) with one head
    (`iteration N/ M |`), before which there is no `i` (the first head is the one the reference reads) nor
    `|` (no part is read before the head)."""
    head = skeleton.find(_SKELETON_HEAD)
    before = skeleton[:head]
    return (
        head >= 0 and skeleton.count(_SKELETON_HEAD) == 1 and b"i" not in before and b"|" not in before
    ) and _plain_skeleton(skeleton)


def _plain_skeleton(skeleton: bytes) -> bool:
    """Whether the lines with this skeleton are plain: printable ASCII, no error word nor `: nan`, one
    `| lm loss:` and one `| grad norm:` part and no other word `loss` (but `| loss scale:`) or `norm`."""
    if skeleton.translate(None, _NOT_PRINTABLE) or any(word in skeleton for word in _SKELETON_ERROR_WORDS):
        return False
    if any(word in skeleton for word in _NON_FINITE_SKELETON):
        return False
    losses, norms = skeleton.count(b"|lmloss:"), skeleton.count(b"|gradnorm:")
    scales = skeleton.count(b"|lossscale:")
    return losses == 1 and norms == 1 and skeleton.count(b"loss") == 1 + scales and skeleton.count(b"norm") == 1


_SKELETON_ERROR_WORDS = tuple(word.replace(b" ", b"") for word in _ERROR_WORDS)


@dataclass
class LogTally:
    """What the lines of the logs read so far add up to. `series`: the points in log order."""

    series: SeriesBuilder = field(default_factory=SeriesBuilder)
    errors: list[dict[str, Any]] = field(default_factory=list)
    error_lines: int = 0
    lines: int = 0
    long_lines: int = 0
    key_values: KeyValueRuns = field(default_factory=KeyValueRuns, repr=False, compare=False)


def scan_file(path: Path, tally: LogTally, cancel: threading.Event | None = None) -> None:
    """Add the lines of the log at `path` to `tally`; `cancel` stops the read within one block (AxrlError)."""
    try:
        opened = open_regular(path)  # a FIFO is never waited on
    except UntrustedInputError as exc:
        raise AxrlError(f"{path}: {exc}; not read") from None
    with opened as handle:
        scan_handle(handle, path, tally, cancel, limit=os.fstat(handle.fileno()).st_size)


def scan_handle(
    handle: ByteSource, path: Path, tally: LogTally, cancel: threading.Event | None = None, limit: int | None = None
) -> None:
    """`scan_file` of an open log, named `path` in errors and messages, from where `handle` is, reading at most
    `limit` bytes."""

    def where() -> str:
        return f"in {path.name} at line {tally.lines + 1}"

    for kind, data, end in LineBlocks(handle, cancel, where, limit):
        if kind == "long":
            _long_line(bytes(data), str(path), tally)
        else:
            _lines(data, end, str(path), tally)


def _line(text: str, whole: bool, number: int, file: str, tally: LogTally) -> None:
    """The reference reading of one line (as the text reader gives it: ending in "\\n" but for the last)."""
    if whole:
        parsed = parse_line(text)
        if parsed is not None:
            tally.series.append(*parsed)
    else:
        tally.long_lines += 1  # its numbers could be cut anywhere: not part of the series
    kind = error_kind(text)
    if kind is not None:
        tally.error_lines += 1
        if len(tally.errors) < MAX_ERRORS:
            tally.errors.append({"file": file, "line": number, "kind": kind, "text": text.strip()[:300]})


def _long_line(data: bytes, file: str, tally: LogTally) -> None:
    tally.lines += 1
    text = data[:HEAD_BYTES].decode("utf-8", errors="replace")
    if len(text) - text.endswith("\n") > MAX_LINE_CHARS:
        _line(text[:MAX_LINE_CHARS], False, tally.lines, file, tally)
    else:  # more bytes than characters allowed, but few enough characters
        _line(text, True, tally.lines, file, tally)


def _part(data: bytes | bytearray, begin: int, end: int) -> bytes:
    """data[begin:end] as bytes (one copy)."""
    return data if isinstance(data, bytes) and begin == 0 and end == len(data) else bytes(memoryview(data)[begin:end])


def _lines(data: bytes | bytearray, end: int, file: str, tally: LogTally) -> None:
    """Lines of data[:end] (b"\\n" + lines, none longer than MAX_LINE_CHARS bytes) into `tally`, in order: runs
    of plain Megatron lines by columns, the rest by blocks (`_plain_megatron_block`) or line by line."""
    done = _column_runs(data, end, file, tally)
    rest = _part(data, done, end)
    if len(rest) > 1 and not _plain_megatron_block(rest, file, tally):
        _exact_lines(rest, file, tally)


_MIN_RUN = 16  # lines: a shorter run of one width is read with the lines around it
_MAX_GAPS = 8  # lines between runs in a block before the rest of the block is read by the block readers


def _column_runs(data: bytes | bytearray, end: int, file: str, tally: LogTally) -> int:
    """Read the runs of plain Megatron lines that differ only in digits (`log_columns`) from the start of
    data[:end], and the lines between them exactly; returns where the rest of the block opens (a newline): past
    `_MAX_GAPS` lines outside runs, the block is not one of long runs and its rest is left to the block readers."""
    stop = data.rfind(b"\n", 0, end)  # the runs end with the last line closed by a newline
    array = np.frombuffer(data, np.uint8, count=end)
    runs: list[Run] = []
    at = gaps = 0
    while at < stop:
        width = data.find(b"\n", at + 1) - at
        lines = lines_of_width(array, at, width, stop)
        if lines >= _MIN_RUN:
            runs.append(Run(at, lines, width))
            at += lines * width
            continue
        gaps += 1
        if gaps > _MAX_GAPS:
            break
        at += width
    values = _read_runs(data, array, runs)
    done = 0  # data[done:] is not read yet
    for run, read in zip(runs, values, strict=True):
        if read is None:  # read with the lines around it
            continue
        if done < run.start:
            _exact_lines(_part(data, done, run.start + 1), file, tally)
        tally.series.extend_arrays(*read)
        tally.lines += run.lines
        done = run.end
    return done


def _read_runs(data: bytes | bytearray, array: np.ndarray, runs: list[Run]) -> list[tuple[np.ndarray, ...] | None]:
    """(iterations, grad norms, losses) of each run, read together with the runs of its width; None for the runs
    of a width whose lines are not plain Megatron lines differing only in digits."""
    widths: dict[int, list[int]] = {}
    for index, run in enumerate(runs):
        widths.setdefault(run.width, []).append(index)
    values: list[tuple[np.ndarray, ...] | None] = [None] * len(runs)
    for indexes in widths.values():
        read = _read_width(data, array, [runs[i] for i in indexes])
        for index, run_values in zip(indexes, read or [], strict=False):
            values[index] = run_values
    return values


def _read_width(data: bytes | bytearray, array: np.ndarray, runs: list[Run]) -> list[tuple[np.ndarray, ...]] | None:
    """The values of runs of one width whose first line is a plain Megatron line (`_plain_head_skeleton`) and
    whose lines differ from it only in digits, so that all share its skeleton; None when they are not so."""
    first = _part(data, runs[0].start, runs[0].start + runs[0].width + 1)  # b"\\n" + line + b"\\n"
    if not _plain_head_skeleton(first[1:-1].translate(_LOWER, _SKELETON_DELETE)):
        return None
    spans = [_only_span(pattern, first) for pattern in (_ITERATION_VALUE, _GRAD_NORM_VALUE, _LM_LOSS_VALUE)]
    if spans[0] is None or spans[1] is None or spans[2] is None or not same_but_digits(array, runs):
        return None
    iterations = column_values(array, runs, spans[0], int)
    grads = column_values(array, runs, spans[1], float)
    losses = column_values(array, runs, spans[2], float)
    if iterations is None or grads is None or losses is None:
        return None
    return list(zip(iterations, grads, losses, strict=True))


def _only_span(pattern: re.Pattern[bytes], line: bytes) -> tuple[int, int] | None:
    """The columns of `pattern`'s value in `line`, when it matches there once."""
    found = [match.span(1) for match in pattern.finditer(line)]
    return found[0] if len(found) == 1 else None


def _plain_megatron_block(data: bytes, file: str, tally: LogTally) -> bool:
    """Read `data` in a few passes in C when most of its lines are plain Megatron lines of one skeleton
    (`_plain_head_skeleton`, and their iteration, `lm loss` and `grad norm` values read) and its other lines
    add no points. False (and `tally` untouched) when the block is not so.

    The lines of that skeleton are counted, not split out: with every newline doubled, each line is
    `\\n skeleton \\n` and `count` finds exactly the lines equal to it. The others, when there are some, are
    the lines whose skeleton is not of its length (proved by the counts agreeing) and go to `_exact_lines`.
    """
    # (its values are read where `iteration` is written so: a block without the word reads none)
    if not data.endswith(b"\n") or data.find(b"iteration") < 0:
        return False
    skeletons = data.translate(_LOWER, _SKELETON_DELETE)
    head = skeletons.find(_SKELETON_HEAD)
    if head < 0:
        return False
    skeleton = skeletons[skeletons.rfind(b"\n", 0, head) + 1 : skeletons.find(b"\n", head)]
    if not _plain_head_skeleton(skeleton):
        return False
    count = skeletons.count(b"\n") - 1  # lines in the block
    same = skeletons.replace(b"\n", b"\n\n").count(b"\n" + skeleton + b"\n")
    if same < 16:  # few Megatron lines: not worth it
        return False
    plain, others = data, LogTally(lines=tally.lines)
    if same != count:
        ends = np.flatnonzero(np.frombuffer(skeletons, dtype=np.uint8) == 10)
        fits = np.diff(ends) - 1 == len(skeleton)
        if int(np.count_nonzero(fits)) != same:  # a line of that length but another skeleton
            return False
        plain, rest = _apart(data, np.flatnonzero(~fits).tolist(), count)
        _exact_lines(rest, file, others)
        if len(others.series):
            return False
    read = _plain_values(plain, skeleton, same)
    if read is not None:
        tally.series.extend_arrays(*read)
    else:  # a value the arrays do not read (a huge iteration, a long span): the patterns read them all
        iterations = _ITERATION_VALUE.findall(plain)
        losses, grads = _LM_LOSS_VALUE.findall(plain), _GRAD_NORM_VALUE.findall(plain)
        # one head, one `| lm loss: ` and one `| grad norm: ` per line (its skeleton has one): as many values
        # as lines means each line has one that reads
        if not len(iterations) == len(losses) == len(grads) == same:
            return False
        tally.series.extend_read(list(map(int, iterations)), list(map(float, grads)), list(map(float, losses)))
    tally.lines += count
    tally.long_lines += others.long_lines
    tally.error_lines += others.error_lines
    tally.errors += others.errors[: MAX_ERRORS - len(tally.errors)]
    return True


def _plain_values(plain: bytes, skeleton: bytes, lines: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(iterations, grad norms, losses) of `plain`: `lines` lines of one plain head skeleton, read where
    `_ITERATION_VALUE`, `_GRAD_NORM_VALUE` and `_LM_LOSS_VALUE` read them, with the same values; None when a
    line has one that `log_values` does not read (the patterns then decide).

    Every line has as many `|` as its skeleton, so the k-th `|` of each line is a column of the block's `|`
    positions: the head ends at the first, and `| lm loss:` / `| grad norm:` start at the one the skeleton
    puts before `|lmloss:` / `|gradnorm:` (its only one, so the only place those patterns can match).
    """
    array = np.frombuffer(plain, np.uint8)
    per_line = skeleton.count(b"|")
    pipes = np.flatnonzero(array == 124)
    if pipes.size != lines * per_line:
        return None
    pipes = pipes.reshape(lines, per_line)
    heads = head_starts(array, pipes[:, 0])
    iterations = None if heads is None else read_heads(array, heads)
    if iterations is None:
        return None
    read: list[np.ndarray] = [iterations]
    for marker, word in ((b"| grad norm:", b"|gradnorm:"), (b"| lm loss:", b"|lmloss:")):
        at = pipes[:, skeleton[: skeleton.find(word)].count(b"|")]
        if not has_marker(array, at, marker):
            return None
        values = read_floats(plain, array, at + len(marker))
        if values is None:
            return None
        read.append(values)
    return read[0], read[1], read[2]


def _apart(data: bytes, others: list[int], count: int) -> tuple[bytes, bytes]:
    """(`data` without the lines numbered `others`, those lines alone with the others left empty): both
    b"\\n" + lines; the second keeps every line's number."""
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    kept: list[bytes] = []
    apart: list[bytes] = []
    done, last = 0, -1
    for line in others:
        opens, closes = int(ends[line]), int(ends[line + 1])
        kept.append(data[done:opens])
        done = closes
        apart += [b"\n" * (line - last), data[opens + 1 : closes]]
        last = line
    kept.append(data[done:])
    apart.append(b"\n" * (count - last))
    return b"".join(kept), b"".join(apart)


def _exact_lines(data: bytes, file: str, tally: LogTally) -> None:
    """Lines of `data` into `tally`: common Megatron lines by `_MEGATRON_LINE`, others by the reference parsers."""
    low = data.translate(_LOWER)
    lines = _Numbering(data, tally.lines)
    series = tally.series
    done = 0  # data[done:] is still to read
    # `_MEGATRON_LINE` spells `iteration` in ASCII letters of either case: a block whose lowered bytes lack the
    # word has no such line (and the costly pattern need not run over it, nor the error words be looked for)
    heads = low.find(b"iteration") >= 0
    flagged = _flagged(data, low) if heads else set()
    for match in _MEGATRON_LINE.finditer(data) if heads else ():
        start = match.start()
        if start > done:
            _other_lines(data, low, done, start, file, tally, lines)
        if start in flagged:
            _line(_text(data, start), True, lines.number(start), file, tally)
        else:
            grad, loss = match["grad"], match["loss"]
            series.append(
                int(match["it"]), None if grad is None else float(grad), None if loss is None else float(loss)
            )
        done = match.end()
    if done < len(data):
        _other_lines(data, low, done, len(data), file, tally, lines)
    tally.lines = lines.base + data.count(b"\n") - data.endswith(b"\n")


def _flagged(data: bytes, low: bytes) -> set[int]:
    """The starts (the b"\\n" before) of the lines of `data` (`low`: lowered) that hold an error word."""
    flagged: set[int] = set()
    for word in (*_ERROR_WORDS, *_NON_ASCII_I):
        at = low.find(word)
        while at >= 0:
            flagged.add(data.rfind(b"\n", 0, at))
            at = data.find(b"\n", at)
            at = -1 if at < 0 else low.find(word, at)
    return flagged


class _Numbering:
    """Line numbers of positions in a block, counted forward once."""

    def __init__(self, data: bytes, base: int) -> None:
        self.data, self.base, self.counted, self.numbered = data, base, 0, base

    def number(self, start: int) -> int:
        """The number of the line opened by the b"\\n" at `start` (starts asked in increasing order)."""
        self.numbered += self.data.count(b"\n", self.counted, start + 1)
        self.counted = start + 1
        return self.numbered


def _text(data: bytes, start: int) -> str:
    """The line opened by the b"\\n" at `start`, as the text reader gives it (with its newline, if any)."""
    end = data.find(b"\n", start + 1)
    return data[start + 1 : len(data) if end < 0 else end + 1].decode("utf-8", errors="replace")


def _other_lines(data: bytes, low: bytes, begin: int, end: int, file: str, tally: LogTally, lines: _Numbering) -> None:
    """The lines in data[begin:end] (from a b"\\n" to before one) that are not common Megatron lines: each one
    a trigger matches goes to the reference parsers, and the lines after it of its key=value layout are read by
    `log_kv` as the reference parsers read them."""
    if not any(low.find(word, begin, end) >= 0 for word in _TRIGGER_WORDS):
        return
    search = _TRIGGERS.search
    pos = begin
    while (match := search(data, pos, end)) is not None:
        start = data.rfind(b"\n", 0, match.start())
        _line(_text(data, start), True, lines.number(start), file, tally)
        pos = tally.key_values.read(data, start, end, tally.series)
