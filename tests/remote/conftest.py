"""Loopback SSH servers (asyncssh's server API and OpenSSH sshd) shared by the remote tests."""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from remote_helpers import make_command_snapshot, make_training_checkout
from slurm_loopback import SlurmCluster, SlurmUnavailable, start_cluster
from ssh_loopback import SSHD, AsyncsshServer, Keys, LoopbackServer, OpenSshServer, write_known_hosts

if TYPE_CHECKING:
    from axrl_spike_replay.experiment.result import ReplayResult


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """No test reads or writes the real ~/.ssh (config, known_hosts, keys)."""
    home = tmp_path_factory.mktemp("home")
    old = {name: os.environ.get(name) for name in ("HOME", "SSH_AUTH_SOCK")}
    os.environ["HOME"] = str(home)
    os.environ.pop("SSH_AUTH_SOCK", None)
    yield home
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys.make(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="session")
def asyncssh_server(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Iterator[LoopbackServer]:
    directory = tmp_path_factory.mktemp("asyncssh-server")
    server = AsyncsshServer(directory, keys)
    known = write_known_hosts(directory / "known_hosts", server.port, keys.host_pub)
    yield LoopbackServer("asyncssh", server.port, getpass.getuser(), keys, known)
    server.stop()


@pytest.fixture(scope="session")
def openssh_server(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Iterator[LoopbackServer]:
    if SSHD is None:
        pytest.skip("OpenSSH sshd is not installed (scripts/sshd-install.sh installs it)")
    directory = tmp_path_factory.mktemp("openssh-server")
    server = OpenSshServer(directory, keys)
    known = write_known_hosts(directory / "known_hosts", server.port, keys.host_pub)
    yield LoopbackServer("openssh", server.port, getpass.getuser(), keys, known)
    server.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A one-node Slurm cluster on loopback (munged, slurmctld, slurmd), stopped with all its processes at the end."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        pytest.skip(f"no loopback Slurm cluster: {exc}")
    yield cluster
    left = cluster.stop()
    assert not left, f"Slurm processes outlived the cluster: {left}"


@pytest.fixture(scope="session")
def local_replay() -> ReplayResult:
    """The local replay of replay_launch_helpers.SNAPSHOT (nothing written), run once: the launched replays'
    reference."""
    from replay_launch_helpers import SNAPSHOT

    from axrl_spike_replay.experiment.result import ReplayResult
    from axrl_spike_replay.investigation.request import What, replay_request
    from axrl_spike_replay.investigation.runs import run_request

    result = run_request(replay_request(What(SNAPSHOT)))
    assert isinstance(result, ReplayResult)
    return result


@pytest.fixture(params=["asyncssh", "openssh"])
def server(request: pytest.FixtureRequest) -> LoopbackServer:
    """Each test using it runs against both servers."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture
def training_checkout(tmp_path: Path) -> Path:
    """The node's training checkout: a git repo with a replay script whose output a patch can change."""
    return make_training_checkout(tmp_path)


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """A snapshot's metadata at a path with shell metacharacters (the replay script only reads the metadata)."""
    return make_command_snapshot(tmp_path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that need Debian's OpenSSH sshd or Slurm (`-m "not sshd"`, `-m "not slurm"` deselect them)."""
    here = Path(__file__).parent
    for item in items:
        if here not in item.path.parents:
            continue  # this hook sees every collected test; only ours are marked
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        if "openssh_server" in getattr(item, "fixturenames", ()) or "openssh" in params:
            item.add_marker(pytest.mark.sshd)
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
