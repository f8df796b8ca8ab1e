"""The built-in `torch` replay backend: recompute a spike step's gradients from a snapshot, with mitigations.

The engine takes the replay request as it is (`experiment.request.request_parts`, built and checked by
`investigation.request.replay_request`); its keyword arguments say only what runs it: who records the run, who
computes the job, the memory `shard: auto` plans against. `run_replay` loads the weights from the snapshot's DCP
checkpoint, the rank batches and routing payloads, rebuilds model, loss and routing from `run_config.yaml`,
recomputes every saved rank's gradients (no optimizer step), reduces them across data-parallel ranks as the trainer
did and compares the global pre-clip grad norm with the recorded one. A mitigated replay also recomputes the
baseline at the same layout (sharing its forward pass) to give the mitigation its verdict.
"""

from __future__ import annotations

import math
import shlex
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError, ConfigError, SnapshotError
from axrl_spike_replay.experiment.mitigation.mitigations import (
    AppliedConfig,
    apply_config,
    mitigation_args,
    normal_form,
    parse_config,
)
from axrl_spike_replay.experiment.mitigation.rank_scope import finding
from axrl_spike_replay.experiment.request.request_fields import changed_values
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S, ReplayRequest
from axrl_spike_replay.experiment.result import CleanGradient, ReplayResult, param_norms
from axrl_spike_replay.experiment.run_dir import RunDir, RunRecorder, command_line, now_iso
from axrl_spike_replay.experiment.verdict import (
    BaselineBasis,
    baseline_verdict,
    hypothesis_verdict,
    is_spike,
    mitigation_verdict,
    ratio_threshold,
    rel_diff,
    tolerance,
    tolerance_rule,
    verdict_basis,
    verdict_threshold,
)
from axrl_spike_replay.percent import pct
from axrl_spike_replay.processes.run_limit import time_limited
from axrl_spike_replay.replay.compute.clean_gradient import spike_bar
from axrl_spike_replay.replay.compute.outcome_figures import DEFINITION
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.jobs.job_runner import JobRunner, run_job
from axrl_spike_replay.replay.plans.layout_plan import LayoutPlan, plan_layout
from axrl_spike_replay.replay.plans.replay_plan import HERE, Capacity
from axrl_spike_replay.replay.plans.shard_choice import ShardChoice, choose_shard, planned_shard, with_checkpoint
from axrl_spike_replay.replay.reading.inputs import ReplayInputs, check_configs, input_refusal, load_inputs
from axrl_spike_replay.replay.refusals import experiments
from axrl_spike_replay.replay.streamed.settings import StreamSettings
from axrl_spike_replay.snapshot.consistency import Consistency
from axrl_spike_replay.snapshot.rank_data import recorded_rank_loss
from axrl_spike_replay.vocabulary import Backend, Device, Shard, Verb, Verdict


def check_device(device: str) -> str:
    """`device` when this machine has it; ConfigError otherwise."""
    if device not in Device.values():
        raise ConfigError(f"`device` must be one of {', '.join(Device.values())}, got {device!r}", "device")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            build = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ConfigError(
                f"`device` cuda: CUDA is not available on this machine ({build}); use `device` cpu", "device"
            )
    return device


@contextmanager
def replay_dir_for(snapshot: str | Path) -> Iterator[tuple[str, bool]]:
    """(dir to read from, legacy) for a snapshot; a legacy snapshot's temporary replay dir is removed after."""
    from axrl_spike_replay.files.temp_janitor import removed_if_killed
    from axrl_spike_replay.snapshot.legacy import prepare_replay_dir

    prepared = prepare_replay_dir(snapshot)
    if not prepared.legacy:
        yield prepared.replay_dir, False
        return
    with removed_if_killed(prepared.replay_dir):  # even a SIGKILLed replay leaves no linked copy behind
        try:
            yield prepared.replay_dir, True
        finally:
            shutil.rmtree(prepared.replay_dir, ignore_errors=True)  # links and files it wrote, never the snapshot


