"""The `command` backend: an external replay command run on the node (or here), optionally in a patched worktree.

For AXRL the command wraps `MegatronWorker.reproduce_spike(snapshot_dir)`. `{snapshot}` and `{out}` in
the configured command are replaced by shell-quoted paths, `{overrides}` by a mitigation config mapped
onto the trainer's own options (`remote.command.command_overrides`); the grad norm comes from `result_json` when
the command wrote it, else from `grad_norm_regex` matched on its stdout (`remote.command.command_result` reads both
as untrusted input). The command runs under the job reaper: it and every process it started end with it.
Each config is one run of the command (`repeat` runs, their spread reported and widening the baseline's tolerance as
the engine's repeats do; the second and later runs' files under `repeat-<k>/`); a replay with a config and a sweep
run the baseline first and judge every config against it, with the engine's verdicts. A result lists the
`top_params` largest parameter norms the command reported. The runs get the same output layout
(`command.txt`, `stdout.log`, `stderr.log`, `replay_result.json`, a sweep's `<config_id>/` dirs and
`sweep_result.json`) as the torch backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shlex
import string
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import config_id
from axrl_spike_replay.experiment.request.request_parts import What
from axrl_spike_replay.experiment.result import ParamNorm, ReplayResult, SweepResult, param_norms
from axrl_spike_replay.experiment.run_dir import RESULT_FILE, SWEEP_FILE, RunDir, RunRecorder, write_and_record
from axrl_spike_replay.experiment.verdict import tolerance_rule
from axrl_spike_replay.files.atomic import atomic_write_bytes
from axrl_spike_replay.remote.command.command_config import CommandBackendConfig
from axrl_spike_replay.remote.command.command_overrides import render_overrides
from axrl_spike_replay.remote.command.command_result import (
    MAX_RESULT_BYTES,
    CommandReport,
    grad_norm_from_stdout,
    read_command_result,
)
from axrl_spike_replay.remote.command.patch_worktree import patch_set_text, patched_worktree
from axrl_spike_replay.remote.nodes.results import SnapshotFacts, base_result, judged_result, tail
from axrl_spike_replay.remote.transport.cleanup import run_to_completion
from axrl_spike_replay.remote.transport.job import JobOutcome, LineCallback, Session
from axrl_spike_replay.remote.transport.remote_errors import RemoteError
from axrl_spike_replay.remote.transport.shell import job_script
from axrl_spike_replay.vocabulary import Backend, Verdict

COMMAND_RESULT_FILE = "command_result.json"
PATCH_FILE = "patch.diff"  # the patch set as applied, beside the result it produced


@dataclass(frozen=True)
class CommandRequest:
    """One external-command replay: the baseline, a patch set, a mitigation config (mapped onto the
    trainer's overrides), or a patch set with a config; `what` is the request's part as declared (its mitigations,
    repeats and listed parameters; a field the command backend does not carry was refused with the request)."""

    facts: SnapshotFacts
    backend: CommandBackendConfig
    what: What
    patches: tuple[str, ...] = ()  # applied in order in one temporary worktree
    timeout_s: float | None = None
    setup: tuple[str, ...] = ()
    target: str = "local"
    node: dict[str, Any] | None = None
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def mitigations(self) -> Mapping[str, Any]:
        """The replay's mitigation config, normal form, every name mapped onto the trainer's overrides."""
        return self.what.mitigations


def render_command(template: str, snapshot: str, out: str, overrides: str = "") -> str:
    """The command line with `{snapshot}` and `{out}` replaced by shell-quoted paths and `{overrides}` by the
    already-quoted override words (`{{`/`}}` for braces)."""
    return _render(template, {"snapshot": shlex.quote(snapshot), "out": shlex.quote(out), "overrides": overrides})


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


@dataclass
class _Context:
    """What every run of one request shares."""

    session: Session
    request: CommandRequest
    recorder: RunRecorder | None
    on_line: LineCallback | None
    progress: Callable[[str], None] | None

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)

    def write(self, run: RunDir, result: ReplayResult, *, record: bool = True) -> Path | None:
        if record:
            return write_and_record(run, result, self.recorder, self.request.facts.job)
        return run.write_result(result)


async def run_command_backend(
    session: Session,
    request: CommandRequest,
    run: RunDir,
    *,
    recorder: RunRecorder | None = None,
    on_line: LineCallback | None = None,
    progress: Callable[[str], None] | None = None,
) -> ReplayResult:
    """Run the external command once (the baseline, or a patch set judged against the recorded norm), or,
    with `request.mitigations`, the baseline then the config (overrides, in the patched worktree when there
    are patches), judged against that baseline as the torch engine judges it; the result, written.

    A failed command, a patch that does not apply, a timeout or a lost connection give a result with
    verdict `failed` and why. Cancellation (Ctrl-C, a cancelled task) writes that failed result too, then
    propagates. The result is written to `replay_result.json` and logged in the task file; with a config,
    the baseline's own files go under `baseline/` (logged only when it failed, as the engine does).
    """
    ctx = _Context(session, request, recorder, on_line, progress)
    config = dict(request.mitigations)
    if not config:
        workdir = request.backend.workdir
        return await _with_tree(ctx, run, lambda cwd, sha: _run_one(ctx, run, cwd or workdir, {}, sha, None))

    async def both(cwd: str | None, sha: str | None) -> ReplayResult:
        base_run = _sub_run(run, "baseline")
        baseline = await _run_one(ctx, base_run, request.backend.workdir, {}, None, None, record=False)
        if baseline.verdict == Verdict.FAILED:
            return baseline
        return await _run_one(ctx, run, cwd or request.backend.workdir, config, sha, _norm(baseline))

    return await _with_tree(ctx, run, both)


async def run_command_sweep(
    session: Session,
    request: CommandRequest,
    configs: Sequence[Mapping[str, Any]],
    run: RunDir,
    *,
    recorder: RunRecorder | None = None,
    on_line: LineCallback | None = None,
    progress: Callable[[str], None] | None = None,
) -> SweepResult:
    """The baseline once, then each config as one run of the command (its overrides; the patch set, when
    given, applied for every config), each judged against that baseline; results in the configs' order.

    Output as the engine's sweep: `<ts>/baseline/`, `<ts>/<config_id>/` (each with command.txt, logs and
    replay_result.json) and `<ts>/sweep_result.json`; every result is logged in the job's task file. A
    failed baseline stops the sweep (nothing can be judged against it); a failed config does not.
    """
    assert run.path is not None, "the command backend needs an output dir"
    ctx = _Context(session, request, recorder, on_line, progress)
    facts, started = request.facts, time.perf_counter()
    results: list[ReplayResult] = []

    async def sweep(cwd: str | None, sha: str | None) -> ReplayResult:
        baseline = await _run_one(ctx, _sub_run(run, "baseline"), request.backend.workdir, {}, None, None)
        if baseline.verdict == Verdict.FAILED:
            return baseline
        for config in configs:
            config_run = _sub_run(run, _config_id(config, sha))
            cwd_here = cwd or request.backend.workdir
            results.append(await _run_one(ctx, config_run, cwd_here, config, sha, _norm(baseline)))
        return baseline

    run.write_command(
        f"# target: {request.target}\n# sweep: the baseline and {len(configs)} config(s), one run of the command "
        "each; every run's command.txt is in its own dir"
    )
    baseline = await _with_tree(ctx, run, sweep, failed_id="sweep")
    result = SweepResult(
        snapshot=facts.snapshot,
        fidelity=baseline.fidelity,
        world_size_saved=facts.world_size,
        world_size_used=baseline.world_size_used,
        device=baseline.device,
        threshold=facts.threshold,
        baseline=baseline,
        results=results,
        output_dir=str(run.path),
        timings={"total": round(time.perf_counter() - started, 3)},
    )
    if baseline.verdict != Verdict.FAILED:
        run.write_json(SWEEP_FILE, result.to_json())
    return result


async def _with_tree(
    ctx: _Context,
    run: RunDir,
    work: Callable[[str | None, str | None], Awaitable[ReplayResult]],
    failed_id: str | None = None,
) -> ReplayResult:
    """`work(cwd, patch set sha)` in the patched worktree when the request has patches (applied first, so a
    patch that does not apply stops everything before any run), else `work(None, None)`. A worktree that
    cannot be made gives a failed result, written and logged at the top of `run`."""
    request = ctx.request
    if not request.patches:
        return await work(None, None)
    sha = patch_set_text(request.patches)[1]
    started = time.perf_counter()
    try:
        async with patched_worktree(ctx.session, request.backend.workdir, request.patches, ctx.progress) as tree:
            return await work(tree.path, sha)
    except AxrlError as exc:
        if not isinstance(exc, (ConfigError, RemoteError)) or _ran(run):
            raise
        config = {} if failed_id else dict(request.mitigations)
        fields = _fields(request, config, sha)
        if failed_id:
            fields["config_id"] = failed_id
        result = base_result(request.facts, error=str(exc), **fields)
        result.timings = {"total": round(time.perf_counter() - started, 3)}
        ctx.write(run, result)
        return result


def _ran(run: RunDir) -> bool:
    """True once a run's result was written under `run` (an error after that is the run's own)."""
    return run.path is not None and any(run.path.rglob(RESULT_FILE))


def _sub_run(run: RunDir, sub: str) -> RunDir:
    assert run.path is not None
    path = run.path / sub
    path.mkdir(parents=True, exist_ok=True)
    return RunDir(path)


def _norm(result: ReplayResult) -> float:
    return result.grad_norm if result.grad_norm is not None else math.nan


def _config_id(config: Mapping[str, Any], sha: str | None) -> str:
    """The engine's config id; a patch set's runs are `patch-<sha12>`, with the config after a `+`."""
    if not sha:
        return config_id(config)
    return f"patch-{sha[:12]}" + (f"+{config_id(config)}" if config else "")


def _fields(request: CommandRequest, config: Mapping[str, Any], sha: str | None) -> dict[str, Any]:
    return {
        "backend": Backend.COMMAND,
        "target": request.target,
        "node": request.node,
        "patch_sha256": sha,
        "mitigations": dict(config),
        "config_id": _config_id(config, sha),
    }


async def _run_one(
    ctx: _Context,
    run: RunDir,
    cwd: str,
    config: Mapping[str, Any],
    sha: str | None,
    baseline_norm: float | None,
    *,
    record: bool = True,
) -> ReplayResult:
    """`repeat` runs of the command in `cwd` with `config`'s overrides; their judged result, written in `run`.

    Unchanged (no config, no patch): judged against the recorded norm. Changed: against `baseline_norm`,
    the baseline replayed by the same command, else (a patch set alone) the recorded norm. The first run's norm is
    the result's; with several, each run's norm and their spread are reported and the spread widens the tolerance.
    """
    assert run.path is not None, "the command backend needs an output dir"
    request = ctx.request
    started = time.perf_counter()
    common = _fields(request, config, sha)
    if sha:
        atomic_write_bytes(run.path / PATCH_FILE, patch_set_text(request.patches)[0])  # a method file quotes it
    measured: list[tuple[float, CommandReport]] = []
    seconds = 0.0
    try:
        result: ReplayResult | None = None
        for k in range(request.what.repeat):
            here = run if k == 0 else _sub_run(run, f"repeat-{k + 1}")
            took, got = await _measure_once(ctx, here, cwd, config, common)
            seconds += took
            if isinstance(got, ReplayResult):  # a failed run fails the result
                result = got
                break
            measured.append(got)
        if result is None:
            result = _judged(ctx, run, measured, common, bool(config) or sha is not None, baseline_norm)
        result.timings = {"command": round(seconds, 3)}
    except AxrlError as exc:
        result = base_result(request.facts, error=str(exc), **common)
    except (asyncio.CancelledError, KeyboardInterrupt):
        result = base_result(request.facts, error="cancelled (Ctrl-C or a cancelled call)", **common)
        result.timings = {"total": round(time.perf_counter() - started, 3)}
        ctx.write(run, result)
        raise
    except Exception as exc:  # a defect of ours: the run is still recorded as what it is, a failure
        result = base_result(request.facts, error=f"the run failed: {type(exc).__name__}: {exc}", **common)
        result.timings = {"total": round(time.perf_counter() - started, 3)}
        ctx.write(run, result)
        raise
    result.timings["total"] = round(time.perf_counter() - started, 3)
    ctx.write(run, result, record=record or result.verdict == Verdict.FAILED)
    ctx.say(_summary(result))
    return result


async def _measure_once(
    ctx: _Context, run: RunDir, cwd: str, config: Mapping[str, Any], common: dict[str, Any]
) -> tuple[float, tuple[float, CommandReport] | ReplayResult]:
    """One run of the command, its files in `run`: (its seconds, (grad norm, report) or the failed result)."""
    session, request = ctx.session, ctx.request
    overrides = render_overrides(request.backend.mitigations, config)
    out_dir: str | None = None
    try:
        out_dir = await _out_dir(session, run)
        outcome = await _run(session, request, cwd, out_dir, run, ctx.on_line, overrides)
        return outcome.seconds, await _measure(session, request, outcome, out_dir, run, common)
    finally:
        if out_dir is not None and session.label != "local":
            with contextlib.suppress(Exception):
                await run_to_completion(session.remove_temp_dir(out_dir))


def _largest_first(entry: ParamNorm) -> float:
    """The sort key that lists parameter norms the largest first, as the engine does (an infinite norm first, a NaN
    or a missing one last)."""
    norm = entry.grad_norm
    return math.inf if norm is None or math.isnan(norm) else -norm


def _summary(result: ReplayResult) -> str:
    norm = "n/a" if result.grad_norm is None else f"{result.grad_norm:.9g}"
    change = result.change_vs_baseline
    versus = f" ({change * 100:+.1f}% vs baseline)" if change is not None else ""
    return f"{result.config_id}: grad norm {norm}{versus} -> {result.verdict}"


async def _out_dir(session: Session, run: RunDir) -> str:
    if session.label == "local":
        if run.path is None:
            raise AxrlError("the command backend needs an output dir")
        out = run.path / "out"
        out.mkdir(parents=True, exist_ok=True)
        return str(out)
    return await session.make_temp_dir("axrl-out-")


async def _run(
    session: Session,
    request: CommandRequest,
    cwd: str,
    out_dir: str,
    run: RunDir,
    on_line: LineCallback | None,
    overrides: str,
) -> JobOutcome:
    config = request.backend
    command = render_command(config.command, request.facts.snapshot, out_dir, overrides)
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


async def _measure(
    session: Session,
    request: CommandRequest,
    outcome: JobOutcome,
    out_dir: str,
    run: RunDir,
    common: dict[str, Any],
) -> tuple[float, CommandReport] | ReplayResult:
    """The grad norm one run of the command gave, with its result file's report; a failed result otherwise."""
    assert run.path is not None
    facts, config = request.facts, request.backend
    if not outcome.ok:
        error = f"the replay command failed: {outcome.reason}"
        last = tail(outcome.stderr_path)
        return base_result(facts, error=error + (f"\n{last}" if last else ""), **common)
    report = CommandReport()
    if config.result_json:
        remote_json = render_path(config.result_json, facts.snapshot, out_dir)
        if await session.exists(remote_json):
            local_json = await session.fetch(remote_json, run.path / COMMAND_RESULT_FILE, MAX_RESULT_BYTES)
            try:
                report = read_command_result(local_json, remote_json)
            except AxrlError as exc:
                return base_result(facts, error=str(exc), **common)
    grad_norm = report.grad_norm
    if grad_norm is None:
        grad_norm = grad_norm_from_stdout(outcome.stdout_path, config.grad_norm_regex)
    if grad_norm is None:
        where = f"{config.result_json} has no grad_norm and " if config.result_json else ""
        error = f"no grad norm: {where}grad_norm_regex {config.grad_norm_regex!r} matched nothing in stdout"
        return base_result(facts, error=error, **common)
    return grad_norm, report


