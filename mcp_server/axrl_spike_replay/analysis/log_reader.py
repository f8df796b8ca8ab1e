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
Memory stays flat in the file size: a read of `READ_BYTES`, and at most `_HEAD_BYTES` of a line longer than
`MAX_LINE_CHARS` characters (its start is still checked for errors; the rest is read past).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from axrl_spike_replay.analysis.log_lines import error_kind, parse_line
from axrl_spike_replay.errors import AxrlError

MAX_ERRORS = 200
# A training log line is at most a few KB; longer ones are skipped (only their start is checked for errors).
MAX_LINE_CHARS = 64 * 1024
READ_BYTES = 1024 * 1024
# A line of more than this many bytes has more than MAX_LINE_CHARS characters (a character is 1 to 4 bytes).
_HEAD_BYTES = 4 * (MAX_LINE_CHARS + 2)

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
_TRIGGER_WORDS = (*_ERROR_WORDS, *_NON_ASCII_I, b"iteration", b"step", b"it", b"nan", b"inf")
_LOWER = bytes.maketrans(bytes(range(65, 91)), bytes(range(97, 123)))

# -- the fast path: a block of plain Megatron lines, read with a few passes in C ------------------------------
# A line whose prefix has no `i` and which has the Megatron head; split() gives (line, iteration) per line.
_HEAD_LINE = re.compile(
    rb"\n((?:[^\n\x00-\x1f\x7f-\xffiI]*+)(?<![A-Za-z0-9_])" + _ci(b"iteration") + rb" +([0-9]+) */ *[0-9]+ *\|[^\n]*+)"
)
_LM_LOSS_VALUE = re.compile(rb"\| lm loss: *(" + _NUM + rb") *(?=[|\n]|\Z)")
_GRAD_NORM_VALUE = re.compile(rb"\| grad norm: *(" + _NUM + rb") *(?=[|\n]|\Z)")
# A line's skeleton: lower case, without digits, spaces, `.`, `+`, `-`. Lines of one Megatron log share a few
# skeletons, checked once each. Deleting characters can make a word appear, never disappear, so a skeleton
# without a word proves its lines lack it.
_SKELETON_DELETE = b"0123456789 .+-"
_MAX_SKELETONS = 64
_NON_FINITE_SKELETON = (b":nan", b"=nan", b":inf", b"=inf")
_NOT_PRINTABLE = bytes(range(32, 127))  # deleted by translate: what is left is not printable ASCII


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
_LONG = re.compile(rb"\n[^\n]{%d}" % (MAX_LINE_CHARS + 1))


@dataclass
class LogTally:
    """What the lines of the logs read so far add up to. `points`: iteration -> point, the last logged wins."""

    points: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    error_lines: int = 0
    lines: int = 0
    repeated: int = 0
    long_lines: int = 0


def _check_cancel(cancel: threading.Event | None, where: str) -> None:
    if cancel is not None and cancel.is_set():
        raise AxrlError(f"log scan cancelled {where}")


class _Reader:
    """Blocks of whole lines (each starting with b"\\n"), newlines made universal; long lines apart."""

    def __init__(self, handle: BinaryIO, name: str, tally: LogTally, cancel: threading.Event | None) -> None:
        self.handle, self.name, self.tally, self.cancel = handle, name, tally, cancel

    def _read(self) -> bytes:
        _check_cancel(self.cancel, f"in {self.name} at line {self.tally.lines + 1}")
        raw = self.handle.read(READ_BYTES)
        if b"\r" in raw:
            while raw.endswith(b"\r") and (more := self.handle.read(1)):  # keep a \r\n pair in one read
                raw += more
            raw = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        return raw

    def blocks(self) -> Iterator[tuple[str, bytes]]:
        """("lines", b"\\n" + whole lines) and ("long", the head of one long line), in file order."""
        pending = b""
        while raw := self._read():
            data = pending + raw
            cut = data.rfind(b"\n")
            if cut < 0:
                pending = data
                if len(pending) > _HEAD_BYTES:  # a line too long to hold: keep its head, read past the rest
                    yield "long", self._past_line(pending[:_HEAD_BYTES])
                    pending = self._rest
                continue
            pending = data[cut + 1 :]
            yield from self._split_long(b"\n" + data[: cut + 1])
        if pending:
            yield from self._split_long(b"\n" + pending)

    def _past_line(self, head: bytes) -> bytes:
        """Read to the end of the current line; what follows it is left in `_rest`."""
        while raw := self._read():
            end = raw.find(b"\n")
            if end >= 0:
                self._rest = raw[end + 1 :]
                return head + b"\n"
        self._rest = b""
        return head

    @staticmethod
    def _split_long(data: bytes) -> Iterator[tuple[str, bytes]]:
        """`data` (b"\\n" + lines) as blocks of lines of at most MAX_LINE_CHARS bytes, and the longer lines."""
        start = 0  # data[start] is the b"\\n" that opens the next block
        # a line longer than 2 * step holds a whole aligned step of bytes without a newline: cheap to rule out
        step = MAX_LINE_CHARS // 2
        if all(data.find(b"\n", at, at + step) >= 0 for at in range(0, len(data) - step, step)):
            yield "lines", data
            return
        for match in _LONG.finditer(data):
            if match.start() > start:
                yield "lines", data[start : match.start() + 1]
            end = data.find(b"\n", match.end())
            if end < 0:
                yield "long", data[match.start() + 1 :]
                return
            yield "long", data[match.start() + 1 : end + 1]
            start = end
        if start < len(data) - 1:
            yield "lines", data[start:]


