"""Over HTTP only the holder of the server's bearer token gets in: a real `mcp --http` process, the SDK's streamable
HTTP client, raw requests, another local user (`nobody`) and the MCP Inspector's CLI where it is installed."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from http_helpers import (
    INITIALIZE,
    HttpServer,
    as_nobody,
    bearer,
    free_port,
    http_server,
    raw_post,
    refused_start,
    server_env,
    tool_call,
    with_http_client,
)
from mcp.shared.exceptions import MCPError
from server_helpers import JOB, SpikeOutputs, server_command

from axrl_spike_replay.agent_install import http_entry
from axrl_spike_replay.mcp_faces.http_transport.http_access import is_loopback

REPO = Path(__file__).resolve().parents[2]


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    inner = getattr(exc, "exceptions", None)
    return [leaf for e in inner for leaf in _leaves(e)] if isinstance(inner, tuple) else [exc]


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@dataclass(frozen=True)
class Shared:
    """The module's server (default options: a token it made), its workspace and its state dir."""

    server: HttpServer
    workspace: Path
    state: Path


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """One `mcp --http` server for the tests that only knock on it (with or without the token), not one each; the
    tests of its token's life (made, private, removed) and of other options start their own."""
    root = tmp_path_factory.mktemp("http-auth")
    workspace = root / "workspace"
    workspace.mkdir()
    with http_server(workspace, root / "state") as server:
        yield Shared(server, workspace, root / "state")


def test_without_the_token_a_request_gets_401_no_session_and_no_tool_runs(
    spike_outputs: SpikeOutputs, shared: Shared
) -> None:
    server, workspace = shared.server, shared.workspace
    status, headers, body = raw_post(server.url, INITIALIZE)
    assert status == 401, body
    assert headers.get("www-authenticate", "").startswith("Bearer ")
    assert "mcp-session-id" not in {k.lower() for k in headers}

    call = tool_call("copy_and_scan_logs", {"logs": [str(spike_outputs.log)], "job": JOB})
    for wrong in (None, "x" * 43, server.token[:-1] + ("A" if server.token[-1] != "A" else "B"), "é" * 43):
        status, _, body = raw_post(server.url, call, bearer(wrong) if wrong else None)
        assert status == 401, (wrong, body)
    # the SDK's client gets the 401 too (it reports it as an error response of the server)
    with pytest.raises(BaseException) as refused:
        with_http_client(server.url, lambda client: client.list_tools())
    assert any(isinstance(e, MCPError) for e in _leaves(refused.value)), refused.value
    assert not (workspace / "tmp").exists()  # the tool never ran: nothing was copied


