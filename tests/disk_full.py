"""A real full disk for a test: a Python script run inside a private mount namespace on a tiny tmpfs.

`unshare --user --map-root-user --mount` gives the child its own mount table without privileges (where the kernel
allows unprivileged user namespaces), so the tmpfs exists only for that process and vanishes with it; a write past
its size fails with ENOSPC from the kernel, as on a full shared filesystem. Where namespaces are not allowed the
test that needs one is skipped, naming why.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


@functools.cache
def _unshare_problem() -> str | None:
    """Why a private tmpfs cannot be mounted here, or None when it can."""
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return f"cannot mount a private tmpfs ({probe.stderr.strip() or probe.returncode})"
    return None


def run_on_full_disk(script: str, mount_point: Path, size_kib: int, *args: str, timeout_s: float = 300) -> Any:
    """Run `script` (Python; it prints one JSON document last) with a `size_kib` tmpfs mounted at `mount_point`;
    its JSON. Skips the test where a private tmpfs cannot be mounted."""
    problem = _unshare_problem()
    if problem is not None:
        pytest.skip(problem)
    mount_point.mkdir(parents=True, exist_ok=True)
    command = 'mount -t tmpfs -o size="$1"k tmpfs "$2" && shift 2 && exec "$@"'
    namespace = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command, "sh"]
    run = subprocess.run(
        [*namespace, str(size_kib), str(mount_point), sys.executable, "-c", script, str(mount_point), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
