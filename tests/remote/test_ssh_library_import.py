"""Every SSH or Slurm path starts by importing asyncssh; that import prints nothing of cryptography's DSA deprecation
(asyncssh's own type hints trigger it), and no other warning is hidden by it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DSA = "DSA is deprecated"


def _stderr_of(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO / "mcp_server"), "PYTHONWARNINGS": "default"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stderr


def test_the_ssh_modules_import_asyncssh_without_the_dsa_warnings() -> None:
    plain = _stderr_of("import asyncssh")
    assert plain.count(DSA) >= 1  # this asyncssh and cryptography do warn when imported plainly
    quiet = _stderr_of(
        "import axrl_spike_replay.remote.transport.host_keys, axrl_spike_replay.remote.transport.connect, "
        "axrl_spike_replay.remote.transport.session, axrl_spike_replay.remote.launchers.slurm_launch"
    )
    assert DSA not in quiet and quiet == ""


def test_other_warnings_still_show_after_the_quiet_import() -> None:
    code = (
        "import warnings, axrl_spike_replay.remote.transport.session\n"
        "from cryptography.utils import CryptographyDeprecationWarning\n"
        "warnings.warn('DSA is deprecated elsewhere', CryptographyDeprecationWarning)\n"
        "warnings.warn('another warning', UserWarning)\n"
    )
    err = _stderr_of(code)
    assert "DSA is deprecated elsewhere" in err and "another warning" in err