class ReplaySession:
    """A validated replay: inputs, layout, configs and output dir; `execute` runs every config once."""

    def __init__(
        self,
        inputs: ReplayInputs,
        plan: LayoutPlan,
        configs: list[AppliedConfig],
        request: ReplayRequest,
        shard: ShardChoice | None = None,
        *,
        recorder: RunRecorder | None = None,
        runner: JobRunner | None = None,
        stream: StreamSettings | None = None,
    ) -> None:
        self.inputs = inputs
        self.plan = plan
        self.configs = configs
        self.request = request
        self.recorder = recorder
        self.runner = runner
        self.stream = stream
        self.shard = shard or ShardChoice(False, "shard off")
        self.job = request.job or inputs.job_name or "spike"
        threshold = request.what.clear_threshold
        self.threshold, self.threshold_source = verdict_threshold(inputs.metadata.detector, threshold)
        try:
            self.detector_threshold: float | None = ratio_threshold(inputs.metadata.detector)
        except AxrlError:
            if threshold is None:
                raise
            self.detector_threshold = None  # the user's threshold stands in for an unusable one
        self.device = str(request.how.device)
        self.tolerance = tolerance(plan.tolerance_class, self.device)
        self.run = RunDir(None)
        self.started = time.perf_counter()
        # the recorded step's own replay, refused: an input of it no computation is defined on (input_checks); the
        # configs are then the experiments that remove that input, judged against the recorded step
        self.baseline_refused: str | None = None
        # a sweep's experiments refused (their place among the configs as given, the config, why: a value its check
        # refuses, a lever this snapshot cannot take; `replay.refusals`): reported by name beside the others, which run
        self.refused: list[tuple[int, AppliedConfig, str]] = []

    def log(self, line: str) -> None:
        self.run.log(line)
        if self.request.progress is not None:
            self.request.progress(line)

    def worker_job(self) -> WorkerJob:
        """The job the replay's processes (or the streamed replay) compute."""
        inputs = self.inputs
        return WorkerJob(
            replay_dir=inputs.replay_dir,
            model=inputs.model,
            configs=tuple(self.configs),
            world_size=inputs.world_size,
            assignment=self.plan.assignment,
            device=self.device,
            repeat=self.request.what.repeat,
            top=self.request.what.top_params,
            counts=inputs.counts,
            spike_bar=spike_bar(inputs.metadata.median_norm, self.threshold),
            shard=self.shard.shard,
            precision=inputs.precision,
            checkpoint_layers=self.shard.checkpoint,
        )

    def execute(self) -> tuple[ReplayResult, list[ReplayResult]]:
        """(baseline, mitigated results in config order), all at this session's layout."""
        inputs, request = self.inputs, self.request
        job = self.worker_job()
        held = "sharded" if self.shard.shard else "whole model per process"
        if self.shard.streamed:
            held = "streamed: one decoder layer at a time, the saved ranks split over the processes"
        self.log(
            f"replaying {len(self.configs)} config(s) on "
            f"{self.streamed_processes if self.shard.streamed else self.plan.nproc} process(es), "
            f"{self.device}, fidelity {self.plan.fidelity} (saved world size {inputs.world_size}), "
            f"{held}, precision {self.precision_label}"
        )
        timeout_s = request.where.timeout_s
        with time_limited(request.cancel, timeout_s, str(request.what.verb)) as stop:
            outcomes = self.job_runner()(job, timeout_s or RUN_TIMEOUT_S, stop, progress=request.progress)
        if self.baseline_refused is not None:
            baseline, results = self._without_baseline(outcomes)
            return baseline, self._with_refused(results)
        baseline = self.result(self.configs[0], outcomes[0], None)
        results = [
            self.result(c, out, baseline.grad_norm) for c, out in zip(self.configs[1:], outcomes[1:], strict=True)
        ]
        self.log(
            f"baseline: grad norm {baseline.grad_norm:.9g} (recorded {baseline.recorded_grad_norm:.9g}, "
            f"rel_diff {_fmt(baseline.rel_diff)}, tolerance {self.tolerance:g}, ratio to median "
            f"{_fmt(baseline.spike_ratio)}) -> {baseline.verdict}"
        )
        if results and not is_spike(baseline.grad_norm, self.inputs.metadata.median_norm, self.threshold):
            self.log(
                f"baseline is not a spike (ratio to median {_fmt(baseline.spike_ratio)} is under the threshold "
                f"{self.threshold:g}): no mitigation can be judged to clear it -> baseline_not_a_spike"
            )
        for r in results:
            self.log(
                f"{r.config_id}: grad norm {r.grad_norm:.9g} ({pct(r.change_vs_baseline)} vs baseline, ratio to "
                f"median {_fmt(r.spike_ratio)}, threshold {self.threshold:g}) -> {r.verdict}"
            )
        return baseline, self._with_refused(results)

    def _with_refused(self, results: list[ReplayResult]) -> list[ReplayResult]:
        """`results` with each refused experiment's result put back in its place (verdict failed, the refusal)."""
        out = list(results)
        for place, cfg, why in self.refused:
            self.log(f"{cfg.config_id}: refused: {why}")
            out.insert(place, self.failed(f"refused: {why}", "replay", cfg))
        return out

    def _without_baseline(self, outcomes: Sequence[ConfigOutcome]) -> tuple[ReplayResult, list[ReplayResult]]:
        """(the refused baseline, the experiments judged against the recorded step's grad norm)."""
        refused = self.baseline_refused or ""
        baseline = self.failed(refused, "replay", apply_config({}, self.inputs.loss, self.inputs.routing))
        recorded = self.inputs.metadata.grad_norm
        self.log(f"baseline refused: {refused}")
        self.log(f"each experiment is judged against the recorded step (grad norm {recorded:.9g})")
        results = [self.result(c, out, recorded) for c, out in zip(self.configs, outcomes, strict=True)]
        for r in results:
            self.log(
                f"{r.config_id}: grad norm {r.grad_norm:.9g} ({pct(r.change_vs_baseline)} vs the recorded step, ratio "
                f"to median {_fmt(r.spike_ratio)}, threshold {self.threshold:g}) -> {r.verdict}"
            )
        return baseline, results

    @property
    def precision_label(self) -> str:
        precision = self.inputs.effective_precision
        return precision.label + ("" if precision.recorded else " (none recorded: the model's own dtype)")

    def _fields(self, cfg: AppliedConfig, config_id: str) -> dict[str, Any]:
        """What every result of this session says, whatever its outcome."""
        meta = self.inputs.metadata
        return {
            "snapshot": self.inputs.snapshot,
            "backend": self.request.where.backend,
            "target": "local",
            "fidelity": self.plan.fidelity,
            "world_size_saved": self.inputs.world_size,
            "world_size_used": self.plan.nproc,
            # a hypothesis is no mitigation: it is kept as `hypothesis`, judged against the recording
            "mitigations": {} if cfg.is_hypothesis else dict(cfg.mitigations),
            "hypothesis": dict(cfg.mitigations) if cfg.is_hypothesis else {},
            "resolved_mitigations": dict(cfg.resolved),
            "recorded_grad_norm": meta.grad_norm,
            "median_norm": meta.median_norm,
            "threshold": self.threshold,
            "device": self.device,
            "job_name": meta.job_name,
            "role": meta.role,
            "iteration": meta.iteration,
            "config_id": config_id,
            "created_at": now_iso(),
            "legacy_layout": self.inputs.legacy,
            "sharded": self.shard.shard,
            "shard_reason": self.shard.reason,
            "precision": self.inputs.effective_precision,
            "trainer_version_note": cfg.loss.trl.version_note() if cfg.loss.trl is not None else None,
            "input_findings": [f.message for f in self.inputs.findings],
        }

    def result(self, cfg: AppliedConfig, outcome: ConfigOutcome, baseline_norm: float | None) -> ReplayResult:
        """The ReplayResult of one config's outcome."""
        meta, norm = self.inputs.metadata, outcome.grad_norms[0]
        if cfg.is_hypothesis:
            return self._hypothesis_result(cfg, outcome)
        judged = self.tolerance
        if cfg.mitigations:
            verdict = mitigation_verdict(norm, baseline_norm or math.nan, meta.median_norm, self.threshold)
            change = norm / baseline_norm - 1.0 if baseline_norm else None
            basis = verdict_basis(
                norm, baseline_norm, meta.median_norm, self.threshold, self.threshold_source, self.detector_threshold
            )
        else:
            judged, judged_by = tolerance_rule(
                self.plan.tolerance_class,
                self.device,
                self.inputs.effective_precision.param_dtype,
                outcome.grad_norms,
            )
            verdict, change = baseline_verdict(norm, meta.grad_norm, judged), None
            basis = BaselineBasis(
                rel_diff=rel_diff(norm, meta.grad_norm),
                tolerance=judged,
                tolerance_rule=judged_by,
                rule="reproduced when |grad_norm - recorded| / recorded <= tolerance",
                threshold=self.threshold,
                threshold_source=self.threshold_source,
            )
        clean = (
            CleanGradient.from_json({**outcome.clean_gradient, "definition": DEFINITION})
            if outcome.clean_gradient
            else None
        )
        spread = max(outcome.grad_norms) - min(outcome.grad_norms) if len(outcome.grad_norms) > 1 else None
        return ReplayResult(
            **self._fields(cfg, cfg.config_id),
            grad_norm=norm,
            rel_diff=rel_diff(norm, meta.grad_norm),
            spike_ratio=norm / meta.median_norm if meta.median_norm > 0 else None,
            verdict=verdict,
            baseline_grad_norm=baseline_norm if cfg.mitigations else None,
            change_vs_baseline=change,
            top_params=param_norms(outcome.top_params),
            timings={**outcome.timings, "total": time.perf_counter() - self.started},
            tolerance=judged,
            repeat_grad_norms=list(outcome.grad_norms) if len(outcome.grad_norms) > 1 else [],
            repeat_spread=spread,
            rank_metrics=outcome.rank_metrics,
            consistency=None if cfg.mitigations else self._consistency(outcome),
            footprint=outcome.footprint,
            cosine_to_clean=outcome.cosine_to_clean,
            clean_gradient=clean,
            verdict_basis=basis,
        )

    def _hypothesis_result(self, cfg: AppliedConfig, outcome: ConfigOutcome) -> ReplayResult:
        """A hypothesis replay's result: judged against the recording, the grad norm and every rank's loss."""
        meta, norm = self.inputs.metadata, outcome.grad_norms[0]
        replayed = {m["rank"]: m.get("loss") for m in outcome.rank_metrics if isinstance(m.get("rank"), int)}
        losses = {
            rank: (recorded_rank_loss(self.inputs.replay_dir, rank), replayed.get(rank))
            for rank in range(self.inputs.world_size)
        }
        verdict, basis = hypothesis_verdict(norm, meta.grad_norm, self.tolerance, losses)
        basis.threshold, basis.threshold_source = self.threshold, self.threshold_source
        spread = max(outcome.grad_norms) - min(outcome.grad_norms) if len(outcome.grad_norms) > 1 else None
        return ReplayResult(
            **self._fields(cfg, cfg.config_id),
            grad_norm=norm,
            rel_diff=rel_diff(norm, meta.grad_norm),
            spike_ratio=norm / meta.median_norm if meta.median_norm > 0 else None,
            verdict=verdict,
            top_params=param_norms(outcome.top_params),
            timings={**outcome.timings, "total": time.perf_counter() - self.started},
            tolerance=self.tolerance,
            repeat_grad_norms=list(outcome.grad_norms) if len(outcome.grad_norms) > 1 else [],
            repeat_spread=spread,
            rank_metrics=outcome.rank_metrics,
            verdict_basis=basis,
            finding=finding(verdict, cfg.mitigations),
        )

    def _consistency(self, outcome: ConfigOutcome) -> Consistency:
        """The snapshot's consistency checks, with the replayed per-rank losses and the job's log."""
        from axrl_spike_replay.snapshot.consistency import check_replayed_losses, check_snapshot
        from axrl_spike_replay.snapshot.log_point import job_logs, log_point
        from axrl_spike_replay.snapshot.replayed_param_norms import check_replayed_param_norms

        meta = self.inputs.metadata
        point = log_point(self.inputs.replay_dir, meta.iteration, job_logs(self.inputs.snapshot))
        found = check_snapshot(
            self.inputs.replay_dir, log_grad_norm=point.grad_norm, log_source=point.source, log_note=point.note
        )
        check_replayed_losses(found, self.inputs.replay_dir, outcome.rank_metrics)
        check_replayed_param_norms(
            found,
            self.inputs.replay_dir,
            outcome.param_grad_norms,
            outcome.rank_param_grad_norms,
            self.tolerance,
            f"the replay ({self.plan.fidelity} fidelity, {self.device})",
        )
        return found

    def failed(self, error: str, verb: str = "replay", cfg: AppliedConfig | None = None) -> ReplayResult:
        """The result recorded for a run that failed after its output dir was made (a sweep: one for all), or
        for `cfg`, refused."""
        if cfg is None:
            cfg = self.configs[-1] if verb == "replay" else apply_config({}, self.inputs.loss, self.inputs.routing)
        return ReplayResult(
            **self._fields(cfg, cfg.config_id if verb == "replay" else verb),
            grad_norm=None,
            rel_diff=None,
            spike_ratio=None,
            verdict=Verdict.FAILED,
            timings={"total": time.perf_counter() - self.started},
            error=error,
            finding=finding(Verdict.FAILED, cfg.mitigations) if cfg.is_hypothesis else None,
        )

    @property
    def streamed_processes(self) -> int:
        """The processes a streamed replay splits the saved ranks over (`nproc`, default 1)."""
        return self.request.how.nproc or 1

    def job_runner(self) -> JobRunner:
        """Who computes the job: this process layer by layer when streamed, Megatron-core for `backend` megatron,
        else the given runner or fresh processes."""
        if self.shard.streamed:
            from axrl_spike_replay.replay.streamed.streamed_processes import streamed_runner

            settings = replace(self.stream or StreamSettings(), read_ahead=self.shard.read_ahead)
            return streamed_runner(settings, self.streamed_processes, experts=self.shard.experts)
        if self.request.where.backend == Backend.MEGATRON:
            from axrl_spike_replay.replay.megatron_route import run_megatron_job

            return run_megatron_job
        return self.runner or run_job

    def record(self, result: ReplayResult, path: Path | None) -> str | None:
        """Hand a written result to the recorder (the job's task file, when one is open); the experiment id."""
        recorder = self.recorder
        if self.run.path is None or path is None or recorder is None:
            return None
        exp_id = recorder.replayed(self.job, result, path)
        if exp_id:
            self.log(f"{result.config_id}: logged in the task file of job {self.job} as {exp_id}")
        return exp_id


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


