"""Patch-based experiments: unified diffs applied in a temporary git worktree, never in the main checkout.

A patch set (`--patch A.diff --patch B.diff`) is applied in order in one worktree; its identity is the
sha256 of the patches' bytes concatenated in that order (for one patch: the file's own sha256), and
`patch_set_text` is that concatenation, kept beside the result so a method file can quote it.
"""

from __future__ import annotations

import contextlib
import hashlib
import shlex
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.transport.cleanup import run_to_completion
from axrl_spike_replay.remote.transport.job import Session
from axrl_spike_replay.remote.transport.remote_errors import RemoteError


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


PatchSet = str | Path | Sequence[str | Path]


def patch_list(patches: PatchSet | None) -> list[Path]:
    """The patches of a set as paths, in order (one path, a sequence of them, or none)."""
    if patches is None:
        return []
    if isinstance(patches, (str, Path)):
        return [Path(patches).expanduser()]
    return [Path(p).expanduser() for p in patches]


def patch_set_text(patches: PatchSet) -> tuple[bytes, str]:
    """(the patches' bytes concatenated in order, their sha256); ConfigError naming a missing or empty one."""
    data = b"".join(read_patch(p)[0] for p in patch_list(patches))
    return data, hashlib.sha256(data).hexdigest()


async def _git(session: Session, *args: str, what: str) -> str:
    got = await session.capture("git " + " ".join(shlex.quote(a) for a in args), timeout=300.0)
    if got.exit_status != 0:
        raise RemoteError(f"{session.label}: {what} failed: {(got.stderr or got.stdout).strip()}")
    return got.stdout


@contextlib.asynccontextmanager
async def patched_worktree(
    session: Session, checkout: str, patch: PatchSet, progress: Callable[[str], None] | None = None
) -> AsyncIterator[PatchedTree]:
    """Yield a temporary worktree of `checkout` (on the session's machine) with `patch` (one or a set) applied.

    Each patch in order: `git apply --check` on top of the ones before it, then `git apply`. One that does
    not apply is a ConfigError naming it; nothing runs then, and the worktree (with whatever was applied
    in it) and its temp dir are removed, as they are afterwards whether the work inside succeeded or not.
    The main checkout's files and index are never touched.
    """
    patches = patch_list(patch)
    _, sha256 = patch_set_text(patches)
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
    try:
        await _git(session, "-C", top, "worktree", "add", "--detach", tree, base, what="git worktree add")
        for number, local_patch in enumerate(patches, 1):
            patch_path = f"{temp}/change-{number}.diff"
            await session.put(local_patch, patch_path)
            check = await session.capture(
                f"git -C {shlex.quote(tree)} apply --check {shlex.quote(patch_path)}", timeout=120.0
            )
            if check.exit_status != 0:
                after = f" after {', '.join(str(p) for p in patches[: number - 1])}" if number > 1 else ""
                which = f" (patch {number} of {len(patches)})" if len(patches) > 1 else ""
                raise ConfigError(
                    f"`patch` {local_patch}{which}: does not apply to {checkout} at {base[:12]}{after} "
                    f"(git apply --check); nothing was run: {(check.stderr or check.stdout).strip()}",
                    "patch",
                )
            await _git(session, "-C", tree, "apply", patch_path, what="git apply")
        if progress is not None:
            what = f"patch {sha256[:12]}" if len(patches) == 1 else f"patch set {sha256[:12]} ({len(patches)} patches)"
            progress(f"{what} applied in a temporary worktree {tree} (base {base[:12]})")
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
