"""The numbers of many log lines read at once: each value span (from a field marker to the next `|` or
newline) is taken into a row of a small byte matrix, and the rows are read by their shape with array arithmetic.

A span's shape is the span with every digit written `0`. Rows of one shape have their sign, digits, point and
exponent in the same columns, so a shape is checked once (by the same number pattern the line patterns use)
and all its rows are read with a few array operations:
- an integer of at most 18 digits is exact in int64;
- a decimal number `M * 10**E` with integer M <= 2**53 and |E| <= 22 is exactly one IEEE multiplication or
  division of two exactly representable doubles, so correctly rounded: the value `float` gives (it rounds
  correctly too). Other numbers (more digits, larger exponents) are read by `float` itself.
A span that does not read as a number makes the whole read return None: the caller then reads the lines
another way. Results are those of `float`/`int` on the span, always.
"""

from __future__ import annotations

import re

import numpy as np

WINDOW = 32  # bytes taken after a marker; a span longer than this (with its delimiter) is not read here
_COLUMNS = np.arange(WINDOW)
_MAX_SHAPES = 16  # shapes read by arrays per call; rows of further shapes are read one by one
_PIPE, _NEWLINE = 124, 10
# what `log_reader._NUM` reads (`[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?`), spaces around
_FLOAT_SHAPE = re.compile(rb" *+([-+]?)(0*+)(\.?)(0*+)(?:[eE]([-+]?)(0++))? *+")
_FLOAT_SPAN = re.compile(rb" *+[-+]?(?:[0-9]++(?:\.[0-9]*+)?|\.[0-9]++)(?:[eE][-+]?[0-9]++)? *+")
_POW10 = np.array([float(10**k) for k in range(23)])  # exact: 10**22 < 2**53 * 2**22
_EXACT_MANTISSA = 2**53


def _windows(array: np.ndarray, width: int) -> np.ndarray:
    """The `width` bytes from each position of `array` as one item (taken whole: a copy per item, not per byte)."""
    return np.ndarray((len(array) - width + 1,), f"V{width}", array, strides=(1,))


def _taken(windows: np.ndarray, at: np.ndarray) -> np.ndarray:
    return windows[at].view(np.uint8).reshape(len(at), -1)


