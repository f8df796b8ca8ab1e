"""Plain Megatron blocks have their numbers read by array arithmetic: every value is the one `float` / `int`
reads, bit for bit, for every way a number can be written; a span that is not a number is never read as one."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest
from test_log_scan_streaming import _megatron, _reference, _scanned

from axrl_spike_replay.logs import log_blocks, log_values

_MARKER = b"| grad norm:"


def _edge_spans(rng: random.Random) -> list[bytes]:
    """Numbers written every way `float` reads them: signs, points, exponents, many digits, the 2**53 and
    10**22 edges of the exact path, zeros, spaces around."""
    fixed = [
        "0", "-0", "+0", "0.0", "-0.0", ".5", "5.", "-.5", "+5.", "00012.50", "1e0", "1E+00", "1.5e-22",
        "1.5e22", "1e23", "1e-23", "9007199254740992", "9007199254740993", "-9007199254740993.0",
        "900719925474099.3e1", "123456789012345678", "1234567890123456789", "0.1234567890123456789",
        "1.7976931348623157e308", "1e309", "4.9e-324", "1e-400", "2.2250738585072014E-308", "1e+0022",
        "123.456e-0005", "  7.25  ", " +1.000000E+00 ", "3.14159265358979323846264338327950288",
    ]  # fmt: skip
    spans = [s.encode() for s in fixed]
    for _ in range(3000):
        mantissa = str(rng.randrange(10 ** rng.randrange(1, 21)))
        point = rng.randrange(len(mantissa) + 1)
        text = rng.choice(["", "-", "+"]) + mantissa[:point] + rng.choice([".", ""]) * (point < len(mantissa))
        text += mantissa[point:] if "." in text or point == len(mantissa) else ""
        if rng.random() < 0.5:
            text += rng.choice("eE") + rng.choice(["", "-", "+"]) + str(rng.randrange(0, 40))
        spans.append((" " * rng.randrange(3) + text + " " * rng.randrange(3)).encode())
    spans += [f"{rng.random() * 10:.6E}".encode() for _ in range(500)]  # Megatron's own `lm loss` shape
    return [s for s in spans if _reads(s)]


def _reads(span: bytes) -> bool:
    try:
        float(span)
    except ValueError:
        return False
    return True


def _read(spans: list[bytes]) -> np.ndarray | None:
    data = b"\n" + b"".join(_MARKER + span + b"|\n" for span in spans)
    array = np.frombuffer(data, np.uint8)
    starts = np.flatnonzero(array == ord("|"))[::2] + len(_MARKER)
    return log_values.read_floats(data, array, starts)


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


@pytest.mark.parametrize("seed", [1, 2])
def test_every_span_reads_as_float_reads_it_bit_for_bit(seed: int) -> None:
    spans = [s for s in _edge_spans(random.Random(seed)) if len(s) < log_values.WINDOW]
    read = _read(spans)
    assert read is not None
    assert [_bits(v) for v in read.tolist()] == [_bits(float(s)) for s in spans]


@pytest.mark.parametrize(
    "span", [b"1.2.3", b"1e", b"nan", b"inf", b"-inf", b"+", b".", b"1 2", b"1_0", b"0x10", b"1e5.", b"", b"1\x00"]
)
def test_a_span_that_is_not_a_plain_number_is_not_read(span: bytes) -> None:
    assert _read([b"1.5"] * 20 + [span] + [b"2.5"] * 20) is None


def test_a_span_longer_than_the_window_is_left_to_the_patterns() -> None:
    assert _read([b"1.5", b"1" + b"0" * log_values.WINDOW]) is None


def test_heads_read_their_iteration() -> None:
    prefix = "x" * 40  # the head's window before its `|` stays inside the block
    lines = [f"{prefix} iteration {' ' * (i % 3)}{i}{' ' * (i % 2)}/ 100 |" for i in [1, 9, 10, 999, 12345678901234567]]
    data = ("\n" + "\n".join(lines) + "\n").encode()
    array = np.frombuffer(data, np.uint8)
    starts = log_values.head_starts(array, np.flatnonzero(array == ord("|")))
    assert starts is not None
    read = log_values.read_heads(array, starts)
    assert read is not None and read.tolist() == [1, 9, 10, 999, 12345678901234567]


@pytest.mark.parametrize("head", ["xiteration 5/ 9 |", "iteration 5 |", "iteration5/ 9 |", "Iteration 5/ 9 |"])
def test_a_line_that_is_not_a_head_is_not_read_as_one(head: str) -> None:
    prefix = "ab" * 30
    data = ("\n" + f"{prefix} {head}\n" * 20).encode()
    array = np.frombuffer(data, np.uint8)
    starts = log_values.head_starts(array, np.flatnonzero(array == ord("|")))
    assert starts is None or log_values.read_heads(array, starts) is None


def test_megatron_blocks_with_every_way_of_writing_a_number_scan_as_the_text_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of one skeleton (the array path) whose numbers take every written form, and the odd lines between,
    read in small blocks."""
    monkeypatch.setattr(log_blocks, "READ_BYTES", 20011)
    rng = random.Random(5)
    written = [s.decode().strip() for s in _edge_spans(rng)]
    # one skeleton: grad norms without an exponent, losses with `E` (a skeleton keeps letters, lowered)
    grads = [s for s in written if "e" not in s.lower()]
    losses = [s.replace("e", "E") for s in written if "e" in s.lower()]
    log = tmp_path / "train.log"
    with log.open("w") as handle:
        for i in range(1, 4000):
            line = _megatron(i, 1.0).replace("grad norm: 1.000", f"grad norm: {rng.choice(grads)}")
            line = line.replace("lm loss: 1.250000E+00", f"lm loss: {rng.choice(losses)}")
            if i % 700 == 0:
                line = f"iteration {i}/ 9 | grad norm: {10**30} | lm loss: 1 |\n"  # another skeleton
            if i % 901 == 0:
                line = _megatron(10**19 + i, 2.0)  # an iteration past int64
            handle.write(line)
    assert _scanned(log, tmp_path / "copies") == _reference(log)
