"""Logs are other people's bytes: a hostile or broken log cannot hang the scan, fill memory, steer the copy
out of the workspace or be stopped only by killing the process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axrl_spike_replay
from axrl_spike_replay.diagnosis.evidence.log_scan import MAX_LINE_CHARS, key_values, scan_logs
from axrl_spike_replay.errors import AxrlError

# The key=value pattern before it was made linear: the reference the linear scanner must agree with.
_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf(?:inity)?)"
_REFERENCE_KV = re.compile(rf"([A-Za-z_][\w./-]*)\s*[=:]\s*({_NUM})(?![\w.])", re.IGNORECASE)

_SCAN_IN_A_CHILD = """
import json, resource, sys
from axrl_spike_replay.diagnosis.evidence.log_scan import scan_logs
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
scan = scan_logs(sys.argv[1:-1], sys.argv[-1])
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grew_kib": grew, "lines": scan.lines, "long_lines": scan.long_lines,
                  "iterations": [p["iteration"] for p in scan.series_points]}))
"""


def _package_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(axrl_spike_replay.__file__).parents[1])}


_TOKENS = st.sampled_from([*"a=: \t1eE+-/.9_xé[]K", "step", "grad_norm", "actor/", "2.5", "inf", "nan", "infinity"])


@settings(max_examples=2000, deadline=None)
@given(st.lists(_TOKENS, max_size=30).map("".join))
def test_key_values_agree_with_the_plain_pattern_on_ordinary_lines(line: str) -> None:
    assert key_values(line) == _REFERENCE_KV.findall(line)


def test_a_log_with_a_40kb_word_and_a_20mb_line_scans_quickly_in_flat_memory(tmp_path: Path) -> None:
    """Before: the 40 KB line took 42 s (quadratic key=value search) and a long line was held whole."""
    word = tmp_path / "word.log"
    word.write_text("step=1 grad_norm=1.0 loss=0.1\n" + "a" * 40_000 + "\nstep=2 grad_norm=1.1 loss=0.1\n")
    huge = tmp_path / "huge.log"
    with huge.open("w") as handle:
        handle.write("step=3 grad_norm=1.0 loss=0.1\n")
        for _ in range(20):
            handle.write("step=9 grad_norm=" + "7" * (1024 * 1024 - 17))  # no newline for 20 MB
        handle.write("\nstep=4 grad_norm=1.2 loss=0.1\n")

    child = subprocess.run(
        [sys.executable, "-c", _SCAN_IN_A_CHILD, str(word), str(huge), str(tmp_path / "copies")],
        capture_output=True,
        text=True,
        timeout=30,  # generous: the defect was a scan that never ended
        env=_package_env(),
    )

    assert child.returncode == 0, child.stderr[-2000:]
    doc = json.loads(child.stdout)
    assert doc["lines"] == 6 and doc["long_lines"] == 1
    assert doc["iterations"] == [1, 2, 3, 4]  # the long line is left out of the series, its neighbours are not
    assert doc["grew_kib"] < 10 * 1024  # holding the 20 MB line would take at least 20 MB
    assert (tmp_path / "copies" / "huge.log").stat().st_size == huge.stat().st_size


def test_a_line_just_within_the_limit_is_read_whole(tmp_path: Path) -> None:
    log = tmp_path / "edge.log"
    prefix = "step=5 grad_norm=2.0 "
    log.write_text(prefix + "y" * (MAX_LINE_CHARS - len(prefix)) + "\n" + "z" * (MAX_LINE_CHARS + 1))
    scan = scan_logs([log], tmp_path / "copies")
    assert scan.lines == 2 and scan.long_lines == 1
    assert scan.series_points == [{"iteration": 5, "grad_norm": 2.0, "loss": None}]


def test_a_cancelled_scan_stops_inside_a_file(tmp_path: Path) -> None:
    many = tmp_path / "many.log"
    many.write_text("".join(f"step={i} grad_norm=1.0\n" for i in range(1, 20_001)))
    cancel = threading.Event()

    # The caller cancels as soon as the scan of the file starts.
    with pytest.raises(AxrlError, match=r"log scan cancelled in many.log at line (\d+)") as stopped:
        scan_logs([many], tmp_path / "copies", progress=lambda message: cancel.set(), cancel=cancel)
    line = re.search(r"line (\d+)", str(stopped.value))
    assert line is not None and int(line.group(1)) < 20_000
    # the copy runs beside the scan: it is stopped with it, or was already whole; never half-written
    assert [copy.read_bytes() for copy in (tmp_path / "copies").iterdir()] in ([], [many.read_bytes()])


def test_a_cancelled_scan_stops_inside_one_endless_line(tmp_path: Path) -> None:
    endless = tmp_path / "endless.log"
    with endless.open("w") as handle:
        for _ in range(8):
            handle.write("q" * (1024 * 1024))
    cancel = threading.Event()
    with pytest.raises(AxrlError, match=r"log scan cancelled in endless\.log at line 1"):
        scan_logs([endless], tmp_path / "copies", progress=lambda message: cancel.set(), cancel=cancel)


def test_a_cancelled_copy_leaves_no_partial_file(tmp_path: Path) -> None:
    big = tmp_path / "big.log"
    big.write_text("step=1 grad_norm=1.0\n" * 400_000)  # several copy chunks
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(AxrlError, match="log scan cancelled while copying"):
        scan_logs([big], tmp_path / "copies", cancel=cancel)
    assert list((tmp_path / "copies").iterdir()) == []


def _output_dir(root: Path, name: str = "run1~job-a__actor") -> Path:
    out = root / name
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "train.log").write_text("step=1 grad_norm=1.0 loss=0.5\nstep=2 grad_norm=1.1 loss=0.4\n")
    return out


def test_a_symlink_in_the_copy_dir_is_replaced_not_written_through(tmp_path: Path, cli) -> None:
    victim = tmp_path / "outside" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("keep me\n")
    out = _output_dir(tmp_path / "outputs")
    dest = tmp_path / "copies"
    (dest / out.name / "logs").mkdir(parents=True)
    (dest / out.name / "logs" / "train.log").symlink_to(victim)

    run = cli("logs", out, "--dest", dest, "--json")

    assert run.code == 0, run.err
    assert victim.read_text() == "keep me\n"
    copy = dest / out.name / "logs" / "train.log"
    assert not copy.is_symlink() and copy.read_text() == (out / "logs" / "train.log").read_text()
    assert len(run.json()["series_points"]) == 2


def test_a_copy_dir_that_leads_out_of_the_workspace_is_refused(tmp_path: Path, cli, monkeypatch) -> None:
    workspace, elsewhere = tmp_path / "ws", tmp_path / "elsewhere"
    workspace.mkdir()
    elsewhere.mkdir()
    (workspace / "tmp").symlink_to(elsewhere)
    out = _output_dir(tmp_path / "outputs")
    monkeypatch.chdir(workspace)

    run = cli("logs", out)

    assert run.code == 2 and "Traceback" not in run.err
    assert "leads outside" in run.err and "refusing to write there" in run.err
    assert list(elsewhere.iterdir()) == []


def test_a_folder_in_the_copy_dir_that_leads_out_is_skipped_and_said(tmp_path: Path, cli) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _output_dir(tmp_path / "outputs")
    dest = tmp_path / "copies"
    dest.mkdir()
    (dest / out.name).symlink_to(elsewhere)

    run = cli("logs", out, "--dest", dest, "--json")

    assert run.code == 0, run.err
    doc = run.json()
    assert doc["copied"] == [] and list(elsewhere.iterdir()) == []
    assert [s["path"] for s in doc["skipped"]] == [str(out / "logs" / "train.log")]
    assert "leads outside" in doc["skipped"][0]["reason"]


def test_a_log_symlinked_out_of_the_output_dir_is_not_read(tmp_path: Path, cli) -> None:
    secret = tmp_path / "secret" / "id_rsa.log"
    secret.parent.mkdir()
    secret.write_text("PRIVATE KEY step=1 grad_norm=9\n")
    out = _output_dir(tmp_path / "outputs")
    (out / "logs" / "stolen.log").symlink_to(secret)
    (out / "logs" / "loop.log").symlink_to(out / "logs" / "loop.log")

    run = cli("logs", out, "--dest", tmp_path / "copies", "--json")

    assert run.code == 0, run.err
    doc = run.json()
    assert [Path(c).name for c in doc["copied"]] == ["train.log"]
    assert [Path(s["path"]).name for s in doc["skipped"]] == ["stolen.log"]
    assert "leads outside" in doc["skipped"][0]["reason"]
    assert not list((tmp_path / "copies").rglob("stolen.log"))
    human = cli("logs", out, "--dest", tmp_path / "copies")
    assert "skipped 1 entry" in human.out and "stolen.log" in human.out


def test_a_job_name_from_a_directory_cannot_climb_out_of_tmp(tmp_path: Path, cli, monkeypatch) -> None:
    """`r~..__actor` names the job `..`: the copy would have gone to tmp/spike-replay/../logs."""
    out = _output_dir(tmp_path / "outputs", "r~..__actor")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    monkeypatch.chdir(workspace)

    run = cli("logs", out)

    assert run.code == 2 and "Traceback" not in run.err
    assert "job name" in run.err and "'..'" in run.err and "not a plain file name" in run.err
    assert not (workspace / "tmp").exists()
