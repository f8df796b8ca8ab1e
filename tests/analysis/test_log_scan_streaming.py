"""The scan reads logs at disk speed and gives exactly what reading every line as text and parsing it gives:
the same series, spikes, errors and line numbers for every line shape, however the lines fall into blocks."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Any

import pytest

from axrl_spike_replay.capture.detectors import make_detector
from axrl_spike_replay.diagnosis.evidence.log_scan import MAX_ERRORS, MAX_LINE_CHARS, _spikes, scan_logs
from axrl_spike_replay.logs import log_blocks
from axrl_spike_replay.logs.log_lines import error_kind, parse_line


def _reference(path: Path) -> dict[str, Any]:
    """The plain reading: text mode (UTF-8, bad bytes replaced, universal newlines), every line parsed."""
    points: dict[int, dict[str, Any]] = {}
    errors, lines, long_lines, repeated = [], 0, 0, 0
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        while line := handle.readline(MAX_LINE_CHARS + 1):
            lines += 1
            whole = len(line) <= MAX_LINE_CHARS or line.endswith("\n")
            if not whole:
                while (rest := handle.readline(MAX_LINE_CHARS)) and not rest.endswith("\n"):
                    pass
                line = line[:MAX_LINE_CHARS]
                long_lines += 1
            elif (parsed := parse_line(line)) is not None:
                repeated += parsed[0] in points
                points[parsed[0]] = {"iteration": parsed[0], "grad_norm": parsed[1], "loss": parsed[2]}
            if (kind := error_kind(line)) is not None:
                errors.append((lines, kind, line.strip()[:300]))
    return {
        "series": repr([points[i] for i in sorted(points)]),  # repr: nan == nan
        "errors": errors[:MAX_ERRORS],
        "error_lines": len(errors),
        "lines": lines,
        "long_lines": long_lines,
        "repeated": repeated,
    }


def _scanned(path: Path, dest: Path) -> dict[str, Any]:
    scan = scan_logs([path], dest)
    return {
        "series": repr(scan.series_points),
        "errors": [(e["line"], e["kind"], e["text"]) for e in scan.errors],
        "error_lines": scan.error_lines,
        "lines": scan.lines,
        "long_lines": scan.long_lines,
        "repeated": scan.repeated_iterations,
    }


def _megatron(i: int, grad: float, loss: float = 1.25) -> str:
    return (
        f" [2026-11-30 10:00:00] iteration {i:8d}/ 1000000 | consumed samples: {i * 256:12d} | "
        f"elapsed time per iteration (ms): 812.3 | learning rate: 1.000000E-06 | global batch size:   256 | "
        f"lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {grad:.3f} | number of skipped iterations:   0 | "
        "number of nan iterations:   0 |\n"
    )


_WHITE = [chr(c) for c in range(0x110000) if chr(c).isspace() and chr(c) not in "\n\r"]
_FOLDED_I = [c for c in ("\u0130", "\u0131") if re.fullmatch("i", c, re.IGNORECASE)]

_SHAPES = [
    lambda i, r: _megatron(i, r.choice([1.0, 1.1, 9.0])),
    lambda i, r: f"2025-01-01 INFO step={i} grad_norm={r.random() * 3} loss=0.5\n",
    lambda i, r: f"step:{i} - actor/grad_norm:{r.random()} - actor/pg_loss:0.4\r\n",
    lambda i, r: f"global-step = {i} total_grad_norm: nan\r",
    lambda i, r: "Traceback (most recent call last):\n",
    lambda i, r: "RuntimeError: CUDA out of memory\n",
    lambda i, r: "  ValueError   \n",
    lambda i, r: "[rank1] error watchdog NCCL timeout\n",
    lambda i, r: f"cr{r.choice(_FOLDED_I)}t{r.choice(_FOLDED_I)}cal thing happened\n",
    lambda i, r: f"{r.choice(_FOLDED_I)}teration {i}/ 10 | grad norm: 2.0 | lm loss: 1 |\n",
    lambda i, r: f"iter{r.choice(_WHITE)}= {i} grad_norm{r.choice(_WHITE)}={r.choice(_WHITE)}3.5 loss=inf\n",
    lambda i, r: f"it={i} x_loss=0.1\n",
    lambda i, r: "plain line with INFO and nothing\n",
    lambda i, r: f"value:{r.choice(_WHITE)}-Infinity here\n",
    lambda i, r: "bad utf8 \udcff\udcfe\udcc4 ERROR \udce2\udc80\n",  # raw bytes, written by surrogateescape
    lambda i, r: (
        "x" * r.choice([10, MAX_LINE_CHARS - 1, MAX_LINE_CHARS, MAX_LINE_CHARS + 1]) + f" step={i} grad_norm=2\n"
    ),
    lambda i, r: "é" * r.choice([MAX_LINE_CHARS // 2 + 1, MAX_LINE_CHARS, MAX_LINE_CHARS + 1]) + " ERROR\n",
    lambda i, r: f"iteration {i}/ 100 | lm loss: 1.0 | lm loss: x | foo_loss: 3 | grad norm: 1_000 | grad-norm: 4 |\n",
    lambda i, r: "\n",
    lambda i, r: f"iteration {i}/ 100 |  |:|  grad norm:  |\n",
    lambda i, r: f"Iteration {i}/ 100 | Grad Norm: \u0663.5 | LM Loss: 2 |\n",
    lambda i, r: f"noise \x1c step\x1f={i} grad_norm=1\n",
    lambda i, r: _megatron(i, 2.0).replace("lm loss", "LM loss"),
    lambda i, r: _megatron(i, 2.0).replace("| loss scale: 1.0", "| loss scale: 1.0 | x_loss: 7"),
    lambda i, r: _megatron(i, 2.0).replace("812.3", "nan"),
    lambda i, r: _megatron(i, 2.0).replace("[2026", "[ERROR 2026"),
    lambda i, r: _megatron(i, 2.0).replace("grad norm: 2.000", "grad norm: 2.0 x"),
    lambda i, r: _megatron(i, 2.0).replace("\n", "\t\n"),
    lambda i, r: _megatron(r.randrange(1, 50), 3.0),  # a restart re-logs an earlier iteration
]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_line_shape_reads_as_the_plain_text_reading_does(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    log = tmp_path / "mixed.log"
    with log.open("w", encoding="utf-8", errors="surrogateescape", newline="") as handle:
        for i in range(1, 1500):
            # runs of plain Megatron lines (the fast path) broken by every other shape
            shape = _SHAPES[0] if rng.random() < 0.6 else rng.choice(_SHAPES)
            handle.write(shape(i, rng))
        handle.write("step=99999 grad_norm=1.5")  # no final newline
    assert _scanned(log, tmp_path / "copies") == _reference(log)


def test_a_plain_megatron_log_read_in_small_blocks_matches_the_reference(tmp_path: Path, monkeypatch) -> None:
    """Blocks end anywhere: a \\r\\n pair or a line split across reads, a spike and an error mid-run."""
    monkeypatch.setattr(log_blocks, "READ_BYTES", 16381)
    log = tmp_path / "train.log"
    text = "".join(_megatron(i, 25.0 if i == 400 else 1.0 + (i % 7) / 100) for i in range(1, 1200))
    text = text.replace(_megatron(700, 1.0), "[rank3] NCCL error: unhandled system error\n")
    log.write_bytes(text.replace("\n", "\r\n").encode())
    scan = scan_logs([log], tmp_path / "copies")
    assert _scanned(log, tmp_path / "again") == _reference(log)
    assert [s["iteration"] for s in scan.spikes] == [400]
    assert [(e["line"], e["kind"]) for e in scan.errors] == [(700, "error")]


def test_the_quick_window_finds_the_spikes_observe_finds() -> None:
    rng = random.Random(7)
    values = [rng.choice([1.0, 1.2, 0.9, 5.5, 6.0, 0.0, -1.0, math.nan, math.inf, 4.9999999999]) for _ in range(3000)]
    series = [{"iteration": i, "grad_norm": v, "loss": None} for i, v in enumerate(values)]
    plain = make_detector("median_ratio", window=8, threshold=5.0, warmup=3)
    expected = []
    for point in series:
        seen = plain.observe(point["grad_norm"])
        if seen.tripped:
            expected.append((point["iteration"], seen.spike_ratio))
    found = _spikes(series, make_detector("median_ratio", window=8, threshold=5.0, warmup=3))
    assert [(s["iteration"], s["spike_ratio"]) for s in found] == expected
