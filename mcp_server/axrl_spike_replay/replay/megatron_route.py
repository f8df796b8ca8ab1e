"""Replay route 2: a Megatron snapshot's spike step recomputed by Megatron-core's own GPTModel (the `megatron` extra).

One gloo process per saved data-parallel rank builds the GPTModel from the snapshot's `model:` section (TP=PP=EP=1,
local spec: the CPU route; a GPU node runs the trainer's spec), loads the checkpoint with Megatron's own
`dist_checkpointing.load` (which reshards from the saved TP/PP/EP layout), forces the rank's recorded routes
through Megatron's router replay (`RouterReplay`, REPLAY_FORWARD), takes the log-probs and the snapshot's loss
(`training.policy_loss`, as route 1 does), backpropagates and reduces as the trainer did (the data-parallel mean).
The baseline grad norm is then judged against the recorded one as the torch engine judges route 1.

It answers the cross-check: route 1 (the transformers model) and route 2 must give the same grad norm. Mitigations
and sweeps run on route 1.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.megatron_config import MegatronModelConfig


@dataclass(frozen=True)
class MegatronReplay:
    """Route 2's baseline: the recomputed global grad norm against the recorded one, per-rank losses and the
    per-parameter norms under Megatron's own parameter names."""

    snapshot: str
    grad_norm: float
    recorded_grad_norm: float
    rel_diff: float
    rank_losses: dict[int, float] = field(default_factory=dict)
    param_grad_norms: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    megatron_version: str = ""


def replay_with_megatron(snapshot: str | Path, *, timeout_s: float = 600.0) -> MegatronReplay:
    """Recompute the snapshot's spike step with megatron-core's GPTModel (baseline, saved routing and loss)."""
    from axrl_spike_replay.models.megatron_cpu import megatron_core_version, megatron_unavailable_reason
    from axrl_spike_replay.rank_processes import spawn_ranks
    from axrl_spike_replay.replay.engine import replay_dir_for
    from axrl_spike_replay.replay.inputs import load_inputs
    from axrl_spike_replay.temp_janitor import owned_temp_dir

    reason = megatron_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"replay route 2 needs megatron-core: {reason}")
    started = time.perf_counter()
    with replay_dir_for(snapshot) as (replay_dir, legacy):
        inputs = load_inputs(snapshot, replay_dir, legacy)
        if not isinstance(inputs.model, MegatronModelConfig):
            raise ConfigError(f"{snapshot}: model kind is not megatron; route 2 replays Megatron snapshots")
        if inputs.loss.entropy_coef:
            raise ConfigError("route 2 does not compute the entropy term yet (loss.entropy_coef); replay on route 1")
        with owned_temp_dir("axrl-megatron-route-") as tmp:
            out = Path(tmp) / "result.json"
            payload = (replay_dir, inputs.model.to_dict(), inputs.loss, inputs.routing, inputs.counts, str(out))
            spawn_ranks(_replay_rank, inputs.world_size, payload, timeout_s=timeout_s, label="megatron replay")
            doc = json.loads(out.read_text())
    recorded = inputs.metadata.grad_norm
    norm = float(doc["grad_norm"])
    return MegatronReplay(
        snapshot=str(snapshot),
        grad_norm=norm,
        recorded_grad_norm=recorded,
        rel_diff=abs(norm - recorded) / abs(recorded) if recorded and math.isfinite(recorded) else math.inf,
        rank_losses={int(k): float(v) for k, v in doc["rank_losses"].items()},
        param_grad_norms=dict(doc["param_grad_norms"]),
        seconds=time.perf_counter() - started,
        megatron_version=megatron_core_version() or "",
    )


def _replay_rank(rank: int, world: int, payload: tuple[str, dict[str, Any], Any, Any, Any, str]) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from axrl_spike_replay.atomic import atomic_write_json
    from axrl_spike_replay.models.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.megatron_gpt import MegatronParallel, build_gpt_model, init_parallel
    from axrl_spike_replay.models.megatron_policy import force_routes, install_trace, megatron_logprobs
    from axrl_spike_replay.snapshot.megatron_routes import to_router_replay
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_rank_routes
    from axrl_spike_replay.training.policy_loss import policy_loss
    from axrl_spike_replay.training.rank_step import global_grad_norm, param_grad_norms, reduce_gradients

    replay_dir, section, loss, routing, counts, out = payload
    spec = MegatronModelConfig.from_dict(section)
    with megatron_on_cpu():
        init_parallel(MegatronParallel())
        model = build_gpt_model(spec)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), replay_dir), strict=False)
        trace = install_trace(model)
        batch = load_rank_batch(replay_dir, rank)
        forced = None
        if routing.replay != "off":
            recorded = load_rank_routes(replay_dir, rank, batch=batch)
            if recorded is None:
                raise ConfigError(f"{replay_dir}: rank {rank} has no recorded routes (routing.replay {routing.replay})")
            routes = recorded.routed_experts.long()
            if routing.replay == "loss_tokens":
                routes = torch.where(batch["loss_mask"][..., None, None] > 0, routes, torch.full_like(routes, -1))
            for layer in routing.current_routing_layers:
                routes[:, :, recorded.moe_layers.index(layer)] = -1
            forced = dict(zip(recorded.moe_layers, to_router_replay(routes), strict=True))
        force_routes(model, forced)
        result = megatron_logprobs(model, trace, batch, spec.temperature)
        loss_out = policy_loss(
            result.logprobs, batch, loss, aux_loss=result.aux_loss, z_loss=result.z_loss, counts=counts
        )
        loss_out.loss.backward()
        reduce_gradients(model, world)
        losses: list[Any] = [None] * world
        dist.all_gather_object(losses, float(loss_out.loss.detach()))
        if rank == 0:
            atomic_write_json(
                Path(out),
                {
                    "grad_norm": global_grad_norm(model),
                    "rank_losses": {str(r): v for r, v in enumerate(losses)},
                    "param_grad_norms": param_grad_norms(model),
                },
            )
