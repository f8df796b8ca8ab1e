"""The worst case of the hostile inputs of the MCP stdio server, `capture --fault` and the skill eval scorer, beside the
honest input of the same size, each in its own fresh process importing the package under test (see bench_hostile.py):

- stdio line: one request line of `line_kib` KiB nested as deep as it goes (`{"arguments": {"a": [[[...]]]}}`), and
  one nesting a level per 5 bytes (`[[],[[],...]]`), vs a `ping` whose parameter is a string of the same size; a
  fresh `mcp` server process for each, its CPU seconds for the line (from when it is sent to its reply) and its peak
  RSS;
- fault spec: a `--fault` of `spec_kib` KiB nested as deep as it goes, and one holding an unterminated string of
  escaped quotes (`"\\"\\"\\"...`), each vs a valid spec padded with spaces to the same size; what `capture` does with
  it before training (`capture_commands._faults`): wall time and peak RSS of that process;
- scorer: `evals/score.py` on a report of `report_lines` blank lines vs one of as many lines of prose.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hostile_surfaces import _child, _cpu_and_hwm

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}},
}


def _stdio_case(package: Path, line: str, timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(package)}
    argv = [sys.executable, "-m", "axrl_spike_replay", "mcp", "--no-warm"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(INITIALIZE).encode() + b"\n")
        proc.stdin.write(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
        proc.stdin.flush()
        proc.stdout.readline()
        cpu0, _ = _cpu_and_hwm(proc.pid)
        started = time.perf_counter()
        proc.stdin.write(line.encode() + b"\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        reply = proc.stdout.readline() if ready else b""
        seconds = time.perf_counter() - started
        if not reply:
            ended = "ended" if proc.poll() is not None else f"gave no reply within {timeout_s:g} s"
            return {"failed": f"the server {ended}"}
        cpu1, hwm = _cpu_and_hwm(proc.pid)
        answer = json.loads(reply)
        said = answer.get("error", {}).get("message", "result") if "error" in answer else "result"
        return {"seconds": seconds, "cpu_s": cpu1 - cpu0, "peak_rss_kib": hwm, "answer": said[:60]}
    except (OSError, ValueError) as exc:
        return {"failed": f"{type(exc).__name__}: {exc}"[:200]}
    finally:
        proc.kill()
        proc.wait(timeout_s)


def stdio_line_rows(package: Path, line_kib: int, timeout_s: float) -> list[list[tuple[str, dict[str, Any]]]]:
    """Two tables: the server's cost for an honest `ping` line beside a line nested as deep as it is long, and beside
    one that nests a level per 5 bytes (`[[],[[],...]]`: valid JSON, as many bracket runs as the scan can be made to
    read), of `line_kib` KiB each."""
    size = line_kib << 10
    head = (
        '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "inspect_snapshot", "arguments": {"a": '
    )
    depth = (size - len(head) - 3) // 2
    deep = head + "[" * depth + "]" * depth + "}}}"
    levels = (size - len(head) - 3) // 5
    runs = head + "[[]," * levels + "]" * levels + "}}}"  # valid JSON, a level per 5 bytes, two bracket runs each
    honest = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"pad": "x" * (size - 60)}})
    ping = (f"{line_kib} KiB ping", _stdio_case(package, honest, timeout_s))
    return [
        [ping, (f"{line_kib} KiB, {depth} deep", _stdio_case(package, deep, timeout_s))],
        [ping, (f"{line_kib} KiB of [[],", _stdio_case(package, runs, timeout_s))],
    ]


FAULTS = """
import json, sys, time
from axrl_spike_replay.cli.capture_commands import _faults
from axrl_spike_replay.errors import AxrlError
spec = open(sys.argv[1]).read()
t0 = time.perf_counter()
try:
    outcome = {"built": len(_faults([spec]))}
except AxrlError as exc:
    outcome = {"refused": str(exc)[:60]}
except BaseException as exc:
    outcome = {"failed": f"{type(exc).__name__}: {str(exc)[:100]}"}
t = time.perf_counter() - t0
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"seconds": t, "peak_rss_kib": hwm, **outcome}))
"""


def fault_spec_rows(package: Path, spec_kib: int, workdir: Path, timeout_s: float) -> list[list[tuple[str, dict]]]:
    """Two tables: an honest spec padded to `spec_kib` KiB beside a spec as deep as it is long, and beside one
    holding an unterminated string of escaped quotes, of the same size."""
    size = spec_kib << 10
    honest = '{"kind": "logprob_shift", "params": {"signal": "old_logprobs"}}'
    head = '{"kind": "logprob_shift", "params": {"signal": '
    depth = (size - len(head)) // 2
    cases = {
        "honest": honest + " " * (size - len(honest)),
        "deep": head + "[" * depth + "]" * depth + "}}",
        "quotes": head + '"' + '\\"' * ((size - len(head)) // 2),
    }
    results = {}
    for name, text in cases.items():
        path = workdir / f"fault-{name}.json"
        path.write_text(text)
        results[name] = _child(FAULTS, [str(path)], package, timeout_s)
    return [
        [(f"{spec_kib} KiB valid spec", results["honest"]), (f"{spec_kib} KiB, {depth} deep", results["deep"])],
        [(f"{spec_kib} KiB valid spec", results["honest"]), (f"{spec_kib} KiB of escaped quotes", results["quotes"])],
    ]


SCORER = """
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("score", sys.argv[1])
score = importlib.util.module_from_spec(spec)
spec.loader.exec_module(score)
doc = json.loads(open(sys.argv[2]).read())
report = open(sys.argv[3]).read()
t0 = time.perf_counter()
graded = score.score_report(report, doc["evals"][0], doc["families"])
t = time.perf_counter() - t0
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"seconds": t, "peak_rss_kib": hwm, "score": graded["score"]}))
"""


def scorer_rows(package: Path, report_lines: int, workdir: Path, timeout_s: float) -> list[tuple[str, dict]]:
    """The eval scorer (of the checkout `package` belongs to) on prose and on blank lines, `report_lines` each."""
    evals = package.parent / "skills" / "axrl-spike-replay" / "evals"
    tail = (
        "Cause family: engine_mismatch\nRanks: none\nProof: recompute=rollout_logprobs\n"
        "Fix: mismatch_token_clip_max=2\n"
    )
    reports = {"prose": "The rollout log-probs disagree with the replay.\n", "blank": "\n"}
    rows = []
    for name, line in reports.items():
        path = workdir / f"report-{name}.md"
        path.write_text(line * report_lines + tail)
        args = [str(evals / "score.py"), str(evals / "evals.json"), str(path)]
        rows.append((f"{report_lines} {name} lines", _child(SCORER, args, package, timeout_s)))
    return rows
