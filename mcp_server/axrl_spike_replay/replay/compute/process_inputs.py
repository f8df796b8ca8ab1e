"""A replay process's saved ranks and what a config's loss reads of them: batches and routes on the device, the
batch a config's loss sees, its loss, the global counts it normalises by, and configs grouped by forward."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.models.policy import RoutingShape
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.replay.reading.inputs import read_micro_batches, read_run_config
from axrl_spike_replay.replay.reading.route_check import check_route_shapes, check_route_values
from axrl_spike_replay.snapshot.layout import batch_file
from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_rank_routes
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.loss_normalization import GlobalCounts, all_reduce_counts
from axrl_spike_replay.training.micro_batches import MicroBatch, plan_micro_batches, take
from axrl_spike_replay.training.policy_loss import LossOutput, local_counts, policy_loss
from axrl_spike_replay.training.routing_replay import routing_control
from axrl_spike_replay.training.sample_masks import filtered_batch


def _to_device(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class RankInputs:
    """A process's saved ranks: batches on the device, routing payloads read on first use and held to the
    model's routing (`shape`) before they reach the device."""

    def __init__(self, replay_dir: str, ranks: Sequence[int], device: str, shape: RoutingShape) -> None:
        self.replay_dir = replay_dir
        self.device = device
        self.shape = shape
        self.batches = {r: _to_device(load_rank_batch(replay_dir, r), device) for r in ranks}
        self._routes: dict[int, torch.Tensor] = {}
        doc = read_run_config(Path(replay_dir))
        spec = read_micro_batches(Path(replay_dir), doc)
        loss = dict(doc.get("loss") or {})
        self.plans = {
            r: plan_micro_batches(batch, spec, loss, Path(replay_dir) / batch_file(r))
            for r, batch in self.batches.items()
        }

    def plan(self, rank: int) -> list[MicroBatch]:
        """Rank `rank`'s micro-batches, as the trainer split its step (`training.micro_batches`)."""
        return self.plans[rank]

    def routes(self, rank: int) -> torch.Tensor:
        if rank not in self._routes:
            payload = load_rank_routes(self.replay_dir, rank, batch=self.batches[rank])
            if payload is None:  # load_inputs checked every rank a config replays routes of has some
                raise SnapshotError(f"{self.replay_dir}: rank {rank} has no recorded routes")
            check_route_shapes(payload, self.shape, tuple(self.batches[rank]["tokens"].shape))
            check_route_values(payload, self.shape, rank)
            self._routes[rank] = payload.routed_experts.to(self.device)
        return self._routes[rank]

    def routing(self, cfg: AppliedConfig, rank: int, left_out: bool = False) -> Any:
        """The forward's routing on saved rank `rank` under `cfg`. A rank whose every route is recomputed, or that
        every config of the forward leaves out (`left_out`: nothing of it reaches the step), routes as the model
        does: its recorded routes are not read, so a payload no computation is defined on does not stop them."""
        own = cfg.recompute.route_layers(rank)  # recompute=routes: this rank routes as the model does there
        if cfg.routing.replay != "off" and (own is None or left_out):
            return RoutingControl(current_layers=frozenset(cfg.routing.current_routing_layers))
        routes = self.routes(rank) if cfg.routing.replay != "off" else None
        control = routing_control(cfg.routing, self.batches[rank], routes)
        if own is None:
            return dataclasses.replace(control, routes=None, replay_tokens=None)
        if own:
            return dataclasses.replace(control, current_layers=control.current_layers | own)
        return control


def loss_batch(
    saved: dict[str, torch.Tensor],
    rank: int,
    cfg: AppliedConfig,
    logprobs: torch.Tensor,
    mb: MicroBatch | None = None,
) -> dict[str, Any]:
    """The batch a config's loss sees on `rank`: its samples filtered (`filtered_batch`, over the rank's whole
    batch), cut to the micro-batch `mb` the forward ran (None: the whole batch) and, under
    `recompute=old_logprobs` (`rollout_logprobs`), those log-probs replaced by the forward's own (detached)."""
    batch = filtered_batch(saved, rank, cfg.samples)
    if mb is not None:
        batch = take(batch, mb)
    for name in ("old_logprobs", "rollout_logprobs"):
        if cfg.recompute.logprobs(name, rank):
            dtype = saved[name].dtype if name in saved else logprobs.dtype
            batch = {**batch, name: logprobs.detach().to(dtype)}
    return batch


def config_loss(
    out: Any, batch: dict[str, Any], cfg: AppliedConfig, rank: int, counts: GlobalCounts | None, entropy: bool = True
) -> LossOutput:
    """The loss saved rank `rank` computes under `cfg` from its forward `out` on its (filtered) `batch`: with the
    rank's own settings under a hypothesis, and without the batch-level router losses on a rank the config leaves
    out (its samples are masked by `loss_batch`: a left-out rank contributes nothing to the step)."""
    kept = cfg.samples.keeps_rank(rank)
    return policy_loss(
        out.logprobs,
        batch,
        cfg.loss_of(rank),
        entropy=out.entropy if entropy else None,
        aux_loss=out.aux_loss if kept else None,
        z_loss=out.z_loss if kept else None,
        counts=counts,
    )


def _same_mask(a: LossConfig, b: LossConfig) -> bool:
    """Whether two loss configs count the same loss tokens (rejection sampling is what changes them)."""
    keys = ("convention", "rollout_rs", "rollout_rs_threshold", "ratio_outlier_mask")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def step_counts(
    inputs: RankInputs,
    cfg: AppliedConfig,
    saved: LossConfig,
    recorded: GlobalCounts | None,
    world_size: int,
) -> GlobalCounts | None:
    """The global counts a config normalises by: the recorded ones, or, when the config leaves out other tokens
    than the saved loss (rejection sampling, masked or dropped samples) or none were recorded, recounted over
    every saved rank (a collective: every process calls it for the same configs, and each counts its own ranks)."""
    if cfg.loss.normalization != "global":
        return None
    if recorded is not None and all(_same_mask(loss, saved) for loss in cfg.losses()) and not cfg.samples.active:
        return recorded
    tokens = sequences = 0.0
    for rank, batch in inputs.batches.items():
        t, s = local_counts(filtered_batch(batch, rank, cfg.samples), cfg.loss_of(rank))
        tokens, sequences = tokens + t, sequences + s
    return all_reduce_counts(tokens, sequences, world_size)


def forward_groups(configs: Sequence[AppliedConfig]) -> list[list[AppliedConfig]]:
    """Configs grouped by weights, then by forward (routing): snapshot weights first, order kept."""
    groups: dict[tuple[Any, ...], list[AppliedConfig]] = {}
    for cfg in sorted(configs, key=lambda c: c.weights is not None):
        groups.setdefault(cfg.forward_key, []).append(cfg)
    return list(groups.values())
