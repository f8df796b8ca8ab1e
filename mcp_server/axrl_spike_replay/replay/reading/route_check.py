"""Recorded routes held to the model before they are replayed.

A routing payload is someone else's file. Replayed as it is, a payload of the wrong shape is broadcast (a
top-k width, a sequence or a batch of 1 fills the whole batch), an expert id past the model's experts fails
inside a C++ kernel on a rank, and `moe_layers` naming layers the model lacks would be accepted and the routes
applied to whichever layers come in order. Shapes and layers are checked on meta tensors before any process
starts (`check_route_shapes`, from `load_inputs`); expert ids need the values, so they are checked where a
process reads them, before its first forward (`check_route_values`). Every refusal names the file. A payload the
trainer could compute with (one expert twice in a token's top-k) is not refused: `input_checks` reports it.
"""

from __future__ import annotations

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.models.policy import RoutingShape
from axrl_spike_replay.snapshot.rank_data import RoutingPayload


def _where(payload: RoutingPayload) -> str:
    return str(payload.file) if payload.file is not None else "the routing payload"


def check_route_shapes(payload: RoutingPayload, model: RoutingShape, tokens: tuple[int, ...]) -> None:
    """SnapshotError unless the routes are [B, T, L, K] for the batch's tokens [B, T], the model's top-k K, and
    one slot per MoE layer of the model, in order (or, for a model that allows it, one per decoder layer)."""
    routes = payload.routed_experts
    batch, seq, slots, width = (int(d) for d in routes.shape)
    if (batch, seq) != tuple(tokens):
        raise SnapshotError(
            f"{_where(payload)}: routed_experts is [{batch}, {seq}, {slots}, {width}] but the batch's tokens are "
            f"{list(tokens)}; the routes must cover every sample and position (refused rather than broadcast)"
        )
    if width != model.top_k:
        raise SnapshotError(
            f"{_where(payload)}: routed_experts holds {width} experts per token but the model routes to top-k "
            f"{model.top_k} (refused rather than broadcast)"
        )
    _check_layers(payload, model, slots)


def _check_layers(payload: RoutingPayload, model: RoutingShape, slots: int) -> None:
    ours = list(model.moe_layers)
    every_layer = list(range(model.n_layers))
    if not payload.layers_listed:
        if slots == len(ours) or (model.absolute_slots and slots == model.n_layers):
            return
        per_layer = f" (or one per decoder layer, {model.n_layers})" if model.absolute_slots else ""
        raise SnapshotError(
            f"{_where(payload)}: routed_experts has {slots} layer slots but the model has {len(ours)} MoE layers "
            f"{ours}{per_layer}"
        )
    listed = payload.moe_layers
    lacking = [layer for layer in listed if layer >= model.n_layers]
    if lacking:
        raise SnapshotError(
            f"{_where(payload)}: moe_layers names layers {shown(lacking, 80)} the model lacks (it has "
            f"{model.n_layers} decoder layers)"
        )
    if listed == ours or (model.absolute_slots and listed == every_layer):
        return
    dense = [layer for layer in listed if layer not in ours]
    missing = [layer for layer in ours if layer not in listed]
    why = (
        f"{dense} are dense in the model"
        if dense
        else f"{missing} have no routes"
        if missing
        else "they are listed in another order"
    )
    raise SnapshotError(
        f"{_where(payload)}: moe_layers {shown(listed, 80)} do not match the model's MoE layers {ours} ({why})"
    )


def check_route_values(payload: RoutingPayload, model: RoutingShape, rank: int | None = None) -> None:
    """SnapshotError unless every expert id is in [0, n_experts) or -1 (no route): past the model's experts no
    computation is defined (the refusal offers the experiments that remove the routes: recompute them, drop the
    rank). A token listing one expert twice in its top-k is defined (that expert counts twice, as the trainer's
    forced routes ran it): it is reported by `input_checks`, not refused here. Reads the routes once."""
    import torch

    routes = payload.routed_experts
    if routes.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(routes))
    if low < -1 or high >= model.n_experts:
        bad = (routes < -1) | (routes >= model.n_experts)
        at = [int(i) for i in bad.nonzero()[0]]
        offer = (
            f"; replay without them: recompute=routes:rank{rank},old_logprobs:rank{rank} or drop_ranks={rank}"
            if rank is not None
            else ""
        )
        raise SnapshotError(
            f"{_where(payload)}: routed_experts holds expert id {int(routes[tuple(at)])} at [sample, position, slot, "
            f"k] = {at}; the model has {model.n_experts} experts per layer (ids 0-{model.n_experts - 1}, -1 for "
            f"none): no computation is defined on those routes{offer}"
        )
