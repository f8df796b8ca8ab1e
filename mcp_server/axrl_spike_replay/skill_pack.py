"""The agent skills that ship with the package: read, check and render `skills/<name>/SKILL.md`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.package_data import skills_dir
from axrl_spike_replay.untrusted.untrusted_yaml import load_untrusted_yaml
from axrl_spike_replay.workspace.task_record.views import MethodEntry

SKILL_FILE = "SKILL.md"
MAX_DESCRIPTION = 1024
MAX_LINES = 500
_NAME_RE = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")  # fullmatch: `$` lets "\n" through
_FRONTMATTER_RE = re.compile(r"\A---\n(.*?)\n---\n?(.*)\Z", re.DOTALL)


@dataclass
class Skill:
    """One skill: its folder, frontmatter and markdown body."""

    name: str
    description: str
    path: str
    body: str
    argument_hint: str = ""
    user_invocable: bool = False
    frontmatter: dict[str, Any] = field(default_factory=dict)


def split_frontmatter(text: str, source: str) -> tuple[dict[str, Any], str]:
    """(frontmatter mapping, markdown body) of a SKILL.md; ConfigError naming `source` when malformed."""
    match = _FRONTMATTER_RE.match(text)
    if not match:
        raise ConfigError(f"{source}: no YAML frontmatter (the file must start with '---')")
    meta = load_untrusted_yaml(match.group(1), f"{source} frontmatter")  # no aliases; errors name the file
    if not isinstance(meta, dict):
        raise ConfigError(f"{source}: frontmatter is not a mapping")
    return meta, match.group(2)


def parse_skill(skill_md: str | Path) -> Skill:
    """Parse a SKILL.md; ConfigError naming the file when its frontmatter is missing or malformed."""
    path = Path(skill_md)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it as UTF-8 text ({shown(str(exc), quote=False)})") from None
    meta, body = split_frontmatter(text, str(path))
    extensions = _claude_code_fields(meta)
    return Skill(
        name=str(meta.get("name", "")),
        description=str(meta.get("description", "")),
        path=str(path.parent),
        body=body,
        argument_hint=str(extensions.get("argument-hint", "")),
        user_invocable=extensions.get("user-invocable") is True,
        frontmatter=meta,
    )


# Claude Code reads these two as top-level frontmatter fields; the Agent Skills spec allows only name,
# description, license, compatibility, allowed-tools and metadata there. The repo keeps them under
# `metadata:` (string values, as the spec wants) so the skills validate; `install` lifts them back up.
CLAUDE_CODE_FIELDS = ("argument-hint", "user-invocable")


def _claude_code_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """argument-hint (str) and user-invocable (bool), from the top level or from `metadata:`."""
    metadata = meta.get("metadata")
    nested: dict[str, Any] = metadata if isinstance(metadata, dict) else {}
    found: dict[str, Any] = {}
    for key in CLAUDE_CODE_FIELDS:
        value = meta.get(key, nested.get(key))
        if value is None:
            continue
        if key == "user-invocable":
            value = value is True or str(value).strip().lower() == "true"
        found[key] = value if key == "user-invocable" else str(value)
    return found


def claude_code_skill_text(skill_md_text: str, source: str) -> str:
    """A SKILL.md as Claude Code reads it: `metadata.argument-hint` / `metadata.user-invocable` at the top level.

    The body is kept byte for byte; the frontmatter is written again (same fields, same values).
    """
    meta, body = split_frontmatter(skill_md_text, source)
    lifted = _claude_code_fields(meta)
    if not lifted:
        return skill_md_text
    out = {k: v for k, v in meta.items() if k not in CLAUDE_CODE_FIELDS and k != "metadata"}
    out.update(lifted)
    rest = {k: v for k, v in (meta.get("metadata") or {}).items() if k not in CLAUDE_CODE_FIELDS}
    if rest:
        out["metadata"] = rest
    front = yaml.safe_dump(out, sort_keys=False, allow_unicode=True, width=100)
    return f"---\n{front}---\n{body}"


def skill_problems(skill: Skill) -> list[str]:
    """What breaks the Agent Skills format: name vs folder, name syntax, description length, file length."""
    problems = []
    folder = Path(skill.path).name
    if skill.name != folder:
        problems.append(f"{skill.path}: name {shown(skill.name)} differs from its folder {shown(folder)}")
    if not _NAME_RE.fullmatch(skill.name) or len(skill.name) > 64:
        problems.append(
            f"{skill.path}: name {shown(skill.name)} is not lowercase words joined by hyphens (<= 64 chars)"
        )
    if not skill.description.strip():
        problems.append(f"{skill.path}: description is empty")
    if len(skill.description) > MAX_DESCRIPTION:
        problems.append(f"{skill.path}: description has {len(skill.description)} characters (max {MAX_DESCRIPTION})")
    lines = (Path(skill.path) / SKILL_FILE).read_text(encoding="utf-8").count("\n") + 1
    if lines >= MAX_LINES:
        problems.append(
            f"{skill.path}: SKILL.md has {lines} lines (keep it under {MAX_LINES}; move detail to references/)"
        )
    return problems


def list_skills(root: str | Path | None = None) -> list[Skill]:
    """Every skill under `root` (default: the packaged skills), by name."""
    base = Path(root) if root is not None else skills_dir()
    return sorted((parse_skill(p) for p in base.glob(f"*/{SKILL_FILE}")), key=lambda s: s.name)


def render_skill(skill: Skill, arguments: str = "") -> str:
    """The skill's instructions with `$ARGUMENTS` filled in, as an agent would receive them."""
    return skill.body.replace("$ARGUMENTS", arguments.strip() or "(no arguments given)")


METHODS_BEGIN = "<!-- recorded-methods:begin -->"
METHODS_END = "<!-- recorded-methods:end -->"


def methods_block(methods: list[MethodEntry]) -> str:
    """The markdown list of recorded methods (from `workspace.method_files.methods.list_methods`) for the
    workflow skill."""
    if not methods:
        return "_No methods recorded yet._"
    order = {"proven": 0, "partial": 1, "diagnostic": 2}
    lines = []
    for method in sorted(methods, key=lambda m: (order.get(m.status, 3), m.slug)):
        summary = " ".join(("" if method.summary is None else method.summary).split())
        lines.append(f"- **{method.slug}** ({method.status}) — {summary}")
    return "\n".join(lines)


def with_methods_block(skill_text: str, block: str) -> str:
    """`skill_text` with the part between the recorded-methods markers replaced by `block`."""
    start = skill_text.find(METHODS_BEGIN)
    end = skill_text.find(METHODS_END)
    if start < 0 or end < start:
        raise ConfigError(f"SKILL.md has no {METHODS_BEGIN} ... {METHODS_END} markers")
    return skill_text[: start + len(METHODS_BEGIN)] + "\n" + block.strip("\n") + "\n" + skill_text[end:]
