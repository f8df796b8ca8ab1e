"""One replay process: load weights and its saved ranks' batches, recompute gradients per config, reduce.

Configs that differ only in the loss share one forward pass per rank batch: the loss of each config
is backpropagated from the same graph (`retain_graph`) into its own gradient buffers. Reduction and
norms use `replay.rank_step` exactly as the trainer does, so the baseline reproduces training.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from axrl_spike_replay.models.tiny_moe import TinyMoEConfig, TinyMoEPolicy, token_entropy, token_logprobs
from axrl_spike_replay.rank_processes import check_cancel
from axrl_spike_replay.replay.mitigations import AppliedConfig
from axrl_spike_replay.snapshot.checkpoint import load_model_state
from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_routing_payload
from axrl_spike_replay.training.policy_loss import policy_loss
from axrl_spike_replay.training.rank_step import global_grad_norm, param_grad_norms, reduce_gradients
from axrl_spike_replay.training.routing_replay import routing_control


@dataclass(frozen=True)
class WorkerJob:
    """Everything a replay process needs (pickled into spawned processes)."""

    replay_dir: str
    model: TinyMoEConfig
    configs: tuple[AppliedConfig, ...]
    world_size: int  # saved DP world size: the reduction always divides by it
    assignment: tuple[tuple[int, ...], ...]
    device: str = "cpu"
    repeat: int = 1
    top: int = 10


@dataclass
class ConfigOutcome:
    """One config's replayed gradients, as process 0 saw them after the reduction."""

    config_id: str
    grad_norms: list[float] = field(default_factory=list)  # one per repeat
    top_params: list[dict[str, Any]] = field(default_factory=list)
    rank_metrics: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def build_model(cfg: TinyMoEConfig, weights_dir: str, device: str) -> TinyMoEPolicy:
    """The policy with weights from a DCP checkpoint dir (a snapshot or another checkpoint)."""
    model = TinyMoEPolicy(cfg)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    load_model_state(weights_dir, state)
    model.load_state_dict(state, strict=True)
    return model.to(device)


