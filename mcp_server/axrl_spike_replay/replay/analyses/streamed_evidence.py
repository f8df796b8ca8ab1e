"""Diagnose's model evidence streamed: the signal check (`step_evidence_forward.signal_check`'s figures), forward
only, one decoder layer at a time.

Three streamed forwards, each reading every decoder layer once and holding one hidden state per micro-batch (no
graph, no gradient): every saved rank's micro-batches under the run's routing (the current log-probs and
entropies, through the head as the trainer's forward computes them); the same under the model's own routing when
the run replays routes (`own`); and every rank that recorded routes, its whole batch with the recorded routes
replayed in every layer, each MoE layer also run a second time on the same input with its own routing, whose
choice is held against the recorded routes (the whole replay's forward with that one layer on its own routing
gives that layer the same input). The loss-term channel takes gradients by term and is not computed streamed, nor
are a rank's tokens tried at other offsets (`step_evidence_forward.realigned`, `RankSignals.shifted` left empty):
four more whole-batch forwards of a rank whose stored log-probs sit off, a whole-model replay's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.step_evidence import LayerRoutes, SignalCheck
from axrl_spike_replay.models.policy import PolicyOutput, routing_shape
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.analyses.step_evidence_forward import MAX_ROUTE_LAYERS, signals_of_rank
from axrl_spike_replay.replay.compute.process_inputs import RankInputs
from axrl_spike_replay.replay.reading.inputs import ReplayInputs
from axrl_spike_replay.replay.reading.route_check import check_route_shapes, check_route_values
from axrl_spike_replay.replay.streamed.boundaries import BoundaryStore, boundary_store
from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights
from axrl_spike_replay.replay.streamed.settings import StreamSettings
from axrl_spike_replay.snapshot.rank_data import load_rank_routes
from axrl_spike_replay.training.micro_batches import stitch, take, take_routing

LayerHook = Callable[[int, int, torch.Tensor], None]  # (layer, run, its input hidden states)


@dataclass
class Run:
    """One forward's batch (a micro-batch, or a rank's whole batch) and its routing."""

    batch: dict[str, Any]
    routing: Any


def forward_outputs(
    weights: StreamedWeights,
    runs: Sequence[Run],
    store: BoundaryStore,
    need_entropy: bool,
    cancel: threading.Event | None = None,
    at_layer: LayerHook | None = None,
) -> list[PolicyOutput]:
    """Each run's log-probs (and entropies) from a streamed forward holding one hidden state per run; `at_layer`
    sees each layer's input before the layer runs (the layer loaded)."""
    program, layers = weights.program, weights.n_layers
    with torch.no_grad():
        for k, run in enumerate(runs):
            store.put(("e", k), (program.embed(run.batch),))
        for layer in range(layers):
            check_cancel(cancel, "diagnosis")
            weights.load_layer(layer)
            for k, run in enumerate(runs):
                hidden = store.get(("e", k))[0]
                assert hidden is not None
                if at_layer is not None:
                    at_layer(layer, k, hidden)
                store.put(("e", k), (program.run_layer(layer, hidden, run.batch, run.routing, None).hidden,))
            weights.free_layer(layer)
        outputs = []
        for k, run in enumerate(runs):
            hidden = store.get(("e", k))[0]
            assert hidden is not None
            store.drop(("e", k))
            outputs.append(program.head(hidden, run.batch, [()] * layers, [None] * layers, need_entropy))
    return outputs


