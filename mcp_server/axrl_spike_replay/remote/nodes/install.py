"""Install this package on a node: build a wheel here, copy it over SFTP, `pip install --no-deps` it there.

GPU nodes often have no internet and already have torch, so nothing else is installed and pip never
looks at an index.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.transport.job import Session
from axrl_spike_replay.remote.transport.remote_errors import RemoteError
from axrl_spike_replay.remote.transport.shell import bash_command

DIST_NAME = "axrl-spike-replay"


@dataclass(frozen=True)
class InstallReport:
    """What was installed where."""

    wheel: str
    python: str
    installed_version: str


def source_root() -> Path:
    """The source checkout this package runs from (the folder with its pyproject.toml)."""
    import axrl_spike_replay

    root = Path(axrl_spike_replay.__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or f'name = "{DIST_NAME}"' not in pyproject.read_text(encoding="utf-8"):
        raise ConfigError(
            f"cannot build a wheel: this installation is not a source checkout ({root} has no {DIST_NAME} "
            "pyproject.toml); pass a wheel file instead"
        )
    return root


def build_wheel(out_dir: Path) -> Path:
    """Build this package's wheel into `out_dir` (`pip wheel --no-deps`, no build isolation, no index)."""
    root = source_root()
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out_dir)]
    done = subprocess.run([*command, str(root)], capture_output=True, text=True)
    wheels = sorted(out_dir.glob("axrl_spike_replay-*.whl"))
    if done.returncode != 0 or not wheels:
        raise ConfigError(f"building the wheel failed ({shlex.join(command)}): {(done.stderr or done.stdout)[-800:]}")
    return wheels[-1]


async def install_package(
    session: Session,
    python: str,
    *,
    setup: Sequence[str] = (),
    wheel: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> InstallReport:
    """Copy a wheel (built here unless given) to the node and install it into `python`'s environment."""
    with tempfile.TemporaryDirectory(prefix="axrl-wheel-") as tmp:
        local = Path(wheel).expanduser() if wheel else build_wheel(Path(tmp))
        if not local.is_file():
            raise ConfigError(f"wheel {local} not found")
        if progress is not None:
            progress(f"copying {local.name} to {session.label}")
        remote_dir = await session.make_temp_dir("axrl-wheel-")
        try:
            remote_wheel = f"{remote_dir}/{local.name}"
            await session.put(local, remote_wheel)
            pip = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", remote_wheel]
            check = [python, "-c", "import axrl_spike_replay as a; print(a.__version__)"]
            script = "\n".join([*setup, shlex.join(pip) + " 2>&1 || exit $?", shlex.join(check)]) + "\n"
            got = await session.capture(bash_command(script), timeout=600.0)
        finally:
            await session.remove_temp_dir(remote_dir)
    if got.exit_status != 0:
        raise RemoteError(
            f"{session.label}: pip install into {python} failed (exit {got.exit_status}): "
            f"{(got.stdout + got.stderr).strip()[-800:]}"
        )
    version = got.stdout.strip().splitlines()[-1] if got.stdout.strip() else "?"
    return InstallReport(wheel=local.name, python=python, installed_version=version)