def _to_device(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _groups(configs: Sequence[AppliedConfig]) -> list[list[AppliedConfig]]:
    """Configs grouped by weights, then by forward (routing): snapshot weights first, order kept."""
    groups: dict[tuple[Any, ...], list[AppliedConfig]] = {}
    for cfg in sorted(configs, key=lambda c: c.weights is not None):
        groups.setdefault((cfg.weights, cfg.routing), []).append(cfg)
    return list(groups.values())


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class RankInputs:
    """A process's saved ranks: batches on the device, routing payloads read on first use."""

    def __init__(self, replay_dir: str, ranks: Sequence[int], device: str) -> None:
        self.replay_dir = replay_dir
        self.device = device
        self.batches = {r: _to_device(load_rank_batch(replay_dir, r), device) for r in ranks}
        self._routes: dict[int, torch.Tensor] = {}

    def routes(self, rank: int) -> torch.Tensor:
        if rank not in self._routes:
            self._routes[rank] = load_routing_payload(self.replay_dir, rank).routed_experts.to(self.device)
        return self._routes[rank]

    def routing(self, cfg: AppliedConfig, rank: int) -> Any:
        routes = self.routes(rank) if cfg.routing.replay != "off" else None
        return routing_control(cfg.routing, self.batches[rank], routes)


def forward_group(
    model: TinyMoEPolicy, inputs: RankInputs, group: Sequence[AppliedConfig]
) -> tuple[dict[str, list[torch.Tensor | None]], dict[str, list[dict[str, Any]]]]:
    """Local (unreduced) gradients per config of a group, summed over this process's saved ranks."""
    params = list(model.parameters())
    grads: dict[str, list[torch.Tensor | None]] = {cfg.config_id: [None] * len(params) for cfg in group}
    metrics: dict[str, list[dict[str, Any]]] = {cfg.config_id: [] for cfg in group}
    entropy_needed = any(cfg.needs_entropy for cfg in group)
    for rank, batch in inputs.batches.items():
        out = model(batch["tokens"], inputs.routing(group[0], rank))
        logprobs = token_logprobs(out.logits, batch["tokens"])
        entropy = token_entropy(out.logits) if entropy_needed else None
        for i, cfg in enumerate(group):
            result = policy_loss(
                logprobs,
                batch,
                cfg.loss,
                entropy=entropy if cfg.needs_entropy else None,
                aux_loss=out.aux_loss,
                z_loss=out.z_loss,
            )
            local = torch.autograd.grad(result.loss, params, retain_graph=i < len(group) - 1, allow_unused=True)
            buffers = grads[cfg.config_id]
            for j, g in enumerate(local):
                if g is None:
                    continue
                current = buffers[j]
                if current is None:
                    buffers[j] = g
                else:
                    current.add_(g)
            metrics[cfg.config_id].append({"rank": rank, "loss": float(result.loss.detach()), **result.metrics})
    return grads, metrics


def reduce_and_measure(
    model: TinyMoEPolicy, grads: list[torch.Tensor | None], world_size: int, top: int
) -> tuple[float, list[dict[str, Any]]]:
    """Put a config's local gradients in `.grad`, reduce them as the trainer does, and measure."""
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    reduce_gradients(model, world_size)
    norm = global_grad_norm(model)
    norms = param_grad_norms(model)
    top_params = [{"name": n, "grad_norm": v} for n, v in sorted(norms.items(), key=lambda kv: -kv[1])[:top]]
    model.zero_grad(set_to_none=True)
    return norm, top_params


ModelSource = Callable[[TinyMoEConfig, str, str], TinyMoEPolicy]  # (config, weights dir, device) -> model


def compute(
    job: WorkerJob,
    process: int,
    cancel: threading.Event | None = None,
    *,
    models: ModelSource | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[ConfigOutcome]:
    """Replay every config of `job` on this process's saved ranks; outcomes in the configs' order.

    `cancel` (in-process runs only; spawned processes are stopped by their launcher) is checked
    between configs. `models` builds the policy (default `build_model`; a warm pool passes its
    weight cache); `progress` gets a line after loading and after each config.
    """
    say = progress or (lambda line: None)
    start = time.perf_counter()
    inputs = RankInputs(job.replay_dir, job.assignment[process], job.device)
    outcomes = {cfg.config_id: ConfigOutcome(cfg.config_id) for cfg in job.configs}
    load_s = time.perf_counter() - start
    say(f"process {process}: loaded {len(inputs.batches)} rank batch(es) in {load_s:.2f} s")
    model, weights = None, object()
    for group in _groups(job.configs):
        check_cancel(cancel, "replay")
        t0 = time.perf_counter()
        if group[0].weights != weights or model is None:
            weights = group[0].weights
            model = (models or build_model)(job.model, weights or job.replay_dir, job.device)
            load_s += time.perf_counter() - t0
            say(f"process {process}: weights ready in {time.perf_counter() - t0:.2f} s")
        t1 = time.perf_counter()
        for rep in range(job.repeat):
            grads, metrics = forward_group(model, inputs, group)
            for cfg in group:
                check_cancel(cancel, "replay")
                norm, top_params = reduce_and_measure(model, grads[cfg.config_id], job.world_size, job.top)
                outcome = outcomes[cfg.config_id]
                outcome.grad_norms.append(norm)
                if rep == 0:
                    outcome.top_params = top_params
                    gathered = _gather(metrics[cfg.config_id])
                    outcome.rank_metrics = sorted((m for part in gathered for m in part), key=lambda m: m["rank"])
        per_config = (time.perf_counter() - t1) / len(group)
        for cfg in group:
            outcomes[cfg.config_id].timings["compute"] = per_config
            say(f"process {process}: {cfg.config_id} computed (grad norm {outcomes[cfg.config_id].grad_norms[0]:.6g})")
    for outcome in outcomes.values():
        outcome.timings["load"] = load_s
    return [outcomes[cfg.config_id] for cfg in job.configs]
