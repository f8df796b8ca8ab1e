"""Patch-based experiments: a unified diff applied in a temporary git worktree, never in the main checkout."""

from __future__ import annotations

import contextlib
import hashlib
import shlex
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.cleanup import run_to_completion
from axrl_spike_replay.remote.errors import RemoteError
from axrl_spike_replay.remote.job import Session


@dataclass(frozen=True)
class PatchedTree:
    """A detached worktree of the checkout at its HEAD, with the patch applied."""

    path: str  # where to run: the worktree's copy of the checkout dir given (a repo subdir stays a subdir)
    root: str  # the worktree's top level
    base_commit: str
    patch_sha256: str


def read_patch(patch: str | Path) -> tuple[bytes, str]:
    """(bytes, sha256) of a patch file; ConfigError when missing or empty."""
    path = Path(patch).expanduser()
    if not path.is_file():
        raise ConfigError(f"`patch` {path}: file not found", "patch")
    data = path.read_bytes()
    if not data.strip():
        raise ConfigError(f"`patch` {path}: the file is empty", "patch")
    return data, hashlib.sha256(data).hexdigest()


async def _git(session: Session, *args: str, what: str) -> str:
    got = await session.capture("git " + " ".join(shlex.quote(a) for a in args), timeout=300.0)
    if got.exit_status != 0:
        raise RemoteError(f"{session.label}: {what} failed: {(got.stderr or got.stdout).strip()}")
    return got.stdout


@contextlib.asynccontextmanager
async def patched_worktree(
    session: Session, checkout: str, patch: str | Path, progress: Callable[[str], None] | None = None
) -> AsyncIterator[PatchedTree]:
    """Yield a temporary worktree of `checkout` (on the session's machine) with `patch` applied.

    `git apply --check` runs first; the worktree and its temp dir are removed afterwards whether the
    work inside succeeded or not. The main checkout's files and index are never touched.
    """
    _, sha256 = read_patch(patch)
    top = (
        await _git(session, "-C", checkout, "rev-parse", "--show-toplevel", what=f"{checkout} as a git checkout")
    ).strip()
    prefix = (await _git(session, "-C", checkout, "rev-parse", "--show-prefix", what="git rev-parse")).strip()
    base = (await _git(session, "-C", checkout, "rev-parse", "HEAD", what=f"reading HEAD of {checkout}")).strip()
    dirty = await _git(session, "-C", checkout, "status", "--porcelain", "--untracked-files=no", what="git status")
    if dirty.strip() and progress is not None:
        progress(
            f"note: {checkout} has uncommitted changes; the patched worktree starts from HEAD {base[:12]} without them"
        )
    temp = await session.make_temp_dir("axrl-patch-")
    tree = f"{temp}/worktree"
    patch_path = f"{temp}/change.diff"
    try:
        local_patch = Path(patch).expanduser()
        await session.put(local_patch, patch_path)
        await _git(session, "-C", top, "worktree", "add", "--detach", tree, base, what="git worktree add")
        check = await session.capture(
            f"git -C {shlex.quote(tree)} apply --check {shlex.quote(patch_path)}", timeout=120.0
        )
        if check.exit_status != 0:
            raise ConfigError(
                f"`patch` {patch}: does not apply to {checkout} at {base[:12]} (git apply --check): "
                f"{(check.stderr or check.stdout).strip()}"
            )
        await _git(session, "-C", tree, "apply", patch_path, what="git apply")
        if progress is not None:
            progress(f"patch {sha256[:12]} applied in a temporary worktree {tree} (base {base[:12]})")
        yield PatchedTree(path=f"{tree}/{prefix}".rstrip("/"), root=tree, base_commit=base, patch_sha256=sha256)
    finally:
        await run_to_completion(_remove(session, top, tree, temp))


async def _remove(session: Session, top: str, tree: str, temp: str) -> None:
    """Remove the worktree (git's bookkeeping too) and its temp dir; errors are not fatal here."""
    with contextlib.suppress(Exception):
        await session.capture(f"git -C {shlex.quote(top)} worktree remove --force {shlex.quote(tree)}", timeout=120.0)
        await session.capture(f"git -C {shlex.quote(top)} worktree prune", timeout=120.0)
    with contextlib.suppress(Exception):
        await session.remove_temp_dir(temp)
