"""A log only its owner may read stays that way when copy_and_scan_logs copies it into the workspace: over stdio and
over HTTP (real server processes, real clients), whatever the umask would give a new file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from http_helpers import bearer, http_server, with_http_client
from mcp import StdioServerParameters
from server_helpers import JOB, SpikeOutputs, ok, server_command, with_client

from axrl_spike_replay.files.atomic import current_umask


def _copy(workspace: Path) -> Path:
    return workspace / "tmp" / "spike-replay" / JOB / "logs" / "train.log"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_private_log_copied_over_stdio_stays_private(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    spike_outputs.log.chmod(0o600)
    cmd = server_command()
    params = StdioServerParameters(command=cmd[0], args=[*cmd[1:], "mcp", "--workspace", str(workspace)])
    arguments = {"logs": [str(spike_outputs.log)], "job": JOB, "plot": False}
    scan = ok(with_client(params, lambda client: client.call_tool("copy_and_scan_logs", arguments)))
    assert scan["copied"] == [str(_copy(workspace))]
    assert _mode(_copy(workspace)) == 0o600  # before: 0666 less the umask (0644), readable by every user

    # a copy made earlier, readable by all, is replaced by a private one once the log is private
    spike_outputs.log.chmod(0o640)
    ok(with_client(params, lambda client: client.call_tool("copy_and_scan_logs", arguments)))
    assert _mode(_copy(workspace)) == 0o640 & ~current_umask()  # the server inherits this process's umask


def test_a_private_log_copied_over_http_stays_private(
    spike_outputs: SpikeOutputs, workspace: Path, tmp_path: Path
) -> None:
    spike_outputs.log.chmod(0o600)
    arguments = {"logs": [str(spike_outputs.log)], "job": JOB, "plot": False}
    with http_server(workspace, tmp_path / "state") as server:
        result = with_http_client(
            server.url, lambda client: client.call_tool("copy_and_scan_logs", arguments), bearer(server.token)
        )
    assert ok(result)["copied"] == [str(_copy(workspace))]
    assert _mode(_copy(workspace)) == 0o600
