"""Runs of Megatron lines of one width are read by columns: every value is the one the plain text reading
gives, and a line of the same width that differs in anything but digits (a letter, a sign, a space, a point)
is read as the text reading reads it, wherever it falls in a run and however the runs fall into blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_log_scan_streaming import _reference, _scanned

from axrl_spike_replay.logs import log_blocks


def _line(i: int, grad: float, loss: float) -> str:
    """Megatron's own line: fixed-width iteration and sample counts, `lm loss` in `E` notation."""
    return (
        f" [2026-11-30 10:00:00] iteration {i:8d}/ 1000000 | consumed samples: {i * 256:12d} | "
        f"elapsed time per iteration (ms): 812.3 | learning rate: 1.000000E-06 | global batch size:   256 | "
        f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {grad:.3f} | number of skipped iterations:   0 | "
        "number of nan iterations:   0 |\n"
    )


def _mutated(line: str, rng: random.Random) -> str:
    """The line with one character replaced: any printable ASCII character (digits included), or a tab."""
    at = rng.randrange(len(line) - 1)  # not the newline
    return line[:at] + rng.choice([chr(c) for c in range(32, 127)] + ["\t"]) + line[at + 1 :]


@pytest.mark.parametrize(("seed", "block"), [(1, 20011), (2, 65536), (3, log_blocks.READ_BYTES)])
def test_runs_of_one_width_read_by_columns_match_the_text_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, block: int
) -> None:
    rng = random.Random(seed)
    monkeypatch.setattr(log_blocks, "READ_BYTES", block)
    log = tmp_path / "train.log"
    with log.open("w") as handle:
        for i in range(10_000_000, 10_006_000):
            line = _line(i, rng.uniform(1, 9.999), rng.uniform(1, 9.999))
            if rng.random() < 0.01:
                line = _mutated(line, rng)  # same width, one character other
            elif rng.random() < 0.002:
                line = _line(i, 25.0, 1.5)  # a spike: one character wider
            elif rng.random() < 0.002:
                line = "WARNING: dataloader worker slow to respond\n"
            handle.write(line)
    scanned = _scanned(log, tmp_path / "copies")
    assert scanned == _reference(log)
    assert scanned["lines"] == 6000


def test_numbers_the_arrays_do_not_read_exactly_are_read_as_float_reads_them(tmp_path: Path) -> None:
    """Losses with 17 significant digits, and iterations of 19 digits (past what int64 reads by columns)."""
    rng = random.Random(9)
    log = tmp_path / "train.log"
    lines = []
    for i in range(300):
        line = _line(10**7 + i, 1.5, 1.25).replace("1.250000E+00", f"{rng.uniform(1, 9.99):.16E}")
        lines.append(line.replace(f"iteration {10**7 + i:8d}", f"iteration {10**18 + i:19d}") if i >= 150 else line)
    log.write_text("".join(lines))
    assert _scanned(log, tmp_path / "copies") == _reference(log)
