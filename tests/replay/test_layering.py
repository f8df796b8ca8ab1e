"""The arrows point down: the replay engine imports no orchestration, remote or workspace code, and the
library never imports its faces. Checked on the source (every import, including those inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mcp_server" / "axrl_spike_replay"
FACES = ("cli", "mcp_faces", "server", "__main__")
ABOVE_THE_ENGINE = ("workspace", "remote", "investigation", *FACES)


def imported_packages(path: Path) -> dict[str, int]:
    """{first package under axrl_spike_replay: line} for every import of this package in a module."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names = ["axrl_spike_replay.<relative>"]  # relative imports are not used here; refuse them below
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "axrl_spike_replay" and len(parts) > 1:
                found.setdefault(parts[1], node.lineno)
    return found


def modules(*under: str) -> list[Path]:
    return sorted(p for sub in under for p in (PACKAGE / sub).rglob("*.py"))


def library_modules() -> list[Path]:
    return [
        p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0].removesuffix(".py") not in FACES
    ]


@pytest.mark.parametrize("module", modules("replay"), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_replay_engine_imports_nothing_above_it(module: Path) -> None:
    found = imported_packages(module)
    wrong = {f"{pkg} (line {line})" for pkg, line in found.items() if pkg in (*ABOVE_THE_ENGINE, "<relative>")}
    assert not wrong, f"{module.relative_to(PACKAGE)} imports {sorted(wrong)}: replay/ is the pure engine"


@pytest.mark.parametrize("module", library_modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_library_never_imports_its_faces(module: Path) -> None:
    found = imported_packages(module)
    wrong = {f"{pkg} (line {line})" for pkg, line in found.items() if pkg in FACES}
    assert not wrong, f"{module.relative_to(PACKAGE)} imports the faces {sorted(wrong)}"


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from axrl_spike_replay.workspace.task_log import record_replay\n")
    assert imported_packages(module) == {"workspace": 2}
