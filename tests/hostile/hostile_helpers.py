"""Hostile-input helpers: a fresh copy of the golden job per example, a workspace, a tree that must stay untouched."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

FIXTURE_JOB = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
SNAPSHOT_NAME = "iter_0000021"
MAX_MESSAGE = 4000  # an error names what is wrong in a few lines; it never echoes an unbounded value


def address_space() -> int:
    """This process's virtual memory size in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@dataclass
class Scene:
    """One example's world: the job's output dir, its snapshot, a workspace and an outside tree."""

    root: Path
    output_dir: Path
    snapshot: Path
    workspace: Path
    outside: Path

    def outside_digest(self) -> str:
        """A digest of every name, link target and byte under the outside tree (and the tree itself)."""
        digest = hashlib.sha256()
        for dirpath, dirnames, filenames in os.walk(self.outside):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath) / name
                digest.update(str(path.relative_to(self.outside)).encode())
                digest.update(path.read_bytes())
        return digest.hexdigest()


@contextmanager
def scene() -> Iterator[Scene]:
    """A fresh copy of the golden job, a workspace with a symlink leading out, and a precious outside tree."""
    with tempfile.TemporaryDirectory(prefix="axrl-hostile-") as tmp:
        root = Path(tmp)
        output_dir = root / "outputs" / FIXTURE_JOB.name
        shutil.copytree(FIXTURE_JOB, output_dir)
        outside = root / "outside"
        outside.mkdir()
        (outside / "precious.txt").write_text("must never change\n")
        workspace = root / "ws"
        workspace.mkdir()
        snapshot = output_dir / "checkpoints" / "spike_snapshots" / SNAPSHOT_NAME
        yield Scene(root, output_dir, snapshot, workspace, outside)


@dataclass
class Outcome:
    code: int
    out: str
    err: str


def run_cli(*argv: object) -> Outcome:
    """`axrl-spike-replay ARGV` in this process; any exception other than SystemExit fails the test (a traceback)."""
    from axrl_spike_replay.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse: a usage error is status 2 with its message
            code = int(exc.code or 0)
    return Outcome(code, out.getvalue(), err.getvalue())


def assert_clear_refusal_or_success(outcome: Outcome, *names: str) -> None:
    """Status 0; or 2 (refused) / 1 (partly done) with a bounded, printable message naming one of `names`.

    A refusal speaks on stderr; a partly-done verb with --json may list what it refused in its document.
    Never a traceback, never a raw terminal escape.
    """
    assert "Traceback" not in outcome.err, outcome.err[-3000:]
    assert outcome.code in (0, 1, 2), (outcome.code, outcome.err[-2000:])
    assert "\x1b" not in outcome.err and "\x1b" not in outcome.out, "terminal escape printed raw"
    if outcome.code != 0:
        said = outcome.err if outcome.code == 2 else outcome.err + outcome.out
        assert said.strip(), "refused without a message"
        assert len(outcome.err) <= MAX_MESSAGE, f"message of {len(outcome.err)} characters"
        if names:
            assert any(name in said for name in names), (names, said[-2000:])
