"""Replay route 2: a Megatron snapshot's spike step recomputed by Megatron-core's own GPTModel (the `megatron` extra).

`backend: megatron` of a replay request. The engine (`replay.engine`) validates the snapshot, opens the run dir,
judges the verdict and records the run as for the torch backend; only the job runner differs: `run_megatron_job`
starts one gloo process per saved data-parallel rank, each building the GPTModel from the snapshot's `model:`
section (TP=PP=EP=1, local spec: the CPU route; a GPU node runs the trainer's spec), loading the checkpoint with
Megatron's own `dist_checkpointing.load` (which reshards from the saved TP/PP/EP layout; every pickle in the checkpoint
read weights-only, `snapshot.trainer_formats.megatron_load`), forcing the rank's
recorded routes through Megatron's router replay (`RouterReplay`, REPLAY_FORWARD), taking the log-probs and the
snapshot's loss (`training.policy_loss`, as route 1 does) micro-batch by micro-batch as the trainer split and
scaled them (`training.micro_batches`), backpropagating and reducing as the trainer did (the data-parallel mean).

It is the cross-check of route 1 (the transformers model): the two must give the same grad norm. Mitigations,
sweeps and attribution run on route 1; `check_megatron_job` refuses them here by name.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob

ROUTE_1 = "the built-in `backend` torch (route 1: the transformers model)"


def megatron_unavailable() -> str | None:
    """Why route 2 cannot run here (megatron-core missing or an unchecked release), or None."""
    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_unavailable_reason

    return megatron_unavailable_reason()


def check_megatron_job(model: Any, snapshot: str, *, mitigations: bool, nproc: int | None, world: int) -> None:
    """ConfigError naming what route 2 cannot do for this snapshot and request, before anything is written."""
    if not isinstance(model, MegatronModelConfig):
        from axrl_spike_replay.models.hf_config import HFModelConfig

        kind = "hf" if isinstance(model, HFModelConfig) else "tiny_moe"
        raise ConfigError(
            f"`backend` megatron replays snapshots of Megatron-core trainers (model kind megatron); {snapshot} "
            f"holds a model of kind {kind}: replay it with {ROUTE_1}",
            "backend",
        )
    if mitigations:
        raise ConfigError(f"`backend` megatron replays the baseline; mitigations run on {ROUTE_1}", "backend")
    if nproc is not None and nproc != world:
        raise ConfigError(
            f"`nproc` {nproc}: `backend` megatron runs one process per saved data-parallel rank ({world}); "
            "leave `nproc` out",
            "nproc",
        )
    reason = megatron_unavailable()
    if reason is not None:
        raise ConfigError(f"`backend` megatron needs megatron-core: {reason}", "backend")


def run_megatron_job(
    job: WorkerJob,
    timeout_s: float = RUN_TIMEOUT_S,
    cancel: threading.Event | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    slot: int = 0,
) -> list[ConfigOutcome]:
    """The baseline outcome of `job` computed by Megatron-core's GPTModel (a `replay.jobs.job_runner.JobRunner`)."""
    from axrl_spike_replay.files.temp_janitor import owned_temp_dir
    from axrl_spike_replay.processes.rank_processes import spawn_ranks

    del slot  # one pool: route 2 replays the baseline only
    (baseline,) = job.configs
    model = job.model
    if not isinstance(model, MegatronModelConfig):  # check_megatron_job said so already; this narrows the type
        raise ConfigError("`backend` megatron replays snapshots of Megatron-core trainers", "backend")
    if baseline.loss.entropy_coef:
        raise ConfigError(
            f"`backend` megatron does not compute the entropy term (loss.entropy_coef); replay on {ROUTE_1}",
            "backend",
        )
    outcome = ConfigOutcome(config_id=baseline.config_id)
    with owned_temp_dir("axrl-megatron-route-") as tmp:
        for rep in range(job.repeat):
            out = Path(tmp) / f"result{rep}.json"
            payload = (job.replay_dir, model.to_dict(), baseline, job.counts, job.top, str(out))
            if progress is not None:
                progress(f"megatron-core: {job.world_size} process(es), repeat {rep + 1} of {job.repeat}")
            spawn_ranks(_replay_rank, job.world_size, payload, timeout_s=timeout_s, label="megatron", cancel=cancel)
            doc = json.loads(out.read_text())
            outcome.grad_norms.append(float(doc["grad_norm"]))
            if rep == 0:
                outcome.top_params = doc["top_params"]
                outcome.rank_metrics = doc["rank_metrics"]
                outcome.timings = {k: float(v) for k, v in doc["timings"].items()}
    return [outcome]


