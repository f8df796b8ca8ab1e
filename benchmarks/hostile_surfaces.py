"""The worst case of each hostile class on the command backend, the warm service and `logs`, beside the honest case
of the same size, each in its own fresh process importing the package under test (see bench_hostile.py):

- output line: a command printing `line_mb` MB as one line without a newline, vs the same bytes in 100-byte lines,
  run through the local session (the pump that writes stdout.log and echoes each line); peak RSS of the session's
  process, time, and how many bytes were echoed;
- warm frame: a `frame_mib` MiB message without a newline sent to a running `serve`, vs a valid request of just
  under 1 MiB; the service's CPU seconds for it and its peak RSS;
- logs dir: `logs` of a dir holding `log_files` one-line logs, vs one log holding the same lines; wall time and
  peak RSS of the `logs` process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PUMP = """
import asyncio, json, sys, tempfile, time
from pathlib import Path
from axrl_spike_replay.remote.transport.local_session import LocalSession
script = sys.argv[1]
out = Path(tempfile.mkdtemp(prefix="axrl-bench-pump-"))
echoed = [0, 0]
def on_line(stream, line):
    echoed[0] += 1
    echoed[1] += len(line)
t0 = time.perf_counter()
outcome = asyncio.run(LocalSession().run(script, stdout_path=out / "o", stderr_path=out / "e", on_line=on_line))
t = time.perf_counter() - t0
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({"seconds": t, "peak_rss_kib": hwm, "ok": outcome.ok, "lines": echoed[0], "echoed": echoed[1],
                  "log_bytes": (out / "o").stat().st_size}))
"""


def _child(code: str, args: list[str], package: Path, timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(package)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"did not finish within {timeout_s:g} s"}
    lines = done.stdout.strip().splitlines()
    if not lines:
        return {"failed": f"exit {done.returncode}: {done.stderr[-300:]}"}
    return json.loads(lines[-1])


def output_line_rows(package: Path, line_mb: int, timeout_s: float) -> list[tuple[str, dict[str, Any]]]:
    """The pump's cost for one `line_mb` MB line and for the same bytes in 100-byte lines."""
    size = line_mb * 1_000_000
    honest = f"yes {'x' * 99} | head -c {size}"
    hostile = f"head -c {size} /dev/zero | tr '\\0' x"
    return [
        (f"{line_mb} MB in 100-byte lines", _child(PUMP, [honest], package, timeout_s)),
        (f"one {line_mb} MB line", _child(PUMP, [hostile], package, timeout_s)),
    ]


