"""Runs of log lines that differ only in their digits, read by columns.

A trainer writes the same line every iteration, its numbers mostly of one width: consecutive lines of one
length whose bytes differ only where digits do. Each such run is a byte matrix (a reshaped view of the block,
no copy), and the runs of one width in a block are proved together by two column reductions: a column whose
smallest and largest bytes are equal is the same in every line, and a column that varies must vary among the
ASCII digits alone. Every line then reads as the first one does with other digits: the same words, separators
and spans (no pattern of the log readers tells one ASCII digit from another), so a value's columns in the first
line are its columns in every line, and the values of all the runs are read at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from axrl_spike_replay.logs.log_values import read_column_floats, read_column_integers

_NEWLINE, _ZERO, _NINE = 10, 48, 57


@dataclass(frozen=True)
class Run:
    """`lines` consecutive lines of `width` bytes each (counting the newline that opens each) from `start` (a
    newline) in a block."""

    start: int
    lines: int
    width: int

    @property
    def end(self) -> int:
        """Where the line after the run opens (its newline)."""
        return self.start + self.lines * self.width


def lines_of_width(array: np.ndarray, start: int, width: int, stop: int) -> int:
    """How many consecutive lines from the newline at `start` are `width` bytes long: each opening newline
    `width` bytes after the one before, the last line closed by a newline at or before `stop`."""
    opens = array[start : stop + 1 : width] == _NEWLINE
    closed = len(opens) if bool(opens.all()) else int(opens.argmin())
    return max(closed - 1, 0)


def _matrix(array: np.ndarray, run: Run) -> np.ndarray:
    return array[run.start : run.end].reshape(run.lines, run.width)


def same_but_digits(array: np.ndarray, runs: list[Run]) -> bool:
    """Whether the lines of `runs` (all of one width) differ from each other only in columns that hold an ASCII
    digit in every line: each column's smallest and largest byte over all the lines."""
    matrices = [_matrix(array, run) for run in runs]
    low = np.min([m.min(axis=0) for m in matrices], axis=0)
    high = np.max([m.max(axis=0) for m in matrices], axis=0)
    varies = low != high
    return not bool(((low[varies] < _ZERO) | (high[varies] > _NINE)).any())


def _columns(array: np.ndarray, runs: list[Run], span: tuple[int, int]) -> np.ndarray:
    parts = [_matrix(array, run)[:, span[0] : span[1]] for run in runs]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def column_values(
    array: np.ndarray, runs: list[Run], span: tuple[int, int], kind: type[int] | type[float]
) -> list[np.ndarray] | None:
    """Each run's values in columns `span` of its lines (lines that differ only in digits, `same_but_digits`):
    `int` (digits alone, at most 18) or `float` of the text there; None when a value is not one read by arrays."""
    read: Callable[[np.ndarray], np.ndarray | None] = read_column_integers if kind is int else read_column_floats
    values = read(_columns(array, runs, span))
    if values is None:
        return None
    return np.split(values, np.cumsum([run.lines for run in runs[:-1]]))
