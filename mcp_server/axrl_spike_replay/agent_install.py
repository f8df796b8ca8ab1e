"""Install the agent side: the skills into `.claude/skills/` and the MCP server into the agent's config.

Project scope (default): `<project>/.claude/skills/<skill>/` and `<project>/.mcp.json`.
User scope: `~/.claude/skills/<skill>/` and `~/.claude.json` (Claude Code's user-scope `mcpServers`).
The server entry is merged under `mcpServers`: other servers and every other key stay as they were.
Installing twice changes nothing; a dry run reports the same changes and writes nothing.

The entry starts the server over stdio by default. With `http_url` it names a running HTTP server instead
(`mcp --http`), and a `headersHelper` command that prints the server's bearer token as the header to send
(`mcp-token`), so the token itself never lands in a config file that may be committed or shared.
"""

from __future__ import annotations

import difflib
import json
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.files.atomic import atomic_write_bytes, atomic_write_text
from axrl_spike_replay.skill_pack import SKILL_FILE, claude_code_skill_text, list_skills, skill_problems

SERVER_NAME = "axrl-spike-replay"  # the MCP server's name, as it announces itself and as agents register it
PROJECT_CONFIG = ".mcp.json"
USER_CONFIG = ".claude.json"
SKILLS_SUBDIR = Path(".claude") / "skills"


@dataclass
class FileChange:
    """One file the install creates, updates or leaves as it is."""

    path: str
    action: str  # "create" | "update" | "unchanged"


@dataclass
class InstallResult:
    """What `install` did (or, with `dry_run`, would do)."""

    scope: str  # "project" | "user"
    dry_run: bool
    skills_dir: str
    config_file: str
    server_name: str
    server_entry: dict[str, Any]
    skills: list[str]
    changes: list[FileChange] = field(default_factory=list)
    config_diff: str = ""

    @property
    def changed(self) -> bool:
        """True when at least one file is (or would be) written."""
        return any(c.action != "unchanged" for c in self.changes)


def _program() -> list[str]:
    """This installation's command line: its console script, else `python -m axrl_spike_replay`."""
    script = Path(sys.executable).parent / "axrl-spike-replay"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "axrl_spike_replay"]


def server_command() -> dict[str, Any]:
    """The stdio entry that starts this installation's server."""
    program = _program()
    return {"type": "stdio", "command": program[0], "args": [*program[1:], "mcp"]}


def http_entry(url: str, token_file: str | None = None) -> dict[str, Any]:
    """The entry of a running streamable HTTP server at `url` (`mcp --http`): Claude Code runs `headersHelper`
    before it connects and sends the headers it prints, here `Authorization: Bearer <token>` read from the
    server's token file (`mcp-token`; the file the server made for the URL's port, or `token_file`)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise ConfigError(f"`http` {url!r} is not an http:// URL of the server, such as http://127.0.0.1:8765/mcp")
    helper = [*_program(), "mcp-token"]
    if token_file is not None:
        helper += ["--token-file", str(Path(token_file).expanduser().absolute())]
    else:
        helper += ["--port", str(port or (443 if parts.scheme == "https" else 80))]
    return {"type": "http", "url": url, "headersHelper": shlex.join(helper)}


def _read_config(path: Path) -> tuple[dict[str, Any], str | None]:
    if not path.exists():
        return {}, None
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "fix it first, nothing was written"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc}); nothing was written") from None
    if not text.strip():
        return {}, text
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); fix it first, nothing was written"
        ) from None
    except (ValueError, RecursionError) as exc:  # an integer too long to convert, nesting too deep
        reason = "nested too deeply" if isinstance(exc, RecursionError) else shown(str(exc), 120)
        raise ConfigError(f"{path}: not usable JSON ({reason}); fix it first, nothing was written") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top, got {type(doc).__name__}; nothing was written")
    if not isinstance(doc.get("mcpServers", {}), dict):
        raise ConfigError(f"{path}: 'mcpServers' is not an object; nothing was written")
    return doc, text


def merged_config(doc: dict[str, Any], name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """`doc` with `mcpServers[name] = entry`, everything else kept in its order."""
    merged = dict(doc)
    servers = dict(merged.get("mcpServers") or {})
    servers[name] = entry
    merged["mcpServers"] = servers
    return merged


def _skill_files(skill_dir: Path) -> list[Path]:
    return sorted(p for p in skill_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def install(
    project_dir: str | Path | None = None,
    *,
    user: bool = False,
    dry_run: bool = False,
    entry: dict[str, Any] | None = None,
) -> InstallResult:
    """Copy the packaged skills and register the MCP server, for a project (default: cwd) or the user."""
    if user and project_dir is not None:
        raise ConfigError("give either --dir PROJECT or --user, not both")
    base = Path.home() if user else Path(project_dir or Path.cwd()).expanduser()
    if not base.is_dir():
        raise ConfigError(f"{base}: directory not found (pass --dir PROJECT pointing at an existing directory)")
    base = base.resolve()
    skills = list_skills()
    problems = [p for s in skills for p in skill_problems(s)]
    if problems:
        raise ConfigError("the packaged skills are not valid: " + "; ".join(problems))
    entry = entry or server_command()
    config_path = base / (USER_CONFIG if user else PROJECT_CONFIG)
    target_skills = base / SKILLS_SUBDIR
    result = InstallResult(
        scope="user" if user else "project",
        dry_run=dry_run,
        skills_dir=str(target_skills),
        config_file=str(config_path),
        server_name=SERVER_NAME,
        server_entry=entry,
        skills=[s.name for s in skills],
    )

    doc, old_text = _read_config(config_path)  # a broken config stops the install before anything is written
    for skill in skills:
        source = Path(skill.path)
        for src in _skill_files(source):
            dest = target_skills / skill.name / src.relative_to(source)
            data = src.read_bytes()
            if src.name == SKILL_FILE:  # Claude Code reads argument-hint / user-invocable at the top level
                data = claude_code_skill_text(data.decode("utf-8"), str(src)).encode("utf-8")
            action = "create" if not dest.exists() else ("unchanged" if dest.read_bytes() == data else "update")
            result.changes.append(FileChange(str(dest), action))
            if action != "unchanged" and not dry_run:
                atomic_write_bytes(dest, data)
                shutil.copymode(src, dest)

    new_doc = merged_config(doc, SERVER_NAME, entry)
    if old_text is not None and doc == new_doc:
        result.changes.append(FileChange(str(config_path), "unchanged"))
    else:
        new_text = json.dumps(new_doc, indent=2) + "\n"
        result.config_diff = "".join(
            difflib.unified_diff(
                (old_text or "").splitlines(keepends=True),
                new_text.splitlines(keepends=True),
                fromfile=f"{config_path} (before)",
                tofile=f"{config_path} (after)",
            )
        )
        result.changes.append(FileChange(str(config_path), "create" if old_text is None else "update"))
        if not dry_run:
            atomic_write_text(config_path, new_text)
    return result
