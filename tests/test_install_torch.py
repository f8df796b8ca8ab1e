"""scripts/install-torch.sh, as setup.sh runs it on a fresh machine: the CPU build from PyTorch's own index where no
NVIDIA GPU is, PyPI when that index cannot be reached or a GPU is there, and a line on stderr saying which.

pip itself is replaced by a recorder (a real install is a 200 MB download); the index is a real HTTP server on
loopback, the unreachable one a closed port, and the GPU a real `nvidia-smi` on PATH or a device file."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install-torch.sh"


@pytest.fixture
def venv_python(tmp_path: Path) -> tuple[Path, Path]:
    """A venv python whose `-m pip` only records its arguments (one line per call); the rest is the real python."""
    log = tmp_path / "pip-calls.txt"
    fake = tmp_path / "venv-python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = -m ] && [ "$2" = pip ]; then echo "${{@:3}}" >> {log}; exit 0; fi\n'
        'if [ "$1" = -c ]; then echo 2.13.0+cpu; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    fake.chmod(0o755)
    return fake, log


@pytest.fixture
def cpu_index(tmp_path: Path) -> Iterator[str]:
    """A wheel index on loopback that answers for torch."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<html></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: Quiet(*a, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _install(tmp_path: Path, python: Path, index: str, gpu: bool = False) -> subprocess.CompletedProcess[str]:
    bin_dir, dev = tmp_path / "bin", tmp_path / "dev"
    bin_dir.mkdir(exist_ok=True)
    dev.mkdir(exist_ok=True)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "AXRL_TORCH_CPU_INDEX": index, "AXRL_DEV_DIR": str(dev)}
    return subprocess.run(["bash", str(SCRIPT), str(python)], env=env, capture_output=True, text=True, timeout=60)


def test_without_a_gpu_torch_comes_from_pytorchs_cpu_index(
    tmp_path: Path, venv_python: tuple[Path, Path], cpu_index: str
) -> None:
    python, log = venv_python
    run = _install(tmp_path, python, cpu_index)
    assert run.returncode == 0, run.stderr
    assert log.read_text().split() == ["install", "-q", "--index-url", cpu_index, "torch==2.13.0"]
    said = " ".join(run.stderr.split())
    assert f"no NVIDIA GPU here: installing torch==2.13.0, the CPU build (~200 MB), from PyTorch's CPU wheel index {cpu_index}" in said  # noqa: E501
    assert "setup: installed torch 2.13.0+cpu" in run.stderr


def test_when_that_index_cannot_be_reached_it_falls_back_to_pypi_and_says_so(
    tmp_path: Path, venv_python: tuple[Path, Path]
) -> None:
    python, log = venv_python
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    run = _install(tmp_path, python, index)
    assert run.returncode == 0, run.stderr
    assert log.read_text().split() == ["install", "-q", "torch==2.13.0"]
    assert f"PyTorch's CPU wheel index {index} cannot be reached within 5 s (URLError:" in run.stderr
    assert "installing torch==2.13.0 from the configured index instead" in run.stderr


def test_with_an_nvidia_gpu_torch_comes_from_pypi(
    tmp_path: Path, venv_python: tuple[Path, Path], cpu_index: str
) -> None:
    python, log = venv_python
    run = _install(tmp_path, python, cpu_index, gpu=True)
    assert run.returncode == 0, run.stderr
    assert log.read_text().split() == ["install", "-q", "torch==2.13.0"]
    assert "an NVIDIA GPU is here (nvidia-smi is installed)" in run.stderr


def test_a_gpu_device_file_counts_as_a_gpu(tmp_path: Path, venv_python: tuple[Path, Path], cpu_index: str) -> None:
    python, log = venv_python
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()
    run = _install(tmp_path, python, cpu_index)
    assert log.read_text().split() == ["install", "-q", "torch==2.13.0"]
    assert f"an NVIDIA GPU is here ({tmp_path / 'dev' / 'nvidia0'} exists)" in run.stderr


def test_setup_installs_torch_through_it() -> None:
    setup = (SCRIPT.parent / "setup.sh").read_text()
    assert 'scripts/install-torch.sh "$VENV/bin/python"' in setup and 'pip install -q "torch==' not in setup
