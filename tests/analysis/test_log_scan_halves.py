"""A large log is scanned on two cores, its second half in a forked process: the series, errors, line numbers
and counts are those of reading it whole, and a scan that stops leaves no process behind.

The scan forks only where its process runs no other thread, so each story runs in a fresh process of its own
(a test process may hold threads of earlier tests)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from test_log_scan_streaming import _SHAPES, _reference

PACKAGE = Path(__file__).resolve().parents[2] / "mcp_server"

_SCAN_IN_HALVES = """
import json, os, sys, threading
from axrl_spike_replay.logs import log_halves
from axrl_spike_replay.diagnosis.evidence import log_scan
from axrl_spike_replay.errors import AxrlError

log_halves.SPLIT_BYTES = 0  # every log is split
cuts = []

class Counted(log_halves.SecondHalf):
    def __init__(self, handle, start, size, path):
        cuts.append(start)
        super().__init__(handle, start, size, path)

log_scan.SecondHalf = Counted
cancel = threading.Event()
progress = (lambda message: cancel.set()) if sys.argv[3] == "cancel" else None
try:
    scan = log_scan.scan_logs([sys.argv[1]], sys.argv[2], progress=progress, cancel=cancel)
except AxrlError as exc:
    scan, stopped = None, str(exc)
def parent(pid):
    try:
        return open(f"/proc/{pid}/stat").read().split(") ")[-1].split()[1]
    except OSError:  # a process of someone else's that ended since the listing
        return None

children = [p for p in os.listdir("/proc") if p.isdigit() and parent(p) == str(os.getpid())]
if scan is None:
    print(json.dumps({"cuts": cuts, "stopped": stopped, "children": children}))
else:
    print(json.dumps({
        "cuts": cuts, "children": children,
        "series": repr(scan.series_points),
        "errors": [[e["line"], e["kind"], e["text"]] for e in scan.errors],
        "error_lines": scan.error_lines, "lines": scan.lines, "long_lines": scan.long_lines,
        "repeated": scan.repeated_iterations,
    }))
"""


def _in_halves(log: Path, dest: Path, mode: str = "scan") -> dict:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE)}
    done = subprocess.run(
        [sys.executable, "-c", _SCAN_IN_HALVES, str(log), str(dest), mode],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def test_a_log_scanned_in_two_halves_reads_as_the_whole_text(tmp_path: Path) -> None:
    rng = random.Random(11)
    log = tmp_path / "mixed.log"
    with log.open("w", encoding="utf-8", errors="surrogateescape", newline="") as handle:
        for i in range(1, 3000):  # few errors early, many late: the kept ones run into the second half
            other = rng.random() < (0.03 if i < 1500 else 0.6)
            handle.write((rng.choice(_SHAPES) if other else _SHAPES[0])(i, rng))
        handle.write("step=99999 grad_norm=1.5")
    scanned = _in_halves(log, tmp_path / "copies")
    expected = _reference(log)
    assert {key: scanned[key] for key in expected} == {**expected, "errors": [list(e) for e in expected["errors"]]}
    assert len(scanned["cuts"]) == 1
    first_half = log.read_bytes()[: scanned["cuts"][0]].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    assert any(line > first_half.count(b"\n") for line, _, _ in scanned["errors"])  # numbered after the first half
    assert scanned["error_lines"] > len(scanned["errors"])  # kept errors capped across the halves
    assert (tmp_path / "copies" / "mixed.log").read_bytes() == log.read_bytes()
    assert scanned["children"] == []


def test_a_cancelled_scan_in_halves_leaves_no_process_and_no_copy_behind(tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    log.write_text("".join(f"step={i} grad_norm=1.0\n" for i in range(1, 400_001)))
    stopped = _in_halves(log, tmp_path / "copies", mode="cancel")
    assert stopped["stopped"].startswith("log scan cancelled in big.log at line 1")
    assert len(stopped["cuts"]) == 1
    assert stopped["children"] == []
    assert [copy.read_bytes() == log.read_bytes() for copy in (tmp_path / "copies").iterdir()] in ([], [True])
