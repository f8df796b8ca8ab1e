"""The `command` backend: an external replay command run on the node (or here), optionally in a patched worktree.

For AXRL the command wraps `MegatronWorker.reproduce_spike(snapshot_dir)`. `{snapshot}` and `{out}` in
the configured command are replaced by shell-quoted paths; the grad norm comes from `result_json` when
the command wrote it, else from `grad_norm_regex` matched on its stdout. The run gets the same output
layout (`command.txt`, `stdout.log`, `stderr.log`, `replay_result.json`) as the torch backend.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import string
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.remote.cleanup import run_to_completion
from axrl_spike_replay.remote.job import JobOutcome, LineCallback, Session
from axrl_spike_replay.remote.patch_worktree import patched_worktree, read_patch
from axrl_spike_replay.remote.results import SnapshotFacts, base_result, judged_result, tail, write_and_record
from axrl_spike_replay.remote.shell import job_script
from axrl_spike_replay.remote.workspace_config import CommandBackendConfig
from axrl_spike_replay.replay.result import ReplayResult
from axrl_spike_replay.replay.run_dir import RunDir
from axrl_spike_replay.replay.verdict import tolerance
from axrl_spike_replay.vocabulary import Backend, Fidelity

COMMAND_RESULT_FILE = "command_result.json"


@dataclass(frozen=True)
class CommandRequest:
    """One external-command replay."""

    facts: SnapshotFacts
    backend: CommandBackendConfig
    patch: str | None = None
    timeout_s: float | None = None
    setup: tuple[str, ...] = ()
    target: str = "local"
    node: dict[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)


def render_command(template: str, snapshot: str, out: str) -> str:
    """The command line with `{snapshot}` and `{out}` replaced by shell-quoted paths (`{{`/`}}` for braces)."""
    return _render(template, {"snapshot": shlex.quote(snapshot), "out": shlex.quote(out)})


def render_path(template: str, snapshot: str, out: str) -> str:
    """A path template (`result_json`) with the placeholders replaced literally."""
    return _render(template, {"snapshot": snapshot, "out": out})


def _render(template: str, values: dict[str, str]) -> str:
    pieces = []
    for literal, name, _spec, _conv in string.Formatter().parse(template):
        pieces.append(literal)
        if name is not None:
            pieces.append(values[name])
    return "".join(pieces)


def grad_norm_from_doc(doc: Any) -> float | None:
    """`grad_norm` of a result document (a number, or "nan"/"inf" spelled out), else None."""
    if not isinstance(doc, dict) or "grad_norm" not in doc:
        return None
    try:
        return float(doc["grad_norm"])
    except (TypeError, ValueError):
        return None


def grad_norm_from_text(text: str, regex: str) -> float | None:
    """The last match of `regex` (its first group) in `text` that parses as a number, else None."""
    for match in reversed(list(re.finditer(regex, text))):
        with contextlib.suppress(TypeError, ValueError):
            return float(match.group(1))
    return None


async def run_command_backend(
    session: Session,
    request: CommandRequest,
    run: RunDir,
    *,
    workspace: str | Path | None = None,
    on_line: LineCallback | None = None,
    progress: Callable[[str], None] | None = None,
) -> ReplayResult:
    """Run the external command (in a patched worktree with `request.patch`); the judged result, written.

    A failed command, a patch that does not apply, a timeout or a lost connection give a result with
    verdict `failed` and why. Cancellation (Ctrl-C, a cancelled task) writes that failed result too, then
    propagates. Every result is written to `replay_result.json` and logged in the task file.
    """
    assert run.path is not None, "the command backend needs an output dir"
    started = time.perf_counter()
    sha = read_patch(request.patch)[1] if request.patch else None
    common: dict[str, Any] = {
        "backend": Backend.COMMAND,
        "target": request.target,
        "node": request.node,
        "patch_sha256": sha,
        "config_id": f"patch-{sha[:12]}" if sha else "command",
    }
    out_dir: str | None = None
    try:
        out_dir = await _out_dir(session, run)
        if request.patch:
            async with patched_worktree(session, request.backend.workdir, request.patch, progress) as tree:
                outcome = await _run(session, request, tree.path, out_dir, run, on_line)
        else:
            outcome = await _run(session, request, request.backend.workdir, out_dir, run, on_line)
        result = await _judge(session, request, outcome, out_dir, run, common)
        result.timings = {"command": round(outcome.seconds, 3)}
    except AxrlError as exc:
        result = base_result(request.facts, error=str(exc), **common)
    except BaseException:
        result = base_result(request.facts, error="cancelled (Ctrl-C or a cancelled call)", **common)
        result.timings = {"total": round(time.perf_counter() - started, 3)}
        write_and_record(run, result, workspace, request.facts.job)
        raise
    finally:
        if out_dir is not None and session.label != "local":
            with contextlib.suppress(Exception):
                await run_to_completion(session.remove_temp_dir(out_dir))
    result.timings["total"] = round(time.perf_counter() - started, 3)
    write_and_record(run, result, workspace, request.facts.job)
    return result


async def _out_dir(session: Session, run: RunDir) -> str:
    if session.label == "local":
        if run.path is None:
            raise AxrlError("the command backend needs an output dir")
        out = run.path / "out"
        out.mkdir(parents=True, exist_ok=True)
        return str(out)
    return await session.make_temp_dir("axrl-out-")


async def _run(
    session: Session, request: CommandRequest, cwd: str, out_dir: str, run: RunDir, on_line: LineCallback | None
) -> JobOutcome:
    config = request.backend
    command = render_command(config.command, request.facts.snapshot, out_dir)
    env = {**config.env, **request.env}
    script = job_script(command, cwd=cwd, env=env, setup=request.setup)
    run.write_command(f"# target: {request.target}\n# workdir: {cwd}\n{command}")
    assert run.path is not None
    return await session.run(
        script,
        stdout_path=run.path / "stdout.log",
        stderr_path=run.path / "stderr.log",
        timeout=request.timeout_s,
        on_line=on_line,
    )


async def _judge(
    session: Session,
    request: CommandRequest,
    outcome: JobOutcome,
    out_dir: str,
    run: RunDir,
    common: dict[str, Any],
) -> ReplayResult:
    assert run.path is not None
    facts, config = request.facts, request.backend
    if not outcome.ok:
        error = f"the replay command failed: {outcome.reason}"
        last = tail(outcome.stderr_path)
        return base_result(facts, error=error + (f"\n{last}" if last else ""), **common)
    doc: dict[str, Any] = {}
    if config.result_json:
        remote_json = render_path(config.result_json, facts.snapshot, out_dir)
        if await session.exists(remote_json):
            local_json = await session.fetch(remote_json, run.path / COMMAND_RESULT_FILE)
            try:
                doc = json.loads(local_json.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                return base_result(facts, error=f"{remote_json}: not valid JSON ({exc.msg})", **common)
    grad_norm = grad_norm_from_doc(doc)
    if grad_norm is None:
        grad_norm = grad_norm_from_text(
            outcome.stdout_path.read_text(encoding="utf-8", errors="replace"), config.grad_norm_regex
        )
    if grad_norm is None:
        where = f"{config.result_json} has no grad_norm and " if config.result_json else ""
        error = f"no grad norm: {where}grad_norm_regex {config.grad_norm_regex!r} matched nothing in stdout"
        return base_result(facts, error=error, **common)
    try:
        fidelity = Fidelity.parse(doc.get("fidelity", "full"), "fidelity in the command's result")
    except AxrlError as exc:
        return base_result(facts, error=str(exc), **common)
    device = str(doc.get("device", "cuda" if (request.node or {}).get("gpu_count") else "cpu"))
    extra = {
        "fidelity": fidelity,
        "world_size_used": int(doc.get("world_size_used", facts.world_size)),
        "device": device,
        "top_params": doc.get("top_params", []) if isinstance(doc.get("top_params"), list) else [],
    }
    tol = float(doc["tolerance"]) if isinstance(doc.get("tolerance"), (int, float)) else tolerance(fidelity, device)
    return judged_result(facts, grad_norm, tol, common.get("patch_sha256") is not None, **common, **extra)
