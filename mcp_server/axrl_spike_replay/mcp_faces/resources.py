"""The investigation record as MCP resources, and the skills as MCP prompts (for agents without skills)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceNotFoundError
from mcp.server.mcpserver.prompts import Prompt
from mcp.types import Resource
from pydantic import Field

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.mcp_faces.config import ServerConfig
from axrl_spike_replay.mcp_faces.lean_tools import TOOL_URI, full_tool_doc
from axrl_spike_replay.mcp_faces.shared_arguments import ARGUMENTS_URI, MITIGATIONS_URI, guide_text
from axrl_spike_replay.names import check_plain_name
from axrl_spike_replay.skill_pack import Skill, list_skills, render_skill
from axrl_spike_replay.workspace.method_files.methods import shipped_methods_dir
from axrl_spike_replay.workspace.paths import METHODS_INDEX, TASKS_DIR, methods_dir, task_md_path

TASK_URI = "axrl://task/{job}"
METHOD_URI = "axrl://method/{slug}"
METHODS_INDEX_URI = "axrl://methods"


def _read(path: Path, missing: str) -> str:
    if not path.is_file():
        raise ResourceNotFoundError(missing)
    return path.read_text(encoding="utf-8")


def record_resources(workspace: Path) -> list[Resource]:
    """The task files and method files present in `workspace`, as concrete resources."""
    found = []
    tasks = workspace / TASKS_DIR
    for md in sorted(tasks.glob("*.md")) if tasks.is_dir() else []:
        if not md.with_suffix(".json").is_file():  # a task has its state beside it; a README does not
            continue
        found.append(
            Resource(
                uri=f"axrl://task/{md.stem}",
                name=f"task {md.stem}",
                mime_type="text/markdown",
                description=f"Task file of the spike investigation of job {md.stem}",
            )
        )
    seen: set[str] = set()
    for folder, label in ((methods_dir(workspace), ""), (shipped_methods_dir(), " (shipped with the tool)")):
        for md in sorted(folder.glob("*.md")) if folder is not None and folder.is_dir() else []:
            if md.name == METHODS_INDEX or md.stem in seen:  # the workspace's own file wins over a shipped one
                continue
            seen.add(md.stem)
            found.append(
                Resource(
                    uri=f"axrl://method/{md.stem}",
                    name=f"method {md.stem}",
                    mime_type="text/markdown",
                    description=f"Mitigation method {md.stem}{label}",
                )
            )
    return found


def register(server: MCPServer, config: ServerConfig) -> None:
    """Add the record resources and one prompt per skill."""

    @server.resource(
        TASK_URI,
        name="task",
        title="Investigation task file",
        mime_type="text/markdown",
        description="The ongoing task file of a job's spike investigation (agent-task/spike-replay/<job>.md)",
    )
    def task_file(job: str) -> str:
        try:
            path = task_md_path(config.workspace, job)
        except AxrlError as exc:
            raise ResourceNotFoundError(str(exc)) from None
        return _read(path, f"no task file for job {job!r} in {config.workspace}; open one with the task_open tool")

    @server.resource(
        METHOD_URI,
        name="method",
        title="Proven mitigation method",
        mime_type="text/markdown",
        description="One proven mitigation method (spike-mitigation-methods/<slug>.md)",
    )
    def method_file(slug: str) -> str:
        try:
            name = check_plain_name(slug, "method slug")
        except AxrlError as exc:
            raise ResourceNotFoundError(str(exc)) from None
        missing = f"no method {slug!r} in {methods_dir(config.workspace)}; the method_list tool lists them"
        own = methods_dir(config.workspace) / f"{name}.md"
        shipped = shipped_methods_dir()
        if not own.is_file() and shipped is not None and (shipped / f"{name}.md").is_file():
            return _read(shipped / f"{name}.md", missing)  # a shipped method, when the workspace has none of that name
        return _read(own, missing)

    @server.resource(
        METHODS_INDEX_URI,
        name="methods",
        title="Index of proven methods",
        mime_type="text/markdown",
        description="spike-mitigation-methods/README.md: every recorded method with its status",
    )
    def methods_index() -> str:
        index = methods_dir(config.workspace) / METHODS_INDEX
        return index.read_text(encoding="utf-8") if index.is_file() else "No mitigation methods recorded yet.\n"

    @server.resource(
        MITIGATIONS_URI,
        name="mitigations",
        title="Replay-only mitigations",
        mime_type="text/plain",
        description="Every mitigation name the replay, sweep and attribute_spike tools accept, its values and effect",
    )
    def mitigations() -> str:
        from axrl_spike_replay.experiment.mitigation.mitigations import valid_mitigations

        return "Mitigations (replay-only; each off unless named in a config {NAME: VALUE}):\n" + valid_mitigations()

    @server.resource(
        ARGUMENTS_URI,
        name="arguments",
        title="Arguments many tools share",
        mime_type="text/plain",
        description="Placement (target, targets, slurm), backend and patches, fidelity (nproc, shard), and the rest",
    )
    def arguments() -> str:
        return guide_text()

    @server.resource(
        TOOL_URI,
        name="tool",
        title="A tool in full",
        mime_type="application/json",
        description="One tool's whole description, input schema and output schema (tools/list carries a summary)",
    )
    async def tool_in_full(name: str) -> str:
        tools = {t.name: t for t in await server.list_tools()}  # a read-only server shows only what it offers
        if name not in tools:
            raise ResourceNotFoundError(f"no tool {shown(name, 60)}; tools/list names them")
        full = getattr(server, "full_tools", None)
        whole = {t.name: t for t in await full()} if full is not None else tools
        return full_tool_doc(whole[name])

    for skill in list_skills():
        server.add_prompt(_skill_prompt(skill))


ArgumentsArg = Annotated[
    str,
    Field(
        description="What you would type after the skill's slash command: job names, snapshot directories, "
        "and optionally an SSH target such as `ssh -p 26461 root@10.100.4.23`."
    ),
]


def _skill_prompt(skill: Skill) -> Prompt:
    def render(arguments: ArgumentsArg = "") -> str:
        return render_skill(skill, arguments)

    return Prompt.from_function(render, name=skill.name, title=skill.name, description=skill.description)