def _judged(
    ctx: _Context,
    run: RunDir,
    measured: list[tuple[float, CommandReport]],
    common: dict[str, Any],
    changed: bool,
    baseline_norm: float | None,
) -> ReplayResult:
    """The result of the command's runs (the first one's norm and report), judged as the engine judges a replay."""
    request = ctx.request
    norms = [norm for norm, _ in measured]
    grad_norm, report = measured[0]
    device = report.device or ("cuda" if (request.node or {}).get("gpu_count") else "cpu")
    tol = tolerance_rule(report.fidelity, device, repeats=norms)[0]  # ours, whatever the command says about itself
    if report.ignored:
        run.log(f"the command's result gives {', '.join(report.ignored)}: not used; the verdict's tolerance is {tol:g}")
    ranked = sorted(param_norms(report.top_params), key=_largest_first)
    extra = {
        "fidelity": report.fidelity,
        "world_size_used": report.world_size_used or request.facts.world_size,
        "device": device,
        "top_params": ranked[: request.what.top_params],
        "repeat_grad_norms": norms if len(norms) > 1 else [],
        "repeat_spread": max(norms) - min(norms) if len(norms) > 1 else None,
    }
    return judged_result(request.facts, grad_norm, tol, changed, baseline_norm, **common, **extra)
