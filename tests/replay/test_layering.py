"""The arrows point down: every module imports only its own package, or packages on the floors below its own,
and no two modules import each other, however far round. Checked on the source (every import, including those
inside functions and under TYPE_CHECKING), against the floors README's layout table and the design brief list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mcp_server" / "axrl_spike_replay"
FACES = ("cli", "mcp_faces", "server", "__main__")
GROUND = ("errors", "vocabulary", "jsonable", "display", "package_data", "names", "percent")
# Top floor first. A module may import its own package and anything on a lower floor; on a floor of several
# packages, none imports another (diagnosis never imports workspace, remote never imports the record). On the
# floors marked FLAT the modules are single files that may import each other (still without a circle).
FLOORS: tuple[tuple[str, ...], ...] = (
    FACES,
    ("demo", "agent_install", "skill_pack"),  # beside the faces: the whole procedure, installing the skills
    ("investigation",),  # orchestration: run a request here or elsewhere, open a task with its diagnosis
    ("diagnosis", "remote", "workspace"),
    ("testing", "integrations"),  # test support recording snapshots; hooks in trainers we did not write
    ("replay", "capture"),
    ("experiment",),  # what engine, remote, record and diagnosis share: mitigations, results, verdicts, run dirs
    ("training",),
    ("analysis", "models"),
    ("snapshot",),
    ("logs",),
    ("processes",),  # rank processes: where they come from, one per rank, the worker's half of the launch contract
    ("files", "untrusted"),  # files written safely; reading what we did not write
    GROUND,
)
FLAT = (FACES, FLOORS[1], GROUND)
# Inside a package split by idea, the same rule one level down: a module imports its own subpackage and the parts
# on the floors below its own (the verbs on a node, then the workspace file that names nodes, launches and the
# command, then the launchers and the command backend side by side, then what a node has, then the transport).
SUBFLOORS: dict[str, tuple[tuple[str, ...], ...]] = {
    "remote": (
        ("node", "remote_replay"),
        ("workspace_config",),
        ("launchers", "command"),
        ("nodes",),
        ("transport",),
    ),
    # the diagnosis as the task keeps it, the verb, then the experiments it suggests, then the causes' rules, then
    # what the evidence shows and the families' names
    "diagnosis": (
        ("task_entry",),
        ("diagnose",),
        ("suggestions",),
        ("rules",),
        ("evidence", "families"),
    ),
    # the read-only analyses of a step (attribution, diagnose's model evidence), the sweep, the engine, its plan,
    # Megatron's route and the experiments the snapshot refuses, the streamed replay, running a job's processes, one
    # process's work, then what it reads
    "replay": (
        ("analyses",),
        ("sweep",),
        ("engine",),
        ("plans", "megatron_route", "refusals"),
        ("streamed",),
        ("jobs",),
        ("compute",),
        ("reading",),
    ),
    # the run dir, then the results it holds, then what they are made of: verdicts, figure names, the step's evidence,
    # and the mitigations; and the replay request, each field declared once
    "experiment": (
        ("run_dir",),
        ("result",),
        ("verdict", "figure_names", "step_evidence", "mitigation", "request"),
    ),
    # the report, then the method files and the trainer advice, then the task record, then paths and rendering
    "workspace": (
        ("report",),
        ("method_files", "trainer_advice"),
        ("task_record",),
        ("paths", "render"),
    ),
}


def imported_modules(path: Path) -> dict[str, int]:
    """{module path under axrl_spike_replay (`snapshot.layout`): line} for every import of this package; a name
    imported from a package (`from axrl_spike_replay.diagnosis.rules import causes`) counts as its module."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            found.setdefault("<relative>", node.lineno)  # relative imports are not used here; refused below
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "axrl_spike_replay" or len(parts) < 2:
                continue
            module = ".".join(parts[1:])
            if _is_module(module):
                found.setdefault(module, node.lineno)
    return found