def _rows(array: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """The `width` bytes from each of `starts` (ascending), newlines past the end of `array`."""
    limit = max(len(array) - width, 0)
    cut = int(np.searchsorted(starts, limit, side="right")) if len(array) >= width else 0
    rows = _taken(_windows(array, width), starts[:cut]) if cut else np.zeros((0, width), np.uint8)
    if cut == len(starts):
        return rows
    tail = np.concatenate([array[limit:], np.full(width, _NEWLINE, np.uint8)])
    return np.concatenate([rows, _taken(_windows(tail, width), starts[cut:] - limit)])


def spans(array: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(rows of WINDOW bytes from each start (ascending), the column of each row's first `|` or newline); None
    when a row has none before its WINDOW-th byte."""
    rows = _rows(array, starts, WINDOW)
    delimiter = (rows == _PIPE) | (rows == _NEWLINE)
    ends = delimiter.argmax(axis=1)
    if not bool(delimiter[np.arange(len(rows)), ends].all()):
        return None
    return rows, ends


def _shapes(rows: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Each row's shape: digits as `0`, nul bytes from its end on (and `?` for a nul in it)."""
    digit = (rows - np.uint8(49)) < 9  # 1-9 (uint8 wraps below)
    shaped = (rows - digit * (rows - np.uint8(48))) * (ends[:, None] > _COLUMNS)
    shaped[rows == 0] = 63  # a nul in a span (`?`): no shape reads it
    return shaped


def _groups(shapes: np.ndarray) -> tuple[list[tuple[bytes, np.ndarray]], np.ndarray]:
    """([(shape, its rows)] for up to `_MAX_SHAPES` shapes, the rows of the others)."""
    groups: list[tuple[bytes, np.ndarray]] = []
    words = np.ascontiguousarray(shapes).view(np.uint64)  # a row in WINDOW / 8 words
    left = np.arange(len(shapes))
    while left.size and len(groups) < _MAX_SHAPES:
        first = left[0]
        same = (words[left] == words[first]).all(axis=1)
        groups.append((shapes[first].tobytes().rstrip(b"\0"), left[same]))
        left = left[~same]
    return groups, left


def _digits(rows: np.ndarray, columns: range) -> np.ndarray:
    """The integer written in `columns` of each row (at most 18 digits: exact in int64)."""
    if not columns:
        return np.zeros(len(rows), np.int64)
    weights = 10 ** np.arange(len(columns) - 1, -1, -1, dtype=np.int64)
    return (rows[:, columns.start : columns.stop].astype(np.int64) - 48) @ weights


def read_floats(data: bytes, array: np.ndarray, starts: np.ndarray) -> np.ndarray | None:
    """`float` of the span from each start (ascending) in `data` (`array`: its bytes) to the next `|` or
    newline, each span being ` *NUM *`; None when one is not (or is longer than the window allows)."""
    found = spans(array, starts)
    if found is None:
        return None
    rows, ends = found
    values = np.empty(len(rows))
    groups, others = _groups(_shapes(rows, ends))
    for shape, at in groups:
        match = _FLOAT_SHAPE.fullmatch(shape)
        if match is None or not (match[2] or match[4]):
            return None
        read = _read_shape(rows[at], match)
        if read is None:  # past int64: every row by `float`
            others = np.concatenate([others, at])
            continue
        values[at], exact = read
        others = np.concatenate([others, at[~exact]])
    for row in others.tolist():
        start = int(starts[row])
        span = data[start : start + int(ends[row])]
        if _FLOAT_SPAN.fullmatch(span) is None:
            return None
        values[row] = float(span)
    return values


def _read_shape(rows: np.ndarray, match: re.Match[bytes]) -> tuple[np.ndarray, np.ndarray] | None:
    """(the value of each row, whether it is exact) for rows of one shape (`match`: `_FLOAT_SHAPE` on it);
    None when the mantissa or the exponent has too many digits for int64. Rows not exact are read by `float`."""
    mantissa = [*range(*match.span(2)), *range(*match.span(4))]
    exponent = range(*match.span(6))
    if len(mantissa) > 18 or len(exponent) > 4:
        return None
    digits = (rows[:, mantissa].astype(np.int64) - 48) @ 10 ** np.arange(len(mantissa) - 1, -1, -1)
    power = _digits(rows, exponent) * (-1 if match[5] == b"-" else 1) - len(match[4])
    exact = (digits <= _EXACT_MANTISSA) & (np.abs(power) <= 22)
    scale = _POW10[np.minimum(np.abs(power), 22)]
    read = np.where(power >= 0, digits * scale, digits / scale)  # int64 <= 2**53 converts exactly
    return (-read if match[1] == b"-" else read), exact


def read_column_floats(columns: np.ndarray) -> np.ndarray | None:
    """`float` of each row of `columns` (a byte matrix): rows that differ from the first only in digits, the
    first a number (`NUM`, no spaces); None when it is not one or has too many digits to read by arrays."""
    shape = columns[0].tobytes().translate(_DIGITS_AS_ZERO)
    match = _FLOAT_SHAPE.fullmatch(shape)
    if match is None or not (match[2] or match[4]):
        return None
    read = _read_shape(columns, match)
    if read is None:
        return None
    values, exact = read
    for row in np.flatnonzero(~exact).tolist():
        values[row] = float(columns[row].tobytes())
    return values


def read_column_integers(columns: np.ndarray) -> np.ndarray | None:
    """`int` of each row of `columns` (rows of ASCII digits only, at most 18: exact in int64); None otherwise."""
    if not 0 < columns.shape[1] <= 18 or bool(((columns - np.uint8(48)) > 9).any()):
        return None
    return _digits(columns, range(columns.shape[1]))


_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_HEAD_SHAPE = re.compile(rb" ++(0++) */ *0++ *+")  # after `iteration`: ` +([0-9]+) */ *[0-9]+ *` before `|`


def read_heads(array: np.ndarray, starts: np.ndarray) -> np.ndarray | None:
    """The iteration of each `iteration N/ M |` head whose text after `iteration` starts at each start (as
    `int` of N); None when one is not such a head or N has more than 18 digits."""
    found = spans(array, starts)
    if found is None:
        return None
    rows, ends = found
    if not bool((rows[np.arange(len(rows)), ends] == _PIPE).all()):
        return None
    values = np.empty(len(rows), np.int64)
    groups, others = _groups(_shapes(rows, ends))
    if others.size:
        return None
    for shape, at in groups:
        match = _HEAD_SHAPE.fullmatch(shape)
        if match is None or len(match[1]) > 18:
            return None
        values[at] = _digits(rows[at], range(*match.span(1)))
    return values


_HEAD = b"iteration"
_WORD = np.zeros(256, bool)
_WORD[list(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")] = True


def head_starts(array: np.ndarray, pipes: np.ndarray) -> np.ndarray | None:
    """Where the text after `iteration` starts in each head ending at `pipes` (`iteration` then only
    `0-9 .+-/` bytes up to the pipe, not preceded by a word character); None when one is not so."""
    if bool((pipes < WINDOW).any()):
        return None
    before = _taken(_windows(array, WINDOW), pipes - WINDOW)
    other = ((before - np.uint8(45)) >= 13) & (before != 32) & (before != 43)  # not `0-9 .+-/`
    last = WINDOW - 1 - other[:, ::-1].argmax(axis=1)
    if not bool(other[np.arange(len(before)), last].all()):
        return None
    ends = pipes - WINDOW + last + 1  # just past the `n` of `iteration`
    if bool((ends < len(_HEAD) + 1).any()):
        return None
    if not has_marker(array, ends - len(_HEAD), _HEAD) or bool(_WORD[array[ends - len(_HEAD) - 1]].any()):
        return None
    return ends


def has_marker(array: np.ndarray, at: np.ndarray, marker: bytes) -> bool:
    """Whether `marker` is written at each position `at`."""
    return bool((_rows(array, at, len(marker)) == np.frombuffer(marker, np.uint8)).all())
