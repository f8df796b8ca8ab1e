"""The package's shape: every module name is used once (a name says one idea, and `errors` or `launch` never needs
its folder to be told apart), and no folder holds more than 15 modules (a folder of more is several ideas)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mcp_server" / "axrl_spike_replay"
MAX_MODULES = 15
SPECIAL = {"__init__.py", "__main__.py"}  # a package's own files, in every package by Python's rules


def module_names(root: Path) -> dict[str, list[str]]:
    """{file name: the folders (relative to `root`) holding a module of that name}, special files left out."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name not in SPECIAL and "__pycache__" not in path.parts:
            found[path.name].append(path.parent.relative_to(root).as_posix())
    return dict(found)


def folder_sizes(root: Path) -> dict[str, int]:
    """{folder (relative to `root`): its modules, special files left out} for every folder holding Python."""
    sizes: dict[str, int] = defaultdict(int)
    for path in root.rglob("*.py"):
        if "__pycache__" not in path.parts:
            sizes[path.parent.relative_to(root).as_posix()] += path.name not in SPECIAL
    return dict(sizes)


def test_no_module_name_is_used_twice() -> None:
    twice = {name: folders for name, folders in module_names(PACKAGE).items() if len(folders) > 1}
    assert not twice, f"module names used in several folders (name each by its idea): {twice}"


def test_no_folder_holds_more_than_15_modules() -> None:
    sizes = folder_sizes(PACKAGE)
    over = {folder: n for folder, n in sizes.items() if n > MAX_MODULES}
    assert not over, f"folders of more than {MAX_MODULES} modules (split them by idea into subpackages): {over}"


def test_remote_is_split_by_idea() -> None:
    sizes = folder_sizes(PACKAGE)
    parts = {"remote/transport", "remote/launchers", "remote/command", "remote/nodes"}
    assert parts <= set(sizes) and all(sizes[f] <= MAX_MODULES for f in parts | {"remote"}), sizes


def test_the_checks_see_a_name_used_twice_and_a_folder_too_big(tmp_path: Path) -> None:
    for folder in ("a", "b", "a/c"):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "a" / "errors.py").write_text("")
    (tmp_path / "a" / "c" / "errors.py").write_text("")
    for i in range(MAX_MODULES + 1):
        (tmp_path / "b" / f"m{i}.py").write_text("")
    assert sorted(module_names(tmp_path)["errors.py"]) == ["a", "a/c"]
    assert "__init__.py" not in module_names(tmp_path)
    assert folder_sizes(tmp_path) == {"a": 1, "a/c": 1, "b": MAX_MODULES + 1}
