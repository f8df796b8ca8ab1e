"""What a node offers: GPUs (nvidia-smi), Python, torch, this package; and whether a snapshot fits full fidelity."""

from __future__ import annotations

import csv
import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.remote.transport.job import Session
from axrl_spike_replay.remote.transport.shell import bash_command
from axrl_spike_replay.replay.streamed.speeds import Speeds

NVIDIA_SMI_QUERY = "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"
_MARK = "@@axrl-probe"

_PYTHON_PROBE = """
import json, platform, socket, sys
d = {"python_version": platform.python_version(), "executable": sys.executable, "hostname": socket.gethostname()}
if "--torch" in sys.argv:
    try:
        import torch
        d["torch_version"] = torch.__version__
        d["torch_cuda"] = torch.version.cuda
        d["cuda_available"] = bool(torch.cuda.is_available())
    except Exception as exc:
        d["torch_error"] = repr(exc)[:300]
elif "--torch-installed" in sys.argv:  # without importing it (seconds saved where only presence matters)
    import importlib.metadata, importlib.util
    try:
        if importlib.util.find_spec("torch") is None:
            raise ModuleNotFoundError("No module named 'torch'")
        d["torch_version"] = importlib.metadata.version("torch")
    except Exception as exc:
        d["torch_error"] = repr(exc)[:300]
try:
    import axrl_spike_replay
    d["package_version"] = axrl_spike_replay.__version__
except Exception as exc:
    d["package_error"] = repr(exc)[:300]
print("@@axrl-probe json " + json.dumps(d))
"""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as nvidia-smi lists it."""

    index: int
    name: str
    memory_total_mib: int | None
    driver: str


@dataclass
class NodeReport:
    """A node's GPUs and software, and the replay plan for a snapshot when one was given."""

    target: str
    hostname: str | None = None
    gpu_count: int = 0
    gpus: list[GpuInfo] = field(default_factory=list)
    driver: str | None = None
    nvidia_smi: str = "not run"  # "ok" | "not found" | "failed: ..."
    python: str = "python3"
    python_version: str | None = None
    python_executable: str | None = None
    torch_version: str | None = None
    torch_cuda: str | None = None
    cuda_available: bool | None = None
    package_importable: bool = False
    package_version: str | None = None
    snapshot: str | None = None
    world_size_saved: int | None = None
    fits_full_fidelity: bool | None = None  # enough GPUs for one per saved rank
    plan: str | None = None  # what a replay of the snapshot would do here
    notes: list[str] = field(default_factory=list)
    temp_dir: str | None = None  # made by the probe when asked (saves a round trip before a run)
    speeds: Speeds | None = None  # the node's read and compute speeds, when measured (`remote_speeds`)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def node_field(self) -> dict[str, Any]:
        """The `node` field recorded in a replay result."""
        return {
            "target": self.target,
            "hostname": self.hostname,
            "gpu_count": self.gpu_count,
            "gpus": [f"{g.name} ({g.memory_total_mib} MiB)" for g in self.gpus],
            "driver": self.driver,
        }


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    """GPUs from `nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader` output."""
    gpus: list[GpuInfo] = []
    for row in csv.reader(line for line in text.splitlines() if line.strip()):
        if len(row) < 3:
            continue
        name, memory, driver = ",".join(row[:-2]).strip(), row[-2].strip(), row[-1].strip()
        match = re.match(r"^(\d+)", memory)
        gpus.append(GpuInfo(len(gpus), name, int(match.group(1)) if match else None, driver))
    return gpus


def probe_script(
    python: str,
    setup: Sequence[str] = (),
    with_python: bool = True,
    with_torch: bool = True,
    temp_prefix: str | None = None,
    import_torch: bool = True,
) -> str:
    """One shell script: host name, nvidia-smi, a temp dir if asked, then (after the setup lines) Python.

    Without `import_torch` torch is only looked up (installed, its version), not imported: no CUDA facts."""
    lines = [f'echo "{_MARK} host $(uname -n)"']
    if temp_prefix is not None:
        if not temp_prefix.replace("-", "").isalnum():
            raise ValueError(f"temp dir prefix {temp_prefix!r} must be letters, digits or '-'")
        lines.append(f'echo "{_MARK} tmp $(mktemp -d "${{TMPDIR:-/tmp}}/{temp_prefix}XXXXXXXX")"')
    lines += [
        f"echo '{_MARK} gpus'",
        f'if command -v nvidia-smi >/dev/null 2>&1; then {NVIDIA_SMI_QUERY} 2>&1; echo "{_MARK} rc $?";',
        f"else echo '{_MARK} missing'; fi",
    ]
    if with_python:
        lines += [f"echo '{_MARK} python'", *setup]
        flag = "--torch" if import_torch else "--torch-installed"
        args = [python, "-c", _PYTHON_PROBE] + ([flag] if with_torch else [])
        lines.append(" ".join(shlex.quote(a) for a in args) + f' 2>&1; echo "{_MARK} rc $?"')
    return "\n".join(lines) + "\n"


