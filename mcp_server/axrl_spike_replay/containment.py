"""Staying inside a tree: no symlink is followed out of the directory being read or written."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


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