def _is_module(module: str) -> bool:
    path = PACKAGE / module.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def floor_of(module: str) -> int:
    top = module.split(".")[0]
    for number, packages in enumerate(FLOORS):
        if top in packages:
            return number
    raise AssertionError(f"{module}: its package {top!r} is on no floor; add it to FLOORS (and to the README's table)")


@pytest.mark.parametrize("module", library_modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_every_import_points_down(module: Path) -> None:
    name = module_name(module)
    if name == "":
        return  # the package's own __init__ (its version)
    own_top, own_floor = name.split(".")[0], floor_of(name)
    wrong = []
    for target, line in imported_modules(module).items():
        if target == "<relative>":
            wrong.append(f"a relative import (line {line})")
            continue
        top, floor = target.split(".")[0], floor_of(target)
        if top == own_top or floor > own_floor or (floor == own_floor and FLOORS[floor] in FLAT):
            continue
        wrong.append(f"{target} (line {line}, floor {floor} {'/'.join(FLOORS[floor])})")
    assert not wrong, f"{name} (floor {own_floor} {'/'.join(FLOORS[own_floor])}) imports upward or sideways: {wrong}"


def _part(module: str) -> str:
    """The part of its package a module belongs to: `launchers` for `remote.launchers.launch_job`."""
    return module.split(".")[1]


def test_every_package_split_by_idea_has_each_part_on_a_floor() -> None:
    for package, floors in SUBFLOORS.items():
        parts = {p.name.removesuffix(".py") for p in (PACKAGE / package).iterdir() if p.suffix == ".py" or p.is_dir()}
        parts -= {"__init__", "__pycache__"}
        on_floors = {name for floor in floors for name in floor}
        assert parts == on_floors, (
            f"{package}: parts not on a floor {sorted(parts - on_floors)}, gone {sorted(on_floors - parts)}"
        )


@pytest.mark.parametrize(
    "module",
    [p for package in SUBFLOORS for p in sorted((PACKAGE / package).rglob("*.py")) if p.name != "__init__.py"],
    ids=lambda p: p.relative_to(PACKAGE).as_posix(),
)
def test_inside_a_split_package_every_import_points_down(module: Path) -> None:
    name = module_name(module)
    package = name.split(".")[0]
    floors = SUBFLOORS[package]

    def floor(part: str) -> int:
        return next(number for number, parts in enumerate(floors) if part in parts)

    own = _part(name)
    wrong = []
    for target, line in imported_modules(module).items():
        if target.split(".")[0] != package or target == package:
            continue
        part = _part(target)
        if part == own or floor(part) > floor(own):
            continue
        wrong.append(f"{target} (line {line}, floor {'/'.join(floors[floor(part)])})")
    assert not wrong, f"{name} (floor {'/'.join(floors[floor(own)])}) imports upward or sideways: {wrong}"


def test_no_two_modules_import_each_other() -> None:
    graph = {module_name(p): set(imported_modules(p)) for p in library_modules()}
    circles = _strongly_connected(graph)
    assert not circles, f"import circles: {circles}"


def test_every_package_is_on_a_floor() -> None:
    packages = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    packages -= {"__init__", "__pycache__", "_data"}
    on_floors = {name for floor in FLOORS for name in floor}
    assert packages <= on_floors, f"not on a floor: {sorted(packages - on_floors)}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the sets of modules that import each other round a loop (self-imports ignored)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target == node or target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_check_sees_imports_inside_functions_and_through_packages(tmp_path: Path) -> None:
    module = tmp_path / "lazy.py"
    module.write_text(
        "def f():\n"
        "    from axrl_spike_replay.workspace.task_record.task_log import record_replay\n"
        "    from axrl_spike_replay.diagnosis.rules import causes\n"
    )
    assert imported_modules(module) == {
        "workspace.task_record.task_log": 2,
        "diagnosis.rules": 3,
        "diagnosis.rules.causes": 3,
    }


def test_the_circle_check_finds_a_loop_of_three() -> None:
    loop = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _strongly_connected(loop) == [["a", "b", "c"]]
