"""Locate the data that ships with the package: jinja2 templates and agent skills."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_REPO_ROOT = _PACKAGE.parent.parent


def data_dir(name: str) -> Path:
    """`templates` or `skills`: inside the wheel (`_data/`), else the source checkout's top level."""
    for candidate in (_PACKAGE / "_data" / name, _REPO_ROOT / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"packaged data folder {name!r} not found next to {_PACKAGE}")


def templates_dir() -> Path:
    """Folder of the jinja2 templates (task file, method file, report)."""
    return data_dir("templates")


def skills_dir() -> Path:
    """Folder of the agent skills (one sub-folder per skill)."""
    return data_dir("skills")
