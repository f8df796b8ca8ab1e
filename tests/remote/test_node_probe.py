"""Probing a node before replaying there: GPUs, Python, torch, this package, and the replay plan for a snapshot."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ssh_loopback import LoopbackServer

import axrl_spike_replay
from axrl_spike_replay.remote.node import probe_node
from axrl_spike_replay.remote.nodes.node_probe import NodeReport, parse_nvidia_smi, parse_probe, plan_for_snapshot
from axrl_spike_replay.remote.transport.options import RemoteOptions

H200_CSV = "NVIDIA H200, 143771 MiB, 570.124.06\nNVIDIA H200, 143771 MiB, 570.124.06\n"


def write_snapshot_meta(directory: Path, world_size: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"job_name": "j", "role": "actor", "iteration": 3, "grad_norm": 9.0, "median_norm": 1.0,
            "parallel": {"world_size": world_size, "dp": world_size}}  # fmt: skip
    (directory / "axrl_metadata.json").write_text(json.dumps(meta))
    return directory


def test_nvidia_smi_csv_is_read_into_gpus() -> None:
    gpus = parse_nvidia_smi(H200_CSV + "Weird, Inc. GPU, 1024 MiB, 1.0\n")
    assert [(g.index, g.name, g.memory_total_mib, g.driver) for g in gpus] == [
        (0, "NVIDIA H200", 143771, "570.124.06"),
        (1, "NVIDIA H200", 143771, "570.124.06"),
        (2, "Weird, Inc. GPU", 1024, "1.0"),
    ]


def test_the_plan_says_full_or_reduced_fidelity() -> None:
    report = parse_probe(f"@@axrl-probe gpus\n{H200_CSV}@@axrl-probe rc 0\n", NodeReport(target="gpu-a"))
    assert report.gpu_count == 2 and report.driver == "570.124.06"
    assert plan_for_snapshot(report, 2, "/s").fits_full_fidelity is True
    reduced = plan_for_snapshot(report, 8, "/s")
    assert reduced.fits_full_fidelity is False  # not one GPU per saved rank
    assert reduced.plan.startswith("full fidelity on GPUs: 2 process(es) replay the 8 saved ranks, each several")


def test_a_node_without_gpus_is_probed_over_ssh(server: LoopbackServer, tmp_path: Path) -> None:
    snapshot = write_snapshot_meta(tmp_path / "iter_0000003", world_size=4)
    report = probe_node(server.spec(), sys.executable, snapshot)
    assert report.gpu_count == 0 and report.gpus == [] and report.nvidia_smi == "not found"
    assert any("nvidia-smi not found" in note for note in report.notes)
    assert report.python_version == platform.python_version()
    assert report.torch_version == torch.__version__ and report.cuda_available is False
    assert report.package_importable and report.package_version == axrl_spike_replay.__version__
    assert report.world_size_saved == 4 and report.fits_full_fidelity is False
    assert report.plan.startswith("no GPU: full fidelity only on CPU")


def test_a_missing_interpreter_is_reported_not_fatal(asyncssh_server: LoopbackServer) -> None:
    report = probe_node(asyncssh_server.spec(), "/nonexistent/python")
    assert report.python_version is None and not report.package_importable
    assert any("/nonexistent/python did not run" in note for note in report.notes)


def test_the_node_verb_prints_one_json_document(asyncssh_server: LoopbackServer, tmp_path: Path, cli) -> None:
    (tmp_path / "spike-replay.yaml").write_text(
        f"targets:\n  gpu-a:\n    ssh: {json.dumps(asyncssh_server.spec())}\n    python: {sys.executable}\n"
    )
    done = cli("node", "gpu-a", "--workspace", tmp_path, "--json")  # the CLI's main, in this process
    assert done.code == 0, done.err
    doc = done.json()
    assert doc["target"] == "gpu-a" and doc["gpu_count"] == 0 and doc["package_importable"]
    people = cli("node", "gpu-a", "--workspace", tmp_path)
    assert "GPUs               none (nvidia-smi not found)" in people.out


def test_the_node_verb_refuses_an_unknown_host_without_a_traceback(
    asyncssh_server: LoopbackServer, tmp_path, cli
) -> None:
    spec = asyncssh_server.spec(known_hosts=tmp_path / "empty_known_hosts")
    done = cli("node", spec, "--json")  # the CLI's main, in this process: an exception would fail the test
    assert done.code == 2 and done.out == ""
    assert "is not in known_hosts" in done.err and "SHA256:" in done.err and "Traceback" not in done.err
    accepted = cli("node", spec, "--accept-new-host-key", "--json")
    assert accepted.code == 0, accepted.err
    assert any("new host key recorded" in n for n in accepted.json()["notes"])


@pytest.mark.slow
def test_install_puts_this_package_into_the_nodes_interpreter(openssh_server: LoopbackServer, tmp_path: Path) -> None:
    """`node --install`: wheel built here, copied over SFTP, pip-installed (no deps, no index) into a fresh venv."""
    venv = tmp_path / "node venv"
    # A bare venv that borrows pip from the base interpreter's site-packages (creating one with pip takes long).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    before = probe_node(openssh_server.spec(), python)
    assert not before.package_importable
    after = probe_node(openssh_server.spec(), python, install=True, options=RemoteOptions())
    assert after.package_importable and after.package_version == axrl_spike_replay.__version__
    assert any(note.startswith("installed axrl_spike_replay-") for note in after.notes)
    assert list((venv / "lib").glob("python*/site-packages/axrl_spike_replay/__init__.py"))