@contextmanager
def replay_session(
    request: ReplayRequest,
    configs: Sequence[Mapping[str, Any]],
    verb: str,
    *,
    recorder: RunRecorder | None = None,
    runner: JobRunner | None = None,
    capacity: Capacity | str | None = HERE,
    nodes: int = 1,
    checkpoint: bool | None = None,
    stream: StreamSettings | None = None,
) -> Iterator[ReplaySession]:
    """Validate the snapshot and configs against the request, then open the output dir; a failure inside is recorded
    as a failed run.

    Bad input raises before anything is written. Once the output dir exists, a failure writes a
    `replay_result.json` with verdict `failed` and the error, logs it in the task file, and raises.
    """
    what, how, backend = request.what, request.how, request.where.backend
    snapshot = what.snapshot
    check_device(str(how.device))  # what only this machine can tell; the request checked every field
    with replay_dir_for(snapshot) as (replay_dir, legacy):
        inputs = load_inputs(snapshot, replay_dir, legacy)
        base = apply_config({}, inputs.loss, inputs.routing)
        # an input the model cannot compute with refuses the step's own replay; experiments that remove it still run
        baseline_refused = input_refusal(inputs, base)
        if baseline_refused is None or not configs:
            check_configs(inputs, [base])
        try:
            found = experiments(inputs, configs, verb, what.refused if verb == "sweep" else ())
        except (ConfigError, SnapshotError) as exc:  # refused for this snapshot: an attempt the task logs all the same
            _record_refusal(recorder, request, inputs, configs, verb, str(exc))
            raise
        applied = found.applied if baseline_refused is not None and configs else [base, *found.applied]
        if backend == Backend.MEGATRON:
            from axrl_spike_replay.replay.megatron_route import check_megatron_job

            check_megatron_job(
                inputs.model, str(snapshot), mitigations=bool(configs), nproc=how.nproc, world=inputs.world_size
            )
        if how.shard == Shard.STREAMED and how.nproc is not None and how.nproc > inputs.world_size:
            raise ConfigError(
                f"`nproc`: a streamed replay splits the {inputs.world_size} saved ranks over at most "
                f"{inputs.world_size} processes, not {how.nproc}",
                "nproc",
            )
        plan = plan_layout(inputs.world_size, None if how.shard == Shard.STREAMED else how.nproc)
        planned = None
        if checkpoint is None or how.shard == Shard.AUTO:
            planned = planned_shard(
                str(snapshot), how.nproc, str(how.device), len(applied), capacity, nodes, shard=str(how.shard)
            )
        shard = with_checkpoint(choose_shard(how.shard, how.device, plan.nproc, planned), None, checkpoint)
        if shard.streamed:
            from axrl_spike_replay.replay.streamed.layer_weights import check_streamable

            if backend == Backend.MEGATRON:  # `auto` chose it: route 2 runs Megatron-core's GPTModel whole
                raise ConfigError(
                    f"{shard.reason}: only a streamed replay fits, and `backend` megatron does not stream; replay "
                    "on route 1 (`backend` torch)",
                    "backend",
                )
            check_streamable(inputs.model, inputs.precision)
            plan = plan_layout(inputs.world_size, None)  # every saved rank: full fidelity
        session = ReplaySession(inputs, plan, applied, request, shard, recorder=recorder, runner=runner, stream=stream)
        session.baseline_refused = baseline_refused
        session.refused = [(r.place, r.config, r.why) for r in found.refused]
        session.run = recorder.open_run(session.job) if recorder else RunDir(None)
        if verb == "replay":
            mitigation = [item for c in found.asked for item in mitigation_args(c)]
        else:
            mitigation = [shlex.join(mitigation_args(c)) for c in found.asked]
        layout = {
            "nproc": how.nproc,
            "device": how.device,
            "shard": how.shard if how.shard != Shard.AUTO else None,
            "backend": backend if backend != Backend.TORCH else None,
        }
        command = request.command or command_line(
            verb,
            str(snapshot),
            {
                **layout,
                "mitigation": mitigation,
                **changed_values(what, Verb.parse(verb, "verb")),  # --repeat, --clear-threshold, ... as declared
            },
        )
        # the baseline these configs ran beside, as its own command: what the task shows as the step's replay command
        baseline = command_line("replay", str(snapshot), layout) if configs else None
        session.run.write_command(command, baseline)
        session.log(f"{verb} {snapshot}" + (f" (legacy layout, read through {replay_dir})" if legacy else ""))
        session.log(shard.reason)
        try:
            yield session
        except Exception as exc:
            error = str(exc) if isinstance(exc, AxrlError) else f"{type(exc).__name__}: {exc}"
            details = getattr(exc, "details", "")
            session.log(f"failed: {error}" + (f"\n{details}" if details else ""))
            if session.run.path is None:
                raise
            result = session.failed(error, verb)
            path = session.run.write_result(result)
            _record_failure(session, error, command, path)
            raise AxrlError(f"{verb} failed: {error} (see {session.run.path})") from exc