def test_with_the_token_the_sdk_client_works_and_the_token_file_is_private(workspace: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    with http_server(workspace, state) as server:
        token_file = server.token_file
        assert token_file is not None
        assert _mode(token_file) == 0o600 and _mode(token_file.parent) == 0o700
        assert os.lstat(token_file).st_uid == os.getuid()
        assert len(server.token) >= 40  # 256 random bits, URL-safe base64

        listed = with_http_client(server.url, lambda client: client.list_tools(), bearer(server.token))
        assert "copy_and_scan_logs" in {t.name for t in listed.tools}
        result = with_http_client(
            server.url,
            lambda client: client.call_tool("inspect_snapshot", {"snapshot": "no-such-snapshot"}),
            bearer(server.token),
        )
        assert result.is_error and "no-such-snapshot" in result.content[0].text
    assert not token_file.exists()  # a token the server made goes with it


def test_another_local_user_is_refused_and_cannot_read_the_token(spike_outputs: SpikeOutputs, shared: Shared) -> None:
    nobody = as_nobody()
    if nobody is None or shutil.which("curl") is None:
        pytest.skip("needs root, runuser and curl to act as the user nobody")
    spike_outputs.log.chmod(0o600)
    server, workspace = shared.server, shared.workspace
    assert server.token_file is not None

    def curl(body: dict) -> str:
        headers = ["-H", "Content-Type: application/json", "-H", "Accept: application/json, text/event-stream"]
        request = ["-X", "POST", server.url, *headers, "-d", json.dumps(body)]
        done = subprocess.run(
            [*nobody, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", *request],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.stdout

    assert curl(INITIALIZE) == "401"
    assert curl(tool_call("copy_and_scan_logs", {"logs": [str(spike_outputs.log)], "job": JOB})) == "401"
    stolen = subprocess.run([*nobody, "cat", str(server.token_file)], capture_output=True, text=True, timeout=60)
    assert stolen.returncode != 0 and server.token not in stolen.stdout
    assert not (workspace / "tmp").exists()


def _inspector() -> str | None:
    """The MCP Inspector's launcher: $AXRL_MCP_INSPECTOR, `mcp-inspector` on PATH, or scripts/inspector-install.sh's."""
    for candidate in (
        os.environ.get("AXRL_MCP_INSPECTOR"),
        shutil.which("mcp-inspector"),
        str(REPO / ".venv" / "mcp-inspector" / "node_modules" / ".bin" / "mcp-inspector"),
    ):
        if candidate and Path(candidate).is_file() and shutil.which("node"):
            return candidate
    return None


def test_the_mcp_inspector_cli_gets_in_with_the_header_mcp_token_prints(shared: Shared) -> None:
    inspector = _inspector()
    if inspector is None:
        pytest.skip("the MCP Inspector is not installed here (scripts/inspector-install.sh; needs node and npm)")
    server, state = shared.server, shared.state
    port = server.url.split(":")[2].split("/")[0]
    header = subprocess.run(
        [*server_command(), "mcp-token", "--port", port, "--header"],
        capture_output=True,
        text=True,
        env=server_env(state),
        check=True,
    ).stdout.strip()
    assert header == f"Authorization: Bearer {server.token}"
    base = [inspector, "--cli", server.url, "--transport", "http", "--method", "tools/list"]
    listed = subprocess.run([*base, "--header", header], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "copy_and_scan_logs" in {t["name"] for t in json.loads(listed.stdout)["tools"]}
    refused = subprocess.run(base, capture_output=True, text=True, timeout=120)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and ("401" in said or "invalid_token" in said), said


def test_install_http_registers_a_headers_helper_that_gets_in(shared: Shared, tmp_path: Path) -> None:
    server, state = shared.server, shared.state
    project = tmp_path / "project"
    project.mkdir()
    done = subprocess.run(
        [*server_command(), "install", "--dir", str(project), "--http", server.url, "--json"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    entry = json.loads((project / ".mcp.json").read_text())["mcpServers"]["axrl-spike-replay"]
    assert entry["type"] == "http" and entry["url"] == server.url
    assert server.token not in json.dumps(entry)  # the config holds a command, never the token
    # Claude Code runs headersHelper before it connects and sends the headers it prints
    printed = subprocess.run(
        shlex.split(entry["headersHelper"]), capture_output=True, text=True, env=server_env(state), check=True
    )
    headers = json.loads(printed.stdout)
    listed = with_http_client(server.url, lambda client: client.list_tools(), headers)
    assert len(listed.tools) > 10


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*server_command(), "mcp", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _token_file(
    tmp_path: Path, text: str = "a-token-of-enough-length-42\n", mode: int = 0o600, name: str = "token"
) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_given_token_file_is_the_token_and_no_other_file_is_made(workspace: Path, tmp_path: Path) -> None:
    token = _token_file(tmp_path)
    with http_server(workspace, tmp_path / "state", "--token-file", str(token)) as server:
        status, _, _ = raw_post(server.url, INITIALIZE, bearer("a-token-of-enough-length-42"))
        assert status == 200
        assert raw_post(server.url, INITIALIZE)[0] == 401
        assert not (tmp_path / "state").exists()
    assert token.exists()  # the user's file stays


def _bad_token_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    real = _token_file(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real)
    return {
        "readable by others": (_token_file(tmp_path, mode=0o644, name="open"), "other users"),
        "a symlink": (link, "symlink"),
        "empty": (_token_file(tmp_path, "", name="empty"), "empty"),
        "too short": (_token_file(tmp_path, "short\n", name="short"), "at least 16"),
        "too big": (_token_file(tmp_path, "x" * 5000, name="big"), "at most 1024"),
        "two words": (_token_file(tmp_path, "two words in one token file", name="words"), "visible ASCII"),
        "missing": (tmp_path / "nowhere", "no such file"),
    }


@pytest.mark.parametrize(
    "case", ["readable by others", "a symlink", "empty", "too short", "too big", "two words", "missing"]
)
def test_a_bad_token_file_is_refused_before_anything_listens(tmp_path: Path, case: str) -> None:
    path, says = _bad_token_files(tmp_path)[case]
    port = free_port()
    done = refused_start("--http", "--port", str(port), "--token-file", str(path))
    assert done.returncode == 2, done.stderr
    assert "--token-file" in done.stderr and says in done.stderr and "Traceback" not in done.stderr


def test_a_token_file_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to give a file to another user")
    path = _token_file(tmp_path)
    os.chown(path, 65534, 65534)
    done = refused_start("--http", "--port", str(free_port()), "--token-file", str(path))
    assert done.returncode == 2 and "another user" in done.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gpu-node-7"])
def test_no_auth_on_a_bind_that_is_not_loopback_is_refused(tmp_path: Path, host: str) -> None:
    done = refused_start("--http", "--host", host, "--port", str(free_port()), "--no-auth", env=server_env(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "--no-auth" in done.stderr and "loopback" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "axrl-spike-replay").exists()  # no token was made either


def test_no_auth_on_loopback_serves_and_says_loudly_what_it_allows(workspace: Path, tmp_path: Path) -> None:
    with http_server(workspace, tmp_path / "state", "--no-auth") as server:
        status, headers, _ = raw_post(server.url, INITIALIZE)
        assert status == 200 and "mcp-session-id" in {k.lower() for k in headers}
        assert not (tmp_path / "state").exists()
    said = server.stderr()
    assert "WARNING: --no-auth" in said and "ANY process of ANY user" in said


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--no-auth"], "options of HTTP"),
        (["--token-file", "t"], "options of HTTP"),
        (["--http", "--no-auth", "--token-file", "t"], "contradict"),
        (["--http", "--socket", "s"], "not both"),
    ],
)
def test_contradicting_options_are_refused(args: list[str], says: str) -> None:
    done = refused_start(*args)
    assert done.returncode == 2 and says in done.stderr


def test_loopback_is_what_only_this_machine_reaches() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "192.168.1.2", "localhost.evil.example", "gpu-1"]))


def test_the_http_entry_names_the_port_of_the_url_and_refuses_what_is_not_one() -> None:
    entry = http_entry("http://127.0.0.1:9000/mcp")
    assert entry["headersHelper"].endswith("mcp-token --port 9000")
    assert "--token-file /abs/t" in http_entry("http://127.0.0.1:9000/mcp", "/abs/t")["headersHelper"]
    for bad in ("ftp://x/mcp", "127.0.0.1:8765", "http://127.0.0.1:99999/mcp"):
        with pytest.raises(Exception, match="not an http:// URL"):
            http_entry(bad)


def test_a_second_server_on_a_busy_port_leaves_the_first_ones_token_alone(shared: Shared) -> None:
    server, state, workspace = shared.server, shared.state, shared.workspace
    token = server.token
    port = server.url.split(":")[2].split("/")[0]
    second = _start("--http", "--port", port, "--workspace", str(workspace), env=server_env(state))
    assert second.returncode == 2 and "Address already in use" in second.stderr
    assert server.token == token  # not replaced by a token of a server that never listened
    assert raw_post(server.url, INITIALIZE, bearer(token))[0] == 200
