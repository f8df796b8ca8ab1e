"""Where `preserve` puts its copies: under the output root, or in the workspace when the output root is not
writable or the user asks for no writes there; and whether the bytes a copy needs fit there.

Under the output root a copy is hardlinks (`checkpoints/spike_snapshots-active/`). In the workspace
(`<workspace>/preserved-snapshots/<output dir name>/`) it is hardlinks where the filesystem allows (same
filesystem, and the kernel lets this user link files it may not own), real copies otherwise. Before anything is
written, the bytes that must be copied (every file, when the target is on another filesystem) are held to the
target's free space; each copy made where a link failed checks its own file again before writing.

Writability is asked of the filesystem honestly (`os.access` on the dir a copy would be made in, or its nearest
existing parent). A superuser passes that check wherever the filesystem is mounted writable, even in a dir
without write bits: to keep a root-owned job from writing into a shared output root, ask for no writes there.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, WORKSPACE_PRESERVED


@dataclass(frozen=True)
class PreserveTarget:
    """The dir copies go into; `in_workspace` with the reason (no writes asked for, or an unwritable output root)."""

    root: Path
    in_workspace: bool = False
    reason: str = ""


def writable(path: Path) -> bool:
    """Whether this process may create entries in `path`, or, where it does not exist yet, in its nearest
    existing parent (os.access: the kernel's answer for this user, superuser included)."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    return probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def preserve_target(output_dir: Path, workspace: Path | None, no_writes: bool) -> PreserveTarget:
    """Where `preserve` writes for `output_dir`: in `workspace` when `no_writes` or when the output root's
    preserved dir cannot be written; AxrlError when that is needed and no workspace is given."""
    under_root = output_dir / PRESERVED_DIR
    if no_writes:
        reason = "no writes under the output root were asked for"
    elif not writable(under_root):
        reason = f"{under_root} is not writable by this user"
    else:
        return PreserveTarget(under_root)
    if workspace is None:
        raise AxrlError(f"{reason}; name a workspace to preserve into instead (nothing was preserved)")
    return PreserveTarget(Path(os.path.abspath(workspace)) / WORKSPACE_PRESERVED / output_dir.name, True, reason)


def same_filesystem(source: Path, target_root: Path) -> bool:
    """Whether a file of `source` can be hardlinked under `target_root` as far as devices go (the nearest
    existing parent of `target_root` stands for it)."""
    probe = target_root
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return os.stat(source).st_dev == os.stat(probe).st_dev


def free_bytes(path: Path) -> int:
    """Free bytes for this user on the filesystem of `path` (or of its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_space(needed: int, target: Path, what: str) -> None:
    """OSError(ENOSPC) naming `what`, the bytes needed and those free, unless `needed` bytes fit under `target`."""
    free = free_bytes(target)
    if needed > free:
        raise OSError(errno.ENOSPC, f"{what} needs {needed} bytes but {free} are free there", str(target))
