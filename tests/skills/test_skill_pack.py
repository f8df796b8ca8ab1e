"""The skills an agent loads: valid Agent Skills frontmatter, tools that exist, methods and mitigations that match."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client

from axrl_spike_replay.package_data import skills_dir
from axrl_spike_replay.server import create_server
from axrl_spike_replay.skill_pack import list_skills, methods_block, skill_problems, with_methods_block
from axrl_spike_replay.workspace.task_record.views import MethodEntry

SKILLS = ("axrl-spike-replay", "axrl-run-gpu-task", "axrl-copy-log-to-tmp-and-analyze")
REPO = Path(__file__).resolve().parents[2]
CALL_RE = re.compile(r"`([a-z][a-z0-9_]*)\(")


def served_tools() -> set[str]:
    async def main() -> set[str]:
        async with Client(create_server(Path.cwd())) as client:
            return {t.name for t in (await client.list_tools()).tools}

    return anyio.run(main)


def skill_texts() -> dict[str, str]:
    """Every markdown file of every skill, SKILL.md and references/."""
    return {str(p.relative_to(skills_dir())): p.read_text() for p in sorted(skills_dir().rglob("*.md"))}


def test_the_three_skills_ship_with_valid_frontmatter() -> None:
    skills = {s.name: s for s in list_skills()}
    assert set(SKILLS) <= set(skills)
    for name in SKILLS:
        skill = skills[name]
        assert skill_problems(skill) == [], skill_problems(skill)
        assert skill.user_invocable is True
        assert skill.argument_hint
        assert "$ARGUMENTS" in skill.body
        assert (Path(skill.path) / "references").is_dir()


def test_every_tool_a_skill_calls_exists_on_the_server() -> None:
    tools = served_tools()
    called = {}
    for path, text in skill_texts().items():
        for name in CALL_RE.findall(text):
            called.setdefault(name, path)
    missing = {name: path for name, path in called.items() if name not in tools}
    assert not missing, f"skills call tools the server does not have: {missing}"


def test_the_workflow_skill_names_a_tool_for_every_step() -> None:
    text = (skills_dir() / "axrl-spike-replay" / "SKILL.md").read_text()
    steps = [
        "resolve_job",
        "list_snapshots",
        "preserve_snapshots",
        "task_open",
        "inspect_snapshot",
        "analyze_batch",
        "top_param_grads",
        "attribute_spike",
        "replay",
        "sweep",
        "probe_node",
        "task_note",
        "method_list",
        "method_add",
        "write_report",
        "release_preserved",
    ]
    for tool in steps:
        assert f"`{tool}(" in text, tool
    assert text.index("`preserve_snapshots(") < text.index("`inspect_snapshot(")
    assert text.index("`write_report(") < text.rindex("`release_preserved(")


def test_the_mitigation_catalogue_matches_the_registry() -> None:
    from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS

    text = (skills_dir() / "axrl-spike-replay" / "references" / "mitigation-catalogue.md").read_text()
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.MULTILINE))
    assert rows == set(MITIGATIONS)
    for name, _value in re.findall(r"`([a-z_]+): ([^`]+)`", text):
        assert name in MITIGATIONS, name


def test_the_recorded_methods_list_is_generated_from_the_method_files() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "render_skill_methods.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_the_methods_block_lists_each_method_with_status_and_change(tmp_path: Path) -> None:
    methods = [
        MethodEntry(
            slug="tis-clip-2",
            status="proven",
            summary="mismatch_token_clip_max=2: 31 -> 3",
            path="spike-mitigation-methods/tis-clip-2.md",
            front_matter={"slug": "tis-clip-2", "mitigations": {"mismatch_token_clip_max": 2.0}},
        ),
        MethodEntry(
            slug="route-l0",
            status="partial",
            summary="current routing L0",
            path="spike-mitigation-methods/route-l0.md",
            front_matter={"slug": "route-l0", "mitigations": {}},
        ),
    ]
    block = methods_block(methods)
    assert block.splitlines() == [
        "- **tis-clip-2** (proven) — mismatch_token_clip_max=2: 31 -> 3",
        "- **route-l0** (partial) — current routing L0",
    ]
    skill = "a\n<!-- recorded-methods:begin -->\nold\n<!-- recorded-methods:end -->\nb\n"
    assert "old" not in with_methods_block(skill, block) and "route-l0" in with_methods_block(skill, block)


@pytest.mark.parametrize("name", SKILLS)
def test_each_skill_is_also_an_mcp_prompt_with_the_arguments_filled_in(name: str) -> None:
    async def main():
        async with Client(create_server(Path.cwd())) as client:
            listed = {p.name for p in (await client.list_prompts()).prompts}
            prompt = await client.get_prompt(name, {"arguments": "job-x ssh -p 26461 root@10.100.4.23"})
            return listed, prompt

    listed, prompt = anyio.run(main)
    assert name in listed
    text = prompt.messages[0].content.text
    assert "job-x ssh -p 26461 root@10.100.4.23" in text
    assert "$ARGUMENTS" not in text and not text.startswith("---")


def test_every_argument_a_skill_passes_is_a_parameter_of_that_tool() -> None:
    async def main():
        async with Client(create_server(Path.cwd())) as client:
            return {t.name: set(t.input_schema.get("properties", {})) for t in (await client.list_tools()).tools}

    params = anyio.run(main)
    wrong = []
    for path, text in skill_texts().items():
        for tool, args in re.findall(r"`([a-z][a-z0-9_]*)\(([^`]*)\)`", text):
            if tool not in params:
                continue
            for name in re.findall(r"(?:^|[(,]\s*)([a-z_]+)\s*(?=[=?,)]|$)", args):
                if name not in params[tool]:
                    wrong.append(f"{path}: {tool}({name})")
    assert not wrong, wrong


@pytest.mark.parametrize("name", SKILLS)
def test_each_skill_passes_the_agent_skills_reference_validator(name: str) -> None:
    """`agentskills validate` (PyPI skills-ref, the spec's reference validator) accepts the repo's skills."""
    validator = Path(sys.executable).parent / "agentskills"
    assert validator.exists(), "skills-ref is a dev dependency: scripts/setup.sh installs it"
    run = subprocess.run([str(validator), "validate", str(REPO / "skills" / name)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_skill_the_tool_and_the_docs_say_what_method_add_does_with_a_shipped_change() -> None:
    """`method_add` writes the same change as a shipped method, marked `confirms_shipped` (tests/workspace/
    test_method_choice.py proves it), and refuses the workspace's own duplicates: every text an agent reads says so."""
    from axrl_spike_replay.mcp_faces.record_tools import method_add_tool

    skill = (skills_dir() / "axrl-spike-replay" / "SKILL.md").read_text()
    tool = " ".join((method_add_tool.__doc__ or "").split())
    cli = " ".join((REPO / "docs" / "cli.md").read_text().split())
    for text in (" ".join(skill.split()), tool, cli):
        assert "confirms_shipped" in text
    assert "duplicates of a workspace method" in tool
    assert "do not add a duplicate of the workspace's own methods" in " ".join(skill.split())
    assert "refused as a duplicate" in cli
