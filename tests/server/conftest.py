"""Fixtures of the MCP server tests: an output root with one job's actor dir (a real tiny snapshot and a
training log), copied per test, and an empty workspace."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from server_helpers import ITERATION, JOB, MEDIAN, RECORDED, SpikeOutputs

from tiny_spike import write_tiny_spike


def _log_lines() -> str:
    lines = []
    for it in range(1, 12):
        grad = RECORDED if it == ITERATION else MEDIAN + 0.01 * it
        lines.append(f" iteration {it:8d}/      20 | lm loss: 1.2{it:02d}E+00 | grad norm: {grad:.4f} |")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def spike_outputs_template(tmp_path_factory: pytest.TempPathFactory) -> SpikeOutputs:
    """Written once per session: a real snapshot (tiny MoE, world size 2) plus a Megatron-style log."""
    root = tmp_path_factory.mktemp("outputs")
    output_dir = root / f"run1~{JOB}__actor"
    snapshot = write_tiny_spike(
        output_dir, job=JOB, iteration=ITERATION, recorded=RECORDED, median=MEDIAN, param_norm=lambda r: 1.0 + r
    )
    log = output_dir / "train.log"
    log.write_text(_log_lines())
    return SpikeOutputs(root=root, output_dir=output_dir, snapshot=snapshot, log=log)


@pytest.fixture
def spike_outputs(spike_outputs_template: SpikeOutputs, tmp_path: Path) -> SpikeOutputs:
    """A private copy of the output root, so a test can preserve and release freely."""
    root = tmp_path / "outputs"
    shutil.copytree(spike_outputs_template.root, root)
    out = root / spike_outputs_template.output_dir.name
    return SpikeOutputs(
        root=root,
        output_dir=out,
        snapshot=out / spike_outputs_template.snapshot.relative_to(spike_outputs_template.output_dir),
        log=out / "train.log",
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """An empty workspace directory for the investigation's files."""
    ws = tmp_path / "workspace"
    ws.mkdir()
    return ws


@pytest.fixture(scope="session")
def ssh_node(tmp_path_factory: pytest.TempPathFactory):
    """A real SSH server on loopback (asyncssh's server API), the shared helper of the remote tests."""
    import getpass
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote"))
    from ssh_loopback import AsyncsshServer, Keys, LoopbackServer, write_known_hosts

    keys = Keys.make(tmp_path_factory.mktemp("keys"))
    directory = tmp_path_factory.mktemp("ssh-node")
    server = AsyncsshServer(directory, keys)
    known = write_known_hosts(directory / "known_hosts", server.port, keys.host_pub)
    yield LoopbackServer("asyncssh", server.port, getpass.getuser(), keys, known)
    server.stop()


@pytest.fixture
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No test reads or writes the real ~/.ssh."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home