def _record_refusal(
    recorder: RunRecorder | None,
    request: ReplayRequest,
    inputs: ReplayInputs,
    configs: Sequence[Mapping[str, Any]],
    verb: str,
    why: str,
) -> None:
    """Log a run whose every experiment this snapshot refuses (nothing ran, no output dir) as a failed attempt."""
    if recorder is None:
        return
    items = [shlex.join(mitigation_args(normal_form(c))) for c in configs]
    mitigation = items if verb == "sweep" else [i for c in configs for i in mitigation_args(normal_form(c))]
    command = request.command or command_line(verb, str(request.what.snapshot), {"mitigation": mitigation})
    job = request.job or inputs.job_name or "spike"
    recorder.failed(job, reason=f"refused: {why}", command=command, snapshot=inputs.snapshot, result_path=None)


def _record_failure(session: ReplaySession, error: str, command: str, path: Path | None) -> None:
    recorder = session.recorder
    if recorder is None:
        return
    fail_id = recorder.failed(
        session.job, reason=error, command=command, snapshot=session.inputs.snapshot, result_path=path
    )
    if fail_id:
        session.log(f"failure logged in the task file of job {session.job} as {fail_id}")


def run_replay(
    request: ReplayRequest,
    *,
    recorder: RunRecorder | None = None,
    runner: JobRunner | None = None,
    capacity: Capacity | str | None = HERE,
    nodes: int = 1,
    checkpoint: bool | None = None,
    stream: StreamSettings | None = None,
) -> ReplayResult:
    """Replay the request's snapshot at its spike step (the baseline, or with `what.mitigations`) and judge it.

    `recorder` opens the output dir and logs the run (None: nothing written); `runner` computes the job (default
    `job_runner.run_job`: fresh processes; a server passes its warm pools'); `capacity` is the memory `shard: auto`
    plans against over `nodes` nodes ("here": this machine's; None: unknown, the whole model stays); `checkpoint`
    forces checkpointed decoder layers on or off (None: as the replay plan says); `stream`: where a streamed replay
    keeps its layer boundaries (None: the defaults)."""
    config = parse_config(request.what.mitigations)
    with replay_session(
        request,
        [config] if config else [],
        "replay",
        recorder=recorder,
        runner=runner,
        capacity=capacity,
        nodes=nodes,
        checkpoint=checkpoint,
        stream=stream,
    ) as session:
        baseline, results = session.execute()
        result = results[0] if results else baseline
        path = session.run.write_result(result)
    session.record(result, path)  # after the result is complete: a logging problem cannot turn it into a failure
    return result