def _rank_outputs(
    weights: StreamedWeights,
    ranks: RankInputs,
    store: BoundaryStore,
    controls: dict[int, Any],
    need_entropy: bool,
    cancel: threading.Event | None,
) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Per saved rank, (log-probs, entropies) [B, T] of its micro-batches under `controls[rank]`, put back at their
    rows (`rank_micro_batches.rank_forward`'s)."""
    runs, where = [], []
    for rank, saved in ranks.batches.items():
        size = int(saved["tokens"].shape[0])
        for mb in ranks.plan(rank):
            runs.append(Run(take(saved, mb), take_routing(controls[rank], mb, size)))
            where.append(rank)
    outputs = forward_outputs(weights, runs, store, need_entropy, cancel)
    out = {}
    for rank, saved in ranks.batches.items():
        parts = [o for o, r in zip(outputs, where, strict=True) if r == rank]
        plan = ranks.plan(rank)
        size, width = int(saved["tokens"].shape[0]), int(saved["tokens"].shape[1])
        if len(plan) == 1 and plan[0].rows == tuple(range(size)) and plan[0].width == width:
            out[rank] = (parts[0].logprobs, parts[0].entropy)
            continue
        entropies = [p.entropy for p in parts if p.entropy is not None]
        entropy = stitch(entropies, plan, size, width) if len(entropies) == len(parts) else None
        out[rank] = (stitch([p.logprobs for p in parts], plan, size, width), entropy)
    return out


def _route_agreement(
    weights: StreamedWeights,
    ranks: RankInputs,
    routed: Sequence[int],
    store: BoundaryStore,
    cancel: threading.Event | None,
) -> dict[int, list[LayerRoutes]]:
    """Per saved rank in `routed`, per MoE layer: the model's own routing there against the recorded routes
    (`step_evidence_forward._rank_routes`' figures; see the module docstring)."""
    program = weights.program
    runs: list[Run] = []
    recorded: list[torch.Tensor] = []
    layer_ids: list[list[int]] = []
    owners: list[int] = []
    for rank in routed:
        batch = ranks.batches[rank]
        payload = load_rank_routes(ranks.replay_dir, rank, batch=batch)
        if payload is None:
            continue
        check_route_shapes(payload, ranks.shape, tuple(batch["tokens"].shape))
        check_route_values(payload, ranks.shape)
        routes = payload.routed_experts.long().to(batch["tokens"].device)
        runs.append(Run(batch, RoutingControl(routes=routes)))
        recorded.append(routes)
        layer_ids.append([int(x) for x in payload.moe_layers[:MAX_ROUTE_LAYERS]])
        owners.append(rank)
    found: dict[int, dict[int, LayerRoutes]] = {rank: {} for rank in owners}

    def compare(layer: int, k: int, hidden: torch.Tensor) -> None:
        if layer not in layer_ids[k]:
            return
        i = layer_ids[k].index(layer)
        batch, routes = runs[k].batch, recorded[k]
        own = RoutingControl(routes=routes, current_layers=frozenset({layer}))
        chosen = program.run_layer(layer, hidden, batch, own, None).chosen
        assert chosen is not None
        size, seq = batch["tokens"].shape[:2]
        found[owners[k]][i] = _layer_routes(layer, chosen.reshape(size, seq, -1), routes[:, :, i, :], batch)

    forward_outputs(weights, runs, store, False, cancel, compare)
    return {rank: [layers[i] for i in sorted(layers)] for rank, layers in found.items()}


def _layer_routes(layer: int, chosen: torch.Tensor, recorded: torch.Tensor, batch: dict[str, Any]) -> LayerRoutes:
    loss = batch["loss_mask"] > 0
    attended = batch["attention_mask"] > 0 if "attention_mask" in batch else torch.ones_like(loss)
    have = (recorded >= 0).all(dim=-1) & attended
    differ = (chosen.sort(dim=-1).values != recorded.sort(dim=-1).values).any(dim=-1)
    n_loss, n_other = int((have & loss).sum()), int((have & ~loss).sum())
    return LayerRoutes(
        layer=layer,
        loss_tokens=n_loss,
        other_tokens=n_other,
        loss_disagreement=int((differ & have & loss).sum()) / n_loss if n_loss else None,
        other_disagreement=int((differ & have & ~loss).sum()) / n_other if n_other else None,
    )


def streamed_signal_check(
    weights: StreamedWeights,
    ranks: RankInputs,
    routing_ranks: Sequence[int],
    cfg: AppliedConfig,
    store: BoundaryStore,
    cancel: threading.Event | None = None,
) -> SignalCheck:
    """`signal_check`'s figures, streamed (see the module docstring): per saved rank the replayed log-probs
    against every stored one, and the recorded routes per MoE layer."""
    replays = cfg.routing.replay != "off"
    result = SignalCheck(routing_replay=cfg.routing.replay, base=cfg.loss.is_base_logprobs, has_own=replays)
    current = _rank_outputs(weights, ranks, store, {r: ranks.routing(cfg, r) for r in ranks.batches}, True, cancel)
    own = None
    if replays:
        own = _rank_outputs(weights, ranks, store, dict.fromkeys(ranks.batches, RoutingControl()), False, cancel)
    routes = _route_agreement(weights, ranks, [r for r in ranks.batches if r in routing_ranks], store, cancel)
    for rank, batch in ranks.batches.items():
        logprobs, entropy = current[rank]
        signals = signals_of_rank(rank, batch, logprobs, entropy, own[rank][0] if own is not None else None)
        if rank in routing_ranks:
            signals.routes = routes.get(rank, [])
        result.ranks.append(signals)
    return result


def streamed_evidence(
    inputs: ReplayInputs,
    cfg: AppliedConfig,
    device: str,
    cancel: threading.Event | None = None,
    settings: StreamSettings | None = None,
) -> SignalCheck:
    """The signal check of a snapshot's step, streamed: its layers read one at a time from `cfg`'s weights (the
    snapshot's), in the model's own dtype as the whole check runs; boundaries held as a streamed replay holds them."""
    settings = settings or StreamSettings()
    weights = StreamedWeights(inputs.model, cfg.weights or inputs.replay_dir, device, None)
    try:
        weights.check()
        weights.load_ends()
        ranks = RankInputs(inputs.replay_dir, range(inputs.world_size), device, routing_shape(inputs.model))
        with boundary_store(settings.host_budget_bytes, settings.spill_dir, device) as store:
            return streamed_signal_check(weights, ranks, inputs.routing_ranks, cfg, store, cancel)
    finally:
        weights.close()
