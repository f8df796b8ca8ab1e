"""A name with a leading underscore belongs to its module: no module of the package imports another module's
private name (`from axrl_spike_replay.diagnosis.rules.causes import _pct`) or reaches one through a module it imported
(`worker._gather`), nor reads or sets one on an object of another module (`self.pool._slots`, `job.plan._split`,
`runner()._pool`): a private attribute that no module but another of the package defines (a `def _x`, a class-body
`_x`, a `self._x = ...`). A module's own `self._x` and `cls._x` are its own, and so is `other._x` where the module
defines `_x` itself; privates of other libraries (`os._exit`) are theirs to keep. A helper that two modules need is
public, in the module whose idea it is. Checked on the source, imports inside functions and under TYPE_CHECKING
included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mcp_server" / "axrl_spike_replay"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """`axrl_spike_replay.replay.worker` for replay/worker.py (a package's __init__ is the package)."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def defined_privates(tree: ast.Module) -> set[str]:
    """The private names a module defines: its functions, classes and module-level names, its classes' attributes
    (class-body names, `self._x = ...`, `cls._x = ...`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for statement in node.body:
                targets = statement.targets if isinstance(statement, ast.Assign) else []
                targets += [statement.target] if isinstance(statement, ast.AnnAssign) else []
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _own(node.value):
            names.add(node.attr)
    return {name for name in names if _private(name)}


def _own(value: ast.expr) -> bool:
    """`self` or `cls`: the object whose private attributes a module's own methods use."""
    return isinstance(value, ast.Name) and value.id in ("self", "cls")


def private_owners(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{private name: the modules of the package that define it}."""
    owners: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for name in defined_privates(ast.parse(path.read_text(), str(path))):
            owners.setdefault(name, set()).add(module_name(path, package))
    return owners


def private_reaches(path: Path, package: Path = PACKAGE, owners: dict[str, set[str]] | None = None) -> list[str]:
    """`file:line: what` for each import of another module's private name, each `module._name` read through
    a module (or a package's module) imported from the package, and each `<object>._name` (not `self._name` or
    `cls._name`) whose name this module does not define and another module of the package does (`owners`:
    `private_owners(package)`)."""
    me = module_name(path, package)
    root = package.name
    tree = ast.parse(path.read_text(), str(path))
    owners = private_owners(package) if owners is None else owners
    mine = defined_privates(tree)
    found: list[str] = []
    modules: dict[str, str] = {}  # local name -> module of the package it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, me, path.name == "__init__.py")
            if source.split(".")[0] != root:
                continue
            for alias in node.names:
                if _private(alias.name) and source != me:
                    found.append(f"{path.name}:{node.lineno}: from {source} import {alias.name}")
                modules[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == root:
                    modules[alias.asname or root] = alias.name if alias.asname else root
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in modules:
            owner = ".".join([modules[value.id], *reversed(chain[1:])])
            if owner != me:
                found.append(f"{path.name}:{node.lineno}: {value.id}.{'.'.join(reversed(chain))}")
        elif not _own(node.value) and node.attr not in mine and owners.get(node.attr, set()) - {me}:
            where = ", ".join(sorted(owners[node.attr] - {me}))
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)} ({node.attr} is {where}'s)")
    return found


def test_no_module_imports_another_modules_private_name() -> None:
    owners = private_owners()
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in private_reaches(path, owners=owners)]
    assert found == [], "private names used outside their module (make them public where they belong):\n" + "\n".join(
        found
    )


def test_the_check_finds_each_kind_of_reach(tmp_path: Path) -> None:
    package = tmp_path / "axrl_spike_replay"
    (package / "replay").mkdir(parents=True)
    for name in ("__init__.py", "replay/__init__.py", "replay/worker.py"):
        (package / name).write_text("def _gather():\n    pass\n")
    user = package / "replay" / "user.py"
    user.write_text(
        "from axrl_spike_replay.replay.worker import _gather\n"
        "from .worker import _gather as g\n"
        "from axrl_spike_replay.replay import worker\n"
        "import axrl_spike_replay.replay.worker\n"
        "def f():\n"
        "    from axrl_spike_replay.replay.worker import __doc__, gather\n"
        "    return worker._gather, axrl_spike_replay.replay.worker._gather, _own\n"
        "def _own():\n"
        "    return _own\n"
    )
    found = private_reaches(user, package)
    assert [hit.split(": ", 1)[1] for hit in found] == [
        "from axrl_spike_replay.replay.worker import _gather",
        "from axrl_spike_replay.replay.worker import _gather",
        "worker._gather",
        "axrl_spike_replay.replay.worker._gather",
    ]
    assert private_reaches(package / "replay" / "worker.py", package) == []


def test_the_check_finds_a_private_attribute_of_another_modules_object(tmp_path: Path) -> None:
    package = tmp_path / "axrl_spike_replay"
    (package / "replay").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "replay" / "__init__.py").write_text("")
    (package / "replay" / "pool.py").write_text(
        "class Pool:\n"
        "    _kind = 'warm'\n"
        "    def __init__(self):\n"
        "        self._slots = []\n"
        "    def _drain(self):\n"
        "        return self._slots, self._kind\n"
    )
    user = package / "replay" / "user.py"
    user.write_text(
        "import os\n"
        "class Runner:\n"
        "    def __init__(self, pool):\n"
        "        self.pool, self._own = pool, 1\n"
        "    def run(self, other, job):\n"
        "        self.pool._slots.append(job.pool._drain())\n"
        "        return type(self.pool)._kind, other._own, self._own, os._exit, self._drain\n"
    )
    found = private_reaches(user, package)
    assert sorted(hit.split(": ", 1)[1] for hit in found) == [
        "job.pool._drain (_drain is axrl_spike_replay.replay.pool's)",
        "self.pool._slots (_slots is axrl_spike_replay.replay.pool's)",
        "type(self.pool)._kind (_kind is axrl_spike_replay.replay.pool's)",
    ]
    assert private_reaches(package / "replay" / "pool.py", package) == []
