"""Staying inside a tree: no symlink is followed out of the directory being read or written."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from axrl_spike_replay.display import shown
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError


def resolved_text(path: str | os.PathLike[str]) -> str:
    """Where `path` leads with every symlink resolved, for messages ("a symlink loop" when it never ends)."""
    try:
        return str(Path(path).resolve())
    except (OSError, RuntimeError):  # RuntimeError: pathlib's "Symlink loop" (Python < 3.13)
        return "a symlink loop"


def is_inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """True when `path` (existing or not), with every symlink resolved, lies inside `root` (also resolved).

    A symlink loop on the way counts as leaving: it is never followed.
    """
    try:
        resolved_root = Path(root).resolve()
        resolved = Path(path).resolve()
    except (OSError, RuntimeError):  # RuntimeError: pathlib's "Symlink loop" (Python < 3.13)
        return False
    return resolved == resolved_root or resolved_root in resolved.parents


def inside_of(root: str | os.PathLike[str]) -> Callable[[str | os.PathLike[str]], bool]:
    """`is_inside(path, root)` for many paths under one root: the root is resolved once, not per path."""
    try:
        resolved_root = Path(root).resolve()
    except (OSError, RuntimeError):
        return lambda _path: False

    def inside(path: str | os.PathLike[str]) -> bool:
        try:
            resolved = Path(path).resolve()
        except (OSError, RuntimeError):
            return False
        return resolved == resolved_root or resolved_root in resolved.parents

    return inside


def link_leaving(entry: str | os.PathLike[str], root: str | os.PathLike[str]) -> str | None:
    """Why `entry` must be skipped when walking `root` (a symlink whose target is outside it), else None."""
    candidate = Path(entry)
    if candidate.is_symlink() and not is_inside(candidate, root):
        return f"is a symlink to {os.readlink(candidate)!s}, outside {root}"
    return None


# In a private directory of links this tool made into another tree (a legacy snapshot's replay dir on another
# filesystem, where hardlinks cannot be made), a symlink of this name leads to that tree.
LINKS_INTO = ".axrl_links_into"


def file_inside(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Path:
    """The file `path` names with every symlink resolved, when it lies inside `root` (by default the directory
    `path` is in); UntrustedInputError saying where it leads otherwise. A link between the tree's own files is
    followed; one out of it is refused, however many links lead there. The one exception is a directory of links
    this user made into another tree (`link_into`): its links may lead into that tree, and nowhere else.

    The caller opens the returned path: the check and the open see the same file unless the tree changes between
    them. A missing file passes (the caller's open says it is missing)."""
    candidate = Path(path)
    tree = Path(root) if root is not None else candidate.parent
    try:
        resolved = candidate.resolve()
        tree_resolved = tree.resolve()
    except (OSError, RuntimeError):  # RuntimeError: pathlib's "Symlink loop" (Python < 3.13)
        raise UntrustedInputError("is a symlink loop; refused") from None
    if tree_resolved in resolved.parents:
        return resolved
    linked = linked_tree(tree)
    if linked is not None and linked in resolved.parents:
        return resolved
    return _refuse_leaving(resolved, tree)


def _refuse_leaving(resolved: Path, tree: Path) -> NoReturn:
    raise UntrustedInputError(
        f"leads to {shown(str(resolved), 160, quote=False)}, outside {shown(str(tree), 160, quote=False)}; a "
        "symlink out of the tree being read is never followed"
    )


def link_into(directory: Path, tree: Path) -> None:
    """Mark `directory` (private, made by this user) as links into `tree`, for `file_inside`."""
    os.symlink(tree.resolve(), directory / LINKS_INTO)


def linked_tree(directory: str | os.PathLike[str]) -> Path | None:
    """The tree a directory of links leads into (`link_into`), or None. Trusted only where nobody else could have
    made the mark: the directory is this user's and private (no group or other access), the mark is this user's
    symlink."""
    where = Path(directory)
    try:
        info, mark = os.lstat(where), os.lstat(where / LINKS_INTO)
    except OSError:
        return None
    uid = os.geteuid()
    if not (stat.S_ISDIR(info.st_mode) and stat.S_ISLNK(mark.st_mode)):
        return None
    if info.st_uid != uid or mark.st_uid != uid or info.st_mode & 0o077:
        return None
    try:
        return (where / LINKS_INTO).resolve(strict=True)
    except (OSError, RuntimeError):
        return None
