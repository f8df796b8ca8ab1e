"""Runs of key=value lines of one layout (verl's logs) are read by one pattern a line, with exactly the points and
errors the reference parsers give each line: whatever the keys' digits, the numbers' forms and lengths, repeated
keys, error words, long lines or line ends."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_log_scan_streaming import _reference, _scanned

from axrl_spike_replay.diagnosis.evidence.log_scan import MAX_LINE_CHARS
from axrl_spike_replay.logs import log_blocks, log_kv, log_reader
from axrl_spike_replay.logs.log_kv import MAX_PROTOTYPE_BYTES, KeyValueRuns, layout_of
from axrl_spike_replay.logs.log_lines import error_kind, parse_line
from axrl_spike_replay.logs.log_series import _HAS_GRAD, _HAS_LOSS, SeriesBuilder

_KEYS = [
    "step", "global_step", "it", "iter", "actor/grad_norm", "grad_norm", "layer1_grad_norm", "layer12_grad_norm",
    "actor/pg_loss", "loss", "lm_loss", "critic/vf_loss", "metric_1", "metric_10", "actor/metric_0", "a1b2",
    "timing_s/gen", "perf/throughput", "x-1", "lr",
]  # fmt: skip
_VALUES = [
    "12", "0.0010", "1e-5", ".5", "-3", "+7.", "nan", "inf", "-Infinity", "1_000", "1e999", "3.25E+02", "007",
    "12abc", "1.2.3", "0x10", "", "1e", "99999999999999999999999",
]  # fmt: skip
_GLUE = [" - ", " ", "  -  ", ", ", "\t", " | ", "/", "-", "."]
_WORDS = ["ERROR", "Traceback (most recent call last)", "ValueError", "fatal", "iteration", "critical", "é", "x"]


def _layout(rng: random.Random, clean: bool) -> list[tuple[str, bool]]:
    """Pieces of a verl-like line, each with whether its digits vary: `key:value` pairs (keys repeated, values
    of every form; unless `clean`, maybe `nan`/`inf` and other words)."""
    pieces = [("(main_task pid=1234) ", True)] if rng.random() < 0.5 else []
    values = [v for v in _VALUES if "n" not in v] if clean else _VALUES
    pairs = [("step", "12")] + [(rng.choice(_KEYS), rng.choice(values)) for _ in range(rng.randrange(2, 40))]
    rng.shuffle(pairs)
    for key, value in pairs:
        glue = rng.choice(_GLUE[:6] if clean else _GLUE)  # (`/`, `-`, `.` join a value to the next key)
        pieces += [(key, False), (rng.choice([":", "=", " = ", ":"]), False), (value, True), (glue, False)]
    if clean:  # verl's opening: these lines have a point
        pieces[:0] = [("step:", False), ("12", True), (" - actor/pg_loss:", False), ("0.0010", True), (" - ", False)]
    elif rng.random() < 0.5:
        pieces.insert(rng.randrange(len(pieces)), (rng.choice(_WORDS), False))
    return pieces


def _digits(rng: random.Random) -> str:
    return str(rng.randrange(10 ** rng.randrange(0, 25))).zfill(rng.choice([1, 1, 1, 4]))


def _line(pieces: list[tuple[str, bool]], rng: random.Random) -> str:
    """A line of the layout: every digit run of the values may take any other length and digits."""
    return "".join(re.sub(r"[0-9]+", lambda _: _digits(rng), piece) if varies else piece for piece, varies in pieces)


def _write(log: Path, seed: int) -> int:
    rng = random.Random(seed)
    layouts = [_layout(rng, clean=at < 3) for at in range(5)]
    lines = []
    for _ in range(120):
        pieces = rng.choice(layouts[:3] * 3 + layouts[3:])
        for _ in range(rng.choice([1, 2, 3, 30])):
            line = _line(pieces, rng)
            if rng.random() < 0.03:
                line = line.replace(":", ": ERROR ", 1)
            elif rng.random() < 0.01:
                line += " pad" * rng.choice([MAX_PROTOTYPE_BYTES // 4, MAX_LINE_CHARS // 4 + 1])
            lines.append(line + rng.choice(["\n"] * 6 + ["\r\n", "\r"]))
    log.write_text("".join(lines) + "step:99 grad_norm:1", newline="")
    return len(lines)


@pytest.mark.parametrize("seed", range(6))
def test_key_value_runs_read_as_the_text_reading(tmp_path: Path, seed: int, monkeypatch) -> None:
    if seed % 2:
        monkeypatch.setattr(log_blocks, "READ_BYTES", 4099)  # runs cut by block ends
    reference_lines: list[int] = []
    line = log_reader._line
    monkeypatch.setattr(log_reader, "_line", lambda *args: reference_lines.append(1) or line(*args))
    log = tmp_path / "verl.log"
    count = _write(log, seed)
    assert _scanned(log, tmp_path / "copies") == _reference(log)
    assert len(reference_lines) < 0.6 * count  # most lines read by the layouts


def _points(series: SeriesBuilder) -> str:
    flags = series.flags
    return repr(
        [
            (it, grad if flag & _HAS_GRAD else None, loss if flag & _HAS_LOSS else None)
            for it, grad, loss, flag in zip(series.iterations, series.grads, series.losses, flags, strict=True)
        ]
        + series.huge
    )


_PIECES = st.lists(st.sampled_from([*_KEYS, *_VALUES, *_GLUE, *_WORDS, ":", "=", "9", "0", "_", "e", "E"]), max_size=40)


@settings(max_examples=1500, deadline=None)
@given(_PIECES, st.randoms(use_true_random=False), st.booleans())
def test_a_line_of_a_prototype_layout_reads_as_the_reference_reads_it(pieces, rng, keep_keys) -> None:
    """Any line, and a sibling with its digit runs changed (keys' digits too unless `keep_keys`): when the
    sibling is read by the prototype's layout, it gives what `parse_line` and `error_kind` give it."""
    prototype = "".join(pieces)
    if "step" not in prototype:
        prototype = "step:3 " + prototype
    sibling = re.sub(r"[0-9]+", lambda run: run[0] if keep_keys and rng.random() < 0.5 else _digits(rng), prototype)
    data = f"\n{prototype}\n{sibling}\n".encode()
    series = SeriesBuilder()
    read = KeyValueRuns().read(data, 0, len(data) - 1, series)
    event("read by the layout" if read == len(data) - 1 else "left to the reference parsers")
    if read == len(data) - 1:
        assert error_kind(sibling + "\n") is None
        expected = SeriesBuilder()
        if (parsed := parse_line(sibling + "\n")) is not None:
            expected.append(*parsed)
        assert _points(series) == _points(expected)
    else:
        assert read == len(prototype.encode()) + 1 and not len(series)


def test_a_verl_line_has_a_layout_that_reads_its_siblings() -> None:
    prototype = b"(main_task pid=1) step:12 - actor/pg_loss:0.0010 - actor/grad_norm:1.05 - layer1_grad_norm:3"
    layout = layout_of(prototype)
    assert layout is not None and layout.both
    sibling = b"\n(main_task pid=77) step:123456 - actor/pg_loss:12.5 - actor/grad_norm:30.125 - layer1_grad_norm:30\n"
    found = layout.pattern.match(sibling)
    assert found is not None and found.group("s", "g", "l") == (b"123456", b"30.125", b"12.5")
    assert layout.pattern.match(sibling.replace(b"layer1_", b"layer2_")) is None  # keys' digits are pinned


def test_steps_that_are_no_integer_and_layouts_without_a_loss_read_as_the_text_reading(tmp_path: Path) -> None:
    """A step of `1E+999` (no point in its line) in the middle of a run, and runs with only a grad norm or only
    a loss (their points keep the other missing)."""
    log = tmp_path / "verl.log"
    lines = [f"step:{i}E+{999 if i % 50 == 7 else 0} - actor/grad_norm:1.{i} - metric_1:2\n" for i in range(1, 400)]
    lines += [f"step={i} - critic/vf_loss=0.{i} - loss={i}.5\n" for i in range(400, 900)]
    log.write_text("".join(lines))
    assert _scanned(log, tmp_path / "copies") == _reference(log)


def test_layouts_that_change_every_other_line_are_not_made_past_a_budget(tmp_path: Path, monkeypatch) -> None:
    """A layout costs about a hundred reference readings to make: lines whose layout changes every other line
    (keys named anew) make a few, then are read by the reference parsers, as before layouts."""
    made: list[bytes] = []
    prototype = log_kv._prototype
    monkeypatch.setattr(log_kv, "_prototype", lambda line: made.append(line) or prototype(line))
    rng = random.Random(3)
    log = tmp_path / "verl.log"
    lines = []
    for i in range(0, 2000, 2):
        name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))
        lines += [f"step:{i + j} - actor/grad_norm:1.{j} - {name}/pg_loss:0.5 - {name}/m:{j}\n" for j in range(2)]
    log.write_text("".join(lines))
    assert _scanned(log, tmp_path / "copies") == _reference(log)
    assert len(made) <= log_kv._FREE_LAYOUTS + 1
