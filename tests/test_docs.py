"""The README is where a newcomer starts: it says what the tool does and gives the two commands first, stays short,
and points to docs/, where each face and format has its page. Every link between them resolves, and the reference
pages cover what the code has: every CLI verb, every snapshot file and batch field."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from axrl_spike_replay.cli import build_parser
from axrl_spike_replay.snapshot import layout
from axrl_spike_replay.snapshot.fields import FIELD_ALIASES

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
_LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def test_the_readme_says_what_the_tool_does_then_gives_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    opening = text.split("```", 1)[0]
    assert "gradient spike" in opening and "replays the spike step" in opening and len(opening) < 800
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[0] for line in first_block.splitlines()] == ["./scripts/demo.sh", "./scripts/test.sh"]
    assert len(text.encode()) < 8_000  # the reference lives in docs/


def test_the_readme_points_to_a_page_per_face_and_the_snapshot_format() -> None:
    text = README.read_text(encoding="utf-8")
    for page in ("cli", "mcp", "snapshot-format", "mitigations", "safety", "models"):
        assert f"(docs/{page}.md)" in text and (DOCS / f"{page}.md").is_file()
    assert f"npx -y @modelcontextprotocol/inspector@{_inspector_version()} .venv/bin/axrl-spike-replay mcp" in text


def _inspector_version() -> str:
    """The MCP Inspector version test.sh installs (scripts/inspector-install.sh)."""
    script = (REPO / "scripts" / "inspector-install.sh").read_text(encoding="utf-8")
    found = re.search(r'^VERSION="([0-9.]+)"', script, re.M)
    assert found is not None
    return found.group(1)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_inspector_command_runs_non_interactively_at_the_tested_version(page: Path) -> None:
    """Without `-y`, npx asks before it installs and a non-interactive shell fails; the version is the one the tests
    run."""
    lines = [line for line in page.read_text(encoding="utf-8").splitlines() if "npx " in line]
    wanted = f"npx -y @modelcontextprotocol/inspector@{_inspector_version()} "
    assert [line for line in lines if wanted not in line] == []


def test_the_readme_documentation_table_lists_every_page() -> None:
    table = README.read_text(encoding="utf-8").split("## Documentation", 1)[1]
    assert [p.name for p in sorted(DOCS.glob("*.md")) if f"(docs/{p.name})" not in table] == []


def test_the_readme_example_writes_up_the_attempt_its_name_says() -> None:
    """"On your own spike", followed in order: `replay` logs E1, `sweep` one attempt per `--mitigation` (E2, E3, ...);
    the method it writes up is named after what that attempt ran (`method add` warns otherwise)."""
    import shlex

    from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args
    from axrl_spike_replay.workspace.method_files.method_names import name_warning, said_by
    from axrl_spike_replay.workspace.method_files.methods import known_method_names
    from axrl_spike_replay.workspace.task_record.changes import normalise_config

    block = README.read_text(encoding="utf-8").split("## On your own spike", 1)[1].split("```bash\n", 1)[1]
    commands = [shlex.split(line, comments=True) for line in block.split("\n```", 1)[0].splitlines()]
    attempts: dict[str, dict] = {}
    for words in commands:
        if words[:2] == ["axrl-spike-replay", "replay"] and "--mitigation" not in words:
            attempts[f"E{len(attempts) + 1}"] = {}
        if words[:2] == ["axrl-spike-replay", "sweep"]:
            for i, word in enumerate(words[:-1]):
                if word == "--mitigation":
                    attempts[f"E{len(attempts) + 1}"] = normalise_config(parse_mitigation_args(words[i + 1].split()))
    [add] = [w for w in commands if w[:3] == ["axrl-spike-replay", "method", "add"]]
    attempt, name = add[add.index("--attempt") + 1], add[add.index("--name") + 1]
    ran = attempts[attempt]
    known = known_method_names(REPO)
    assert ran and set(ran) <= said_by(name, known) and name_warning(name, ran, known) is None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _LINK_RE.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(target)
    assert broken == []


def _verbs(parser: argparse.ArgumentParser) -> list[str]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


def test_the_cli_page_documents_every_verb() -> None:
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    headings = {line[4:].strip() for line in text.splitlines() if line.startswith("### ")}
    assert set(_verbs(build_parser())) <= headings
    for verb, sub in (("task", ("open", "note", "set-snapshot", "set-command", "show")), ("method", ("add", "list"))):
        assert all(f"axrl-spike-replay {verb} {name} " in text for name in sub)


def test_the_snapshot_format_page_names_every_file_and_batch_field() -> None:
    text = (DOCS / "snapshot-format.md").read_text(encoding="utf-8")
    files = [layout.AXRL_METADATA, layout.CHECKPOINT_METADATA, layout.DCP_METADATA, layout.RUN_CONFIG,
             layout.PRESERVE_MARKER, layout.batch_file(0).replace("0", "<r>"),
             layout.grad_info_file(0).replace("0", "<r>"), layout.routing_payload_file(0).replace("0", "<r>"),
             layout.SNAPSHOTS_DIR.as_posix(), layout.PRESERVED_DIR.as_posix()]  # fmt: skip
    assert [f for f in files if f"`{f}" not in text and f not in text] == []
    assert [name for names in FIELD_ALIASES.values() for name in names if f"`{name}`" not in text] == []


def test_the_spike_guard_snippet_runs_as_written(tmp_path: Path) -> None:
    """docs/capture.md's loop is what people paste into their trainer first: it runs as it is, and the snapshot it
    writes is one the tool reads."""
    import json
    import os
    import subprocess
    import sys

    text = (DOCS / "capture.md").read_text(encoding="utf-8")
    snippet = text.split("```python\n", 1)[1].split("\n```", 1)[0]
    assert "SpikeGuard(" in snippet and "guard.snapshot(" in snippet
    env = {**os.environ, "PYTHONPATH": str(REPO / "mcp_server")}
    run = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    snapshot = tmp_path / "outputs" / "run1~my-job__actor" / layout.SNAPSHOTS_DIR / "iter_0000030-r1"
    assert run.stdout.strip() == f"[PosixPath('{snapshot.relative_to(tmp_path)}')]"
    meta = json.loads((snapshot / layout.AXRL_METADATA).read_text())
    assert meta["iteration"] == 30 and meta["job_name"] == "my-job" and meta["spike_ratio"] > 5
    from axrl_spike_replay.analysis.batch_signals import analyze_snapshot

    assert analyze_snapshot(snapshot).ratio_old_vs_rollout["log_ratio"]["max"] == 8.0  # the planted 8 nats
