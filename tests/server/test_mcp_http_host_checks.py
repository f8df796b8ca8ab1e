"""The Host and Origin checks (DNS rebinding) hold on every address `mcp --http` binds, not only on the three strings
the MCP SDK knows (127.0.0.1, localhost, ::1): a real server process on 127.0.0.2 and on [::1] without a token, and
raw HTTP requests naming another host or origin."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from http_helpers import INITIALIZE, http_server, raw_post


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host", ["127.0.0.2", "[::1]", "::1", "127.0.0.1"])
def test_a_request_naming_another_host_or_origin_is_refused_on_every_loopback_bind(
    workspace: Path, tmp_path: Path, host: str
) -> None:
    if ":" in host and not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    with http_server(workspace, tmp_path / "state", "--no-auth", host=host) as server:
        own = server.url.split("/")[2]  # host:port as the client's URL names it
        assert raw_post(server.url, INITIALIZE, {"Host": "evil.example"})[0] == 421
        assert raw_post(server.url, INITIALIZE, {"Host": f"evil.example:{own.rsplit(':', 1)[1]}"})[0] == 421
        assert raw_post(server.url, INITIALIZE, {"Origin": "http://evil.example"})[0] == 403
        status, headers, _ = raw_post(server.url, INITIALIZE, {"Origin": f"http://{own}"})
        assert status == 200 and "mcp-session-id" in {k.lower() for k in headers}
    said = server.stderr()
    assert f"MCP server (streamable HTTP) at {server.url}" in said
    assert "[[" not in said


def test_the_names_of_each_bind() -> None:
    from axrl_spike_replay.mcp_faces.http_transport.http_access import bound_names, bound_security, url_host

    assert bound_names("127.0.0.2") == ["127.0.0.2"]
    assert bound_names("127.0.0.1") == ["127.0.0.1", "localhost"]
    assert bound_names("[::1]") == bound_names("::1") == ["[::1]", "localhost"]
    assert bound_names("LOCALHOST") == ["localhost", "127.0.0.1"]
    wildcard = bound_names("0.0.0.0")
    assert {"localhost", "127.0.0.1", socket.gethostname().lower()} <= set(wildcard)
    assert "evil.example" not in wildcard
    assert url_host("::1") == url_host("[::1]") == "[::1]" and url_host("10.0.0.1") == "10.0.0.1"
    security = bound_security("127.0.0.2", 8765)
    assert security.enable_dns_rebinding_protection
    assert security.allowed_hosts == ["127.0.0.2:8765"] and security.allowed_origins == ["http://127.0.0.2:8765"]