def parse_probe(output: str, report: NodeReport) -> NodeReport:
    """Fill `report` from the probe script's output."""
    section, gpu_lines, python_lines = "", [], []
    for line in output.splitlines():
        if line.startswith(_MARK):
            word = line[len(_MARK) :].split()
            if word[:1] == ["host"]:
                report.hostname = report.hostname or " ".join(word[1:]) or None
            elif word[:1] == ["tmp"]:
                report.temp_dir = " ".join(word[1:]) or None
            elif word and word[0] in ("gpus", "python"):
                section = word[0]
            elif word and word[0] == "missing":
                report.nvidia_smi = "not found"
            elif word[:1] == ["rc"] and section == "gpus":
                report.nvidia_smi = "ok" if word[1:] == ["0"] else f"failed: {' '.join(gpu_lines)[:300]}"
            elif word[:1] == ["json"]:
                _python_facts(json.loads(line.split(" json ", 1)[1]), report)
            elif word[:1] == ["rc"] and section == "python" and word[1:] != ["0"]:
                report.notes.append(f"{report.python} did not run: {' '.join(python_lines)[-300:]}")
        elif section == "gpus":
            gpu_lines.append(line)
        elif section == "python":
            python_lines.append(line)
    if report.nvidia_smi == "ok":
        report.gpus = parse_nvidia_smi("\n".join(gpu_lines))
        report.gpu_count = len(report.gpus)
        report.driver = report.gpus[0].driver if report.gpus else None
    elif report.nvidia_smi == "not found":
        report.notes.append("nvidia-smi not found: no NVIDIA GPU driver here, 0 GPUs")
    elif report.nvidia_smi.startswith("failed"):
        report.notes.append(f"nvidia-smi {report.nvidia_smi}; counting 0 GPUs")
    return report


def _python_facts(doc: dict[str, Any], report: NodeReport) -> None:
    report.hostname = doc.get("hostname") or report.hostname
    report.python_version = doc.get("python_version")
    report.python_executable = doc.get("executable")
    report.torch_version = doc.get("torch_version")
    report.torch_cuda = doc.get("torch_cuda")
    report.cuda_available = doc.get("cuda_available")
    report.package_version = doc.get("package_version")
    report.package_importable = "package_version" in doc
    if "torch_error" in doc:
        report.notes.append(f"torch is not importable with {report.python}: {doc['torch_error']}")
    if "package_error" in doc:
        report.notes.append(
            f"axrl_spike_replay is not importable with {report.python}; run `axrl-spike-replay node TARGET --install`"
        )


def plan_for_snapshot(report: NodeReport, world_size: int, snapshot: str) -> NodeReport:
    """Say how a replay of a snapshot with `world_size` saved ranks runs here (full fidelity: every saved rank
    replayed, one per process, or several per process in turn where there are fewer GPUs)."""
    report.snapshot, report.world_size_saved = snapshot, world_size
    gpus = report.gpu_count
    report.fits_full_fidelity = gpus >= world_size
    if gpus >= world_size:
        report.plan = f"full fidelity: {world_size} process(es), one GPU each ({gpus} GPU(s) here)"
    elif gpus > 0:
        report.plan = (
            f"full fidelity on GPUs: {gpus} process(es) replay the {world_size} saved ranks, each several in turn "
            f"(one process per saved rank needs {world_size} GPUs); `plan` says what fits"
        )
    else:
        report.plan = f"no GPU: full fidelity only on CPU (device=cpu, {world_size} process(es), gloo)"
    return report


async def probe(
    session: Session,
    *,
    python: str = "python3",
    setup: Sequence[str] = (),
    with_python: bool = True,
    with_torch: bool = True,
    snapshot: str | Path | None = None,
    temp_prefix: str | None = None,
    import_torch: bool = True,
) -> NodeReport:
    """Probe the session's machine (one round trip); with a snapshot, plan its replay there."""
    report = NodeReport(target=session.label, python=python)
    script = probe_script(python, setup, with_python, with_torch, temp_prefix, import_torch)
    got = await session.capture(bash_command(script), timeout=120.0)
    parse_probe(got.stdout + got.stderr, report)
    if snapshot is not None:
        from axrl_spike_replay.remote.nodes.results import snapshot_facts

        facts = snapshot_facts(snapshot)
        plan_for_snapshot(report, facts.world_size, facts.snapshot)
    return report
