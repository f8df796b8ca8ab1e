"""The arrows point down: the replay engine imports no orchestration, remote, workspace or analysis code, the
snapshot layer only the ground modules, and the library never imports its faces. Checked on the source (every
import, including those inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mcp_server" / "axrl_spike_replay"
FACES = ("cli", "mcp_faces", "server", "__main__")
ABOVE_THE_ENGINE = ("workspace", "remote", "investigation", "analysis", *FACES)
GROUND = (
    "errors", "vocabulary", "jsonable", "atomic", "display", "untrusted_bytes", "untrusted_json", "untrusted_yaml",
    "containment", "locks", "resources", "rank_processes", "temp_janitor", "percent",
)  # fmt: skip
# The log line reader: plain text parsing over the ground modules (checked below), used by snapshot.log_point to
# check a snapshot against its training log. The one module above the snapshot layer that it and replay/ import.
LOG_TEXT_READER = (
    "analysis.log_reader", "analysis.log_lines", "analysis.log_series", "analysis.log_values", "analysis.log_columns",
    "analysis.log_blocks", "analysis.log_kv",
)  # fmt: skip


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
                found.setdefault(parts[1], getattr(node, "lineno", 0))
    return found


def imported_modules(path: Path) -> dict[str, int]:
    """{module path under axrl_spike_replay (`snapshot.layout`): line} for every import of this package."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "axrl_spike_replay" and len(parts) > 1:
                found.setdefault(".".join(parts[1:]), node.lineno)
    return found


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return name.split(".")[0] in packages or name in LOG_TEXT_READER


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
    wrong -= {f"analysis (line {line})" for name, line in imported_modules(module).items() if name in LOG_TEXT_READER}
    assert not wrong, f"{module.relative_to(PACKAGE)} imports {sorted(wrong)}: replay/ is the pure engine"


@pytest.mark.parametrize("module", modules("models", "training"), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_models_and_the_training_math_import_nothing_from_the_engine_or_above(module: Path) -> None:
    found = imported_packages(module)
    above = ("replay", *ABOVE_THE_ENGINE, "<relative>")
    wrong = {f"{pkg} (line {line})" for pkg, line in found.items() if pkg in above}
    assert not wrong, f"{module.relative_to(PACKAGE)} imports {sorted(wrong)}: models/ and training/ sit below replay/"


@pytest.mark.parametrize("module", modules("snapshot"), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_snapshot_layer_imports_only_itself_the_ground_and_the_log_text_reader(module: Path) -> None:
    found = imported_modules(module)
    wrong = {f"{n} (line {line})" for n, line in found.items() if not _within(n, ("snapshot", *GROUND))}
    assert not wrong, f"{module.relative_to(PACKAGE)} imports {sorted(wrong)}: snapshot/ sits on the ground modules"


@pytest.mark.parametrize("name", LOG_TEXT_READER)
def test_the_log_text_reader_rests_on_the_ground_modules_alone(name: str) -> None:
    module = PACKAGE / (name.replace(".", "/") + ".py")
    found = imported_modules(module)
    wrong = {f"{n} (line {line})" for n, line in found.items() if not _within(n, GROUND)}
    assert not wrong, f"{name} imports {sorted(wrong)}: snapshot/ and replay/ may only use it while it stays plain"


@pytest.mark.parametrize("module", library_modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_library_never_imports_its_faces(module: Path) -> None:
    found = imported_packages(module)
    wrong = {f"{pkg} (line {line})" for pkg, line in found.items() if pkg in FACES}
    assert not wrong, f"{module.relative_to(PACKAGE)} imports the faces {sorted(wrong)}"


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from axrl_spike_replay.workspace.task_log import record_replay\n")
    assert imported_packages(module) == {"workspace": 2}
    assert imported_modules(module) == {"workspace.task_log": 2}