def _service(package: Path, workspace: Path) -> tuple[subprocess.Popen[bytes], Path]:
    env = {**os.environ, "PYTHONPATH": str(package)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "axrl_spike_replay",
            "serve",
            "--workspace",
            str(workspace),
            "--warm-idle-timeout",
            "600",
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sock = workspace / "tmp" / "spike-replay-warm" / "serve.sock"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if _ping(sock):
            return process, sock
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("the warm service did not start")


def _ping(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(str(sock))
            conn.sendall(b'{"op":"ping"}\n')
            return b"pid" in conn.recv(4096)
    except OSError:
        return False


def _cpu_and_hwm(pid: int) -> tuple[float, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    hwm = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmHWM:"))  # fmt: skip
    return cpu, hwm


def _send_frame(sock: Path, frame: bytes, timeout_s: float) -> tuple[float, bytes]:
    """Send `frame` (from a thread: the service may stop reading) and read the reply until EOF."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(str(sock))
        started = time.perf_counter()

        def write() -> None:
            with contextlib.suppress(OSError):  # the service may stop reading (over its cap)
                conn.sendall(frame)

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        reply = b""
        try:
            while chunk := conn.recv(1 << 16):
                reply += chunk
        except OSError:
            pass
        writer.join(timeout_s)
        return time.perf_counter() - started, reply


def warm_frame_rows(package: Path, frame_mib: int, timeout_s: float) -> list[tuple[str, dict[str, Any]]]:
    """The service's CPU and memory for a valid request under 1 MiB and for a `frame_mib` MiB message."""
    workspace = Path(tempfile.mkdtemp(prefix="axrl-bench-warm-"))
    process, sock = _service(package, workspace)
    rows = []
    try:
        honest = json.dumps({"op": "ping", "pad": "x" * ((1 << 20) - 100)}).encode() + b"\n"
        hostile = b"{" + b"x" * (frame_mib << 20)
        for label, frame in ((f"{len(honest) / 2**20:.2f} MiB ping", honest), (f"{frame_mib} MiB frame", hostile)):
            cpu0, _ = _cpu_and_hwm(process.pid)
            seconds, reply = _send_frame(sock, frame, timeout_s)
            cpu1, hwm = _cpu_and_hwm(process.pid)
            answer = reply.decode(errors="replace").strip()[:70] or "(closed without a reply)"
            rows.append((label, {"seconds": seconds, "cpu_s": cpu1 - cpu0, "peak_rss_kib": hwm, "answer": answer}))
    finally:
        process.terminate()
        process.wait(30)
        shutil.rmtree(workspace, ignore_errors=True)
    return rows


LOGS = """
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
done = subprocess.run([sys.executable, "-m", "axrl_spike_replay", "logs", sys.argv[1], "--dest", sys.argv[2], "--json"],
                      capture_output=True, text=True)
t = time.perf_counter() - t0
kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
doc = json.loads(done.stdout) if done.returncode == 0 else {}
failed = None if done.returncode == 0 else done.stderr[-200:]
print(json.dumps({"seconds": t, "peak_rss_kib": kib, "copied": len(doc.get("copied", [])),
                  "iterations": doc.get("series_total"), "failed": failed}))
"""


def _line(iteration: int) -> str:
    return f" iteration {iteration:8d}/ 1000000 | grad norm: {1.0 + iteration % 7 / 10:.3f} | loss: 1.0 |\n"


def logs_dir_rows(package: Path, log_files: int, timeout_s: float) -> list[tuple[str, dict[str, Any]]]:
    """`logs` of one log holding `log_files` lines, and of `log_files` one-line logs."""
    root = Path(tempfile.mkdtemp(prefix="axrl-bench-logs-"))
    try:
        one = root / "one~bench__actor"
        one.mkdir()
        (one / "train.log").write_text("".join(_line(i) for i in range(log_files)))
        many = root / "many~bench__actor"
        (many / "logs").mkdir(parents=True)
        for i in range(log_files):
            (many / "logs" / f"rank{i:06d}.log").write_text(_line(i))
        rows = []
        for label, folder in ((f"1 log of {log_files} lines", one), (f"{log_files} one-line logs", many)):
            result = _child(LOGS, [str(folder), str(root / f"dest-{folder.name}")], package, timeout_s)
            rows.append((label, {k: v for k, v in result.items() if v is not None}))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def print_rows(title: str, rows: list[tuple[str, dict[str, Any]]], extra: str) -> float:
    """A table of `rows` (label, figures); the hostile / honest peak-memory ratio (inf when hostile failed)."""
    print(f"\n{title}")
    print(f"{'case':<28} {'seconds':>9} {'peak RSS MiB':>13}  {extra}")
    for label, r in rows:
        seconds = r.get("seconds", float("nan"))
        rss = r.get("peak_rss_kib", 0) / 1024
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
        detail = r.get("failed") or ", ".join(
            f"{k} {v}" for k, v in shown.items() if k not in ("seconds", "peak_rss_kib")
        )
        print(f"{label:<28} {seconds:>9.2f} {rss:>13.0f}  {detail}")
    (_, honest), (_, hostile) = rows
    if "failed" in hostile or not honest.get("peak_rss_kib"):
        return float("inf")
    memory = hostile["peak_rss_kib"] / honest["peak_rss_kib"]
    print(f"peak memory hostile / honest: {memory:.2f}x; time hostile / honest: "
          f"{hostile['seconds'] / max(honest['seconds'], 1e-9):.2f}x")  # fmt: skip
    return memory
