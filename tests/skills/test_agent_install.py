"""`axrl-spike-replay install` puts the skills and the server into a project (or the user's config), safely."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters

from axrl_spike_replay.skill_pack import list_skills, skill_problems, split_frontmatter

SCRIPT = Path(sys.executable).parent / "axrl-spike-replay"
SKILLS = Path(__file__).resolve().parents[2] / "skills"
CLI = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "axrl_spike_replay"]
OTHER = {"command": "npx", "args": ["-y", "@example/other-server"], "env": {"TOKEN": "keep-me"}}


def install(*args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HOME=str(home)) if home else None
    return subprocess.run([*CLI, "install", *args], capture_output=True, text=True, env=env)


def test_install_into_a_project_keeps_other_servers_and_is_idempotent(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / ".mcp.json").write_text(json.dumps({"mcpServers": {"other": OTHER}, "note": "mine"}, indent=2))

    first = install("--dir", str(project), "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert report["scope"] == "project" and not report["dry_run"]

    config = json.loads((project / ".mcp.json").read_text())
    assert config["note"] == "mine"
    assert config["mcpServers"]["other"] == OTHER
    entry = config["mcpServers"]["axrl-spike-replay"]
    assert entry["args"][-1] == "mcp" and Path(entry["command"]).exists()

    installed = list_skills(project / ".claude" / "skills")
    assert {s.name for s in installed} >= {"axrl-spike-replay", "axrl-run-gpu-task", "axrl-copy-log-to-tmp-and-analyze"}
    for skill in installed:
        assert skill_problems(skill) == []
        assert (Path(skill.path) / "references").is_dir()
        # Claude Code reads its extensions at the top level of the installed copy, typed as it expects
        front, body = split_frontmatter((Path(skill.path) / "SKILL.md").read_text(), skill.path)
        assert isinstance(front["argument-hint"], str) and front["argument-hint"]
        assert front["user-invocable"] is True and "metadata" not in front
        assert body == split_frontmatter((SKILLS / skill.name / "SKILL.md").read_text(), skill.name)[1]

    second = json.loads(install("--dir", str(project), "--json").stdout)
    assert {c["action"] for c in second["changes"]} == {"unchanged"}
    assert second["config_diff"] == ""


def test_the_installed_config_starts_a_server_that_lists_tools(tmp_path: Path) -> None:
    assert install("--dir", str(tmp_path)).returncode == 0
    entry = json.loads((tmp_path / ".mcp.json").read_text())["mcpServers"]["axrl-spike-replay"]

    async def main():
        params = StdioServerParameters(command=entry["command"], args=entry["args"], cwd=str(tmp_path))
        async with Client(params) as client:
            return {t.name for t in (await client.list_tools()).tools}

    assert "inspect_snapshot" in anyio.run(main)


def test_dry_run_shows_the_change_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / ".mcp.json").write_text(json.dumps({"mcpServers": {"other": OTHER}}))
    before = (tmp_path / ".mcp.json").read_text()
    out = install("--dir", str(tmp_path), "--dry-run")
    assert out.returncode == 0, out.stderr
    assert '+    "axrl-spike-replay": {' in out.stdout and "would" in out.stdout
    assert (tmp_path / ".mcp.json").read_text() == before
    assert not (tmp_path / ".claude").exists()


def test_user_install_writes_to_the_home_config(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / ".claude.json").write_text(json.dumps({"numStartups": 3, "mcpServers": {"other": OTHER}}))
    out = install("--user", home=home)
    assert out.returncode == 0, out.stderr
    config = json.loads((home / ".claude.json").read_text())
    assert config["numStartups"] == 3 and config["mcpServers"]["other"] == OTHER
    assert "axrl-spike-replay" in config["mcpServers"]
    assert (home / ".claude" / "skills" / "axrl-spike-replay" / "SKILL.md").is_file()


def test_a_broken_config_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / ".mcp.json").write_text("{not json")
    out = install("--dir", str(tmp_path))
    assert out.returncode == 2
    assert ".mcp.json" in out.stderr and "not valid JSON" in out.stderr and "Traceback" not in out.stderr
    assert (tmp_path / ".mcp.json").read_text() == "{not json"
    assert not (tmp_path / ".claude").exists()


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"mcpServers": {"x": "caf\xe9"}}', "not UTF-8 text (byte 0xe9 at offset 25)"),
        (b"\xff\xfe{\x00}\x00", "not UTF-8 text (byte 0xff at offset 0)"),
        (b"[1, 2]", "expected a JSON object at the top, got list"),
        (b'"servers"', "expected a JSON object at the top, got str"),
        (b'{"mcpServers": []}', "'mcpServers' is not an object"),
        (b'{"n": ' + b"9" * 5000 + b"}", "not usable JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "JSON"),
    ],
    ids=["latin-1", "utf-16", "list", "string", "servers-list", "long-int", "deep"],
)
def test_an_unusable_config_is_a_clear_error_and_left_alone(tmp_path: Path, content: bytes, says: str) -> None:
    config = tmp_path / ".mcp.json"
    config.write_bytes(content)
    out = install("--dir", str(tmp_path))
    assert out.returncode == 2, out.stderr
    assert ".mcp.json" in out.stderr and says in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr) < 1000
    assert config.read_bytes() == content
    assert not (tmp_path / ".claude").exists()


def test_a_config_path_that_is_a_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / ".mcp.json").mkdir()
    out = install("--dir", str(tmp_path))
    assert out.returncode == 2
    assert ".mcp.json: cannot read it" in out.stderr and "Traceback" not in out.stderr
