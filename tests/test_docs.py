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
    assert "npx @modelcontextprotocol/inspector .venv/bin/axrl-spike-replay mcp" in text


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