def _replay_rank(rank: int, world: int, payload: tuple[str, dict[str, Any], Any, Any, int, str]) -> None:
    """One saved data-parallel rank's forward and backward on Megatron-core's GPTModel; rank 0 writes the result."""
    import torch
    import torch.distributed as dist

    from axrl_spike_replay.files.atomic import atomic_write_json
    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.mcore.megatron_gpt import MegatronParallel, build_gpt_model, init_parallel
    from axrl_spike_replay.models.mcore.megatron_policy import force_routes, install_trace, megatron_logprobs
    from axrl_spike_replay.models.tiny_moe import RoutingControl
    from axrl_spike_replay.replay.compute.rank_passes import rank_step_metrics
    from axrl_spike_replay.replay.reading.inputs import read_micro_batches
    from axrl_spike_replay.snapshot.layout import batch_file
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_rank_routes
    from axrl_spike_replay.snapshot.trainer_formats.megatron_load import load_megatron_model
    from axrl_spike_replay.snapshot.trainer_formats.megatron_routes import to_router_replay
    from axrl_spike_replay.training.micro_batches import plan_micro_batches, take, take_routing
    from axrl_spike_replay.training.policy_loss import policy_loss
    from axrl_spike_replay.training.rank_step import global_grad_norm, param_grad_norms, reduce_gradients

    replay_dir, section, baseline, counts, top, out = payload
    routing, loss = baseline.routing, baseline.loss
    spec = MegatronModelConfig.from_dict(section)
    with megatron_on_cpu():
        t0 = time.perf_counter()
        init_parallel(MegatronParallel())
        model = build_gpt_model(spec)
        load_megatron_model(model, replay_dir)
        trace = install_trace(model)
        batch = load_rank_batch(replay_dir, rank)
        routes, layers = None, []
        if routing.replay != "off":
            recorded = load_rank_routes(replay_dir, rank, batch=batch)
            if recorded is None:
                raise ConfigError(f"{replay_dir}: rank {rank} has no recorded routes (routing.replay {routing.replay})")
            routes = recorded.routed_experts.long()
            if routing.replay == "loss_tokens":
                routes = torch.where(batch["loss_mask"][..., None, None] > 0, routes, torch.full_like(routes, -1))
            for layer in routing.current_routing_layers:
                routes[:, :, recorded.moe_layers.index(layer)] = -1
            layers = recorded.moe_layers
        plan = plan_micro_batches(
            batch, read_micro_batches(Path(replay_dir)), loss.to_dict(), Path(replay_dir) / batch_file(rank)
        )
        t1 = time.perf_counter()
        results = []
        for mb in plan:  # the trainer's micro-batches, each loss scaled as it scaled it (`training.micro_batches`)
            forced = None
            if routes is not None:
                cut = take_routing(RoutingControl(routes=routes), mb, int(batch["tokens"].shape[0])).routes
                forced = dict(zip(layers, to_router_replay(cut), strict=True))
            force_routes(model, forced)
            part = take(batch, mb)
            result = megatron_logprobs(model, trace, part, spec.temperature)
            loss_out = policy_loss(
                result.logprobs, part, loss, aux_loss=result.aux_loss, z_loss=result.z_loss, counts=counts
            )
            (loss_out.loss * mb.scale if mb.scale != 1.0 else loss_out.loss).backward()
            results.append((loss_out, mb.scale))
        reduce_gradients(model, world)
        norm = global_grad_norm(model)
        t2 = time.perf_counter()
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, {"rank": rank, **rank_step_metrics(results)})
        if rank == 0:
            norms = sorted(param_grad_norms(model).items(), key=lambda kv: -kv[1])[:top]
            atomic_write_json(
                Path(out),
                {
                    "grad_norm": norm,
                    "top_params": [{"name": n, "grad_norm": v} for n, v in norms],
                    "rank_metrics": rows,
                    "timings": {"load": t1 - t0, "compute": t2 - t1},
                },
            )
