"""`mcp --socket PATH`: streamable HTTP on a Unix socket only the server's user can use. The socket is 0600, and a
peer of another user is refused by its user id (SO_PEERCRED) even where the socket's mode would let it connect."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from http_helpers import INITIALIZE, MCP_HEADERS, as_nobody, http_server, with_http_client
from server_helpers import server_command


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A dir with a path short enough for a socket, that other users may enter (the peer check is what stops them)."""
    path = Path(tempfile.mkdtemp(prefix="axrl-sock-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_server_user_is_served_on_a_private_socket(short_dir: Path, workspace: Path, tmp_path: Path) -> None:
    socket_path = short_dir / "mcp.sock"
    with http_server(workspace, tmp_path / "state", socket_path=socket_path) as server:
        assert stat.S_IMODE(os.lstat(socket_path).st_mode) == 0o600
        listed = with_http_client(server.url, lambda client: client.list_tools(), uds=socket_path)
        assert "copy_and_scan_logs" in {t.name for t in listed.tools}
        assert not (tmp_path / "state").exists()  # no token: the kernel says who connects
        second = subprocess.run(
            [*server_command(), "mcp", "--socket", str(socket_path)], capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 2 and "already listens" in second.stderr  # the first keeps its socket
        assert with_http_client(server.url, lambda client: client.list_tools(), uds=socket_path).tools
    assert not socket_path.exists()  # removed when the server stops


def test_another_user_is_refused_by_its_user_id_even_through_an_open_socket(
    short_dir: Path, workspace: Path, tmp_path: Path
) -> None:
    nobody = as_nobody()
    if nobody is None or shutil.which("curl") is None:
        pytest.skip("needs root, runuser and curl to act as the user nobody")
    socket_path = short_dir / "mcp.sock"
    with http_server(workspace, tmp_path / "state", socket_path=socket_path) as server:
        socket_path.chmod(0o666)  # as if the mode check were lost: the peer check still holds
        headers = [arg for name, value in MCP_HEADERS.items() for arg in ("-H", f"{name}: {value}")]
        request = ["--unix-socket", str(socket_path), "-X", "POST", server.url, *headers, "-d", json.dumps(INITIALIZE)]
        done = subprocess.run([*nobody, "curl", "-s", "-i", *request], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "HTTP/1.1" not in done.stdout  # closed before any answer
        mine = subprocess.run(["curl", "-s", "-i", *request], capture_output=True, text=True, timeout=60)
        assert mine.stdout.startswith("HTTP/1.1 200")
    said = server.stderr()  # the server's log (wrapped to the terminal's width)
    assert "refused a connection from user id" in said and "65534" in said


def _start_on(path: Path, workspace: Path) -> subprocess.CompletedProcess[str]:
    argv = [*server_command(), "mcp", "--socket", str(path), "--workspace", str(workspace), "--no-warm"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_what_is_not_a_socket_at_the_path_is_refused_and_left_alone(short_dir: Path, workspace: Path) -> None:
    """`--socket PATH` once removed whatever was at PATH: a file, a dir, a symlink are refused by name, unchanged."""
    kept = short_dir / "precious.txt"
    kept.write_text("keep me\n")
    folder = short_dir / "folder"
    folder.mkdir()
    (folder / "inside").write_text("x")
    link = short_dir / "link"
    link.symlink_to(kept)
    for path, kind in ((kept, "a file"), (folder, "a directory"), (link, "a symlink")):
        done = _start_on(path, workspace)
        assert done.returncode == 2, done.stderr
        assert f"{path} is {kind}, not a socket" in done.stderr and "Traceback" not in done.stderr
    assert kept.read_text() == "keep me\n" and (folder / "inside").read_text() == "x" and link.is_symlink()


def test_a_missing_dir_or_a_path_too_long_for_a_socket_is_a_clear_error(short_dir: Path, workspace: Path) -> None:
    missing = short_dir / "no-such-dir" / "mcp.sock"
    done = _start_on(missing, workspace)
    assert done.returncode == 2 and f"no directory {missing.parent}" in done.stderr, done.stderr
    long = short_dir / ("d" * 100) / "mcp.sock"
    long.parent.mkdir()
    done = _start_on(long, workspace)
    assert done.returncode == 2 and "at most 107" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not long.exists()