def scan_file(path: Path, tally: LogTally, cancel: threading.Event | None = None) -> None:
    """Add the lines of the log at `path` to `tally`; `cancel` stops the read within one block (AxrlError)."""
    with path.open("rb") as handle:
        reader = _Reader(handle, path.name, tally, cancel)
        for kind, data in reader.blocks():
            if kind == "long":
                _long_line(data, str(path), tally)
            else:
                _lines(data, str(path), tally)


def _line(text: str, whole: bool, number: int, file: str, tally: LogTally) -> None:
    """The reference reading of one line (as the text reader gives it: ending in "\\n" but for the last)."""
    if whole:
        parsed = parse_line(text)
        if parsed is not None:
            iteration, grad, loss = parsed
            tally.repeated += iteration in tally.points
            tally.points[iteration] = {"iteration": iteration, "grad_norm": grad, "loss": loss}
    else:
        tally.long_lines += 1  # its numbers could be cut anywhere: not part of the series
    kind = error_kind(text)
    if kind is not None:
        tally.error_lines += 1
        if len(tally.errors) < MAX_ERRORS:
            tally.errors.append({"file": file, "line": number, "kind": kind, "text": text.strip()[:300]})


def _long_line(data: bytes, file: str, tally: LogTally) -> None:
    tally.lines += 1
    text = data[:_HEAD_BYTES].decode("utf-8", errors="replace")
    if len(text) - text.endswith("\n") > MAX_LINE_CHARS:
        _line(text[:MAX_LINE_CHARS], False, tally.lines, file, tally)
    else:  # more bytes than characters allowed, but few enough characters
        _line(text, True, tally.lines, file, tally)


def _lines(data: bytes, file: str, tally: LogTally) -> None:
    """Lines of `data` (b"\\n" + lines, none longer than MAX_LINE_CHARS bytes) into `tally`, in order."""
    if not _plain_megatron_block(data, file, tally):
        _exact_lines(data, file, tally)


def _plain_megatron_block(data: bytes, file: str, tally: LogTally) -> bool:
    """Read `data` in a few passes in C when its Megatron lines are plain (`_plain_skeleton`, and their
    `lm loss` and `grad norm` values read) and its other lines add no points. False (and `tally` untouched)
    when the block is not so."""
    parts = _HEAD_LINE.split(data)
    count = len(parts) // 3
    if count < 16:  # few Megatron lines: not worth it
        return False
    found = parts[1::3]
    joined = b"\n".join(found)
    skeletons = set(joined.translate(_LOWER, _SKELETON_DELETE).split(b"\n"))
    if len(skeletons) > _MAX_SKELETONS or not all(map(_plain_skeleton, skeletons)):
        return False
    # one `| lm loss: ` and one `| grad norm: ` per line (its skeleton has one): as many values as lines
    # means each has one that reads
    loss_values, grad_values = _LM_LOSS_VALUE.findall(joined), _GRAD_NORM_VALUE.findall(joined)
    if len(loss_values) != count or len(grad_values) != count:
        return False
    # the other lines, with the Megatron lines left empty (line numbers kept): errors only, or no fast path
    others = LogTally(lines=tally.lines)
    _exact_lines(b"\n".join(parts[0::3]), file, others)
    if others.points:
        return False
    points = tally.points
    read = {
        iteration: {"iteration": iteration, "grad_norm": grad, "loss": loss}
        for iteration, loss, grad in zip(
            map(int, parts[2::3]), map(float, loss_values), map(float, grad_values), strict=True
        )
    }
    # each line whose iteration was logged before counts, as the reference loop counts it
    tally.repeated += count - len(read) + len(read.keys() & points.keys())
    points.update(read)
    tally.lines += data.count(b"\n") - data.endswith(b"\n")
    tally.long_lines += others.long_lines
    tally.error_lines += others.error_lines
    tally.errors += others.errors[: MAX_ERRORS - len(tally.errors)]
    return True


def _exact_lines(data: bytes, file: str, tally: LogTally) -> None:
    """Lines of `data` into `tally`: common Megatron lines by `_MEGATRON_LINE`, others by the reference parsers."""
    low = data.translate(_LOWER)
    flagged: set[int] = set()  # starts (the b"\\n" before) of lines holding an error word
    for word in (*_ERROR_WORDS, *_NON_ASCII_I):
        at = low.find(word)
        while at >= 0:
            flagged.add(data.rfind(b"\n", 0, at))
            at = data.find(b"\n", at)
            at = -1 if at < 0 else low.find(word, at)
    lines = _Numbering(data, tally.lines)
    points = tally.points
    done = 0  # data[done:] is still to read
    for match in _MEGATRON_LINE.finditer(data):
        start = match.start()
        if start > done:
            _other_lines(data, low, done, start, file, tally, lines)
        if start in flagged:
            _line(_text(data, start), True, lines.number(start), file, tally)
        else:
            iteration = int(match["it"])
            grad, loss = match["grad"], match["loss"]
            tally.repeated += iteration in points
            points[iteration] = {
                "iteration": iteration,
                "grad_norm": None if grad is None else float(grad),
                "loss": None if loss is None else float(loss),
            }
        done = match.end()
    if done < len(data):
        _other_lines(data, low, done, len(data), file, tally, lines)
    tally.lines = lines.base + data.count(b"\n") - data.endswith(b"\n")


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
    a trigger matches goes to the reference parsers."""
    if not any(low.find(word, begin, end) >= 0 for word in _TRIGGER_WORDS):
        return
    search = _TRIGGERS.search
    pos = begin
    while (match := search(data, pos, end)) is not None:
        start = data.rfind(b"\n", 0, match.start())
        _line(_text(data, start), True, lines.number(start), file, tally)
        pos = data.find(b"\n", match.end(), end)
        if pos < 0:
            break
