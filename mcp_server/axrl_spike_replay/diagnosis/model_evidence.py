"""Evidence that needs the model: per-sample attribution, the per-rank signal check with the loss channel
(`replay.step_evidence`), and route agreement per MoE layer merged over the ranks (read off the signal check).

Both rebuild the snapshot's model with the replay engine (CPU, one process): attribution is one gradient
pass plus one forward-mode pass over every rank batch (see replay/attribution.py), route agreement one
no-grad forward per MoE layer. `diagnose` runs them itself only when that is cheap (a checkpoint of at
most AUTO_MODEL_BYTES that the torch engine can rebuild); otherwise it takes an attribution the caller
already has and says what it left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.result import Attribution
from axrl_spike_replay.experiment.step_evidence import SignalCheck, StepEvidence
from axrl_spike_replay.snapshot.metadata import read_json_document

AUTO_MODEL_BYTES = 256 * 1024 * 1024  # above this, a CPU pass costs minutes: ask for an attribution instead
MAX_ROUTE_LAYERS = 64  # one forward per MoE layer


@dataclass
class LayerAgreement:
    """How often the snapshot's model, routing on its own scores in this layer (the recorded routes replayed in
    the others), picks the recorded experts: fractions of routed tokens whose expert set differs."""

    layer: int
    loss_tokens: int
    other_tokens: int
    loss_disagreement: float | None
    other_disagreement: float | None


@dataclass
class RouteAgreement:
    layers: list[LayerAgreement] = field(default_factory=list)
    routing_replay: str = ""  # the run's routing replay mode (recorded routes used in training unless "off")


def read_attribution(value: Attribution | dict[str, Any] | str | Path) -> Attribution:
    """An Attribution from an object, its JSON document or an `attribution.json` path."""
    if isinstance(value, Attribution):
        return value
    doc = value if isinstance(value, dict) else read_json_document(Path(value))
    if not isinstance(doc, dict) or not isinstance(doc.get("samples"), list):
        raise AxrlError("attribution: expected an attribution.json document with `samples`")
    try:
        return Attribution.from_json(doc)  # also one written under the old figure names
    except (TypeError, KeyError, AttributeError) as exc:
        raise AxrlError(f"attribution: not an attribution document ({exc})") from None


def model_bytes(snapshot: str | Path) -> int | None:
    """The checkpoint's tensor bytes, None when unreadable."""
    from axrl_spike_replay.errors import SnapshotError
    from axrl_spike_replay.snapshot.checkpoint import summarize_checkpoint

    try:
        return summarize_checkpoint(Path(snapshot)).bytes
    except (SnapshotError, OSError):
        return None


def run_attribution(snapshot: str | Path, top: int) -> Attribution:
    """Attribute the step here (CPU, nothing written)."""
    from axrl_spike_replay.replay.attribution import attribute_spike

    return attribute_spike(snapshot, top=top)


def route_agreement(snapshot: str | Path) -> RouteAgreement:
    """Per MoE layer, the fraction of loss and non-loss tokens whose current expert set differs from the
    recorded one (the other layers replaying the recorded routes, so each layer is judged on its own)."""
    import torch

    from axrl_spike_replay.models.policy import routing_shape
    from axrl_spike_replay.models.tiny_moe import RoutingControl
    from axrl_spike_replay.replay.engine import replay_dir_for
    from axrl_spike_replay.replay.inputs import load_inputs
    from axrl_spike_replay.replay.model_build import build_model
    from axrl_spike_replay.replay.route_check import check_route_shapes, check_route_values
    from axrl_spike_replay.replay.shard_choice import check_whole_fits
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_rank_routes

    with replay_dir_for(snapshot) as (replay_dir, legacy):
        inputs = load_inputs(snapshot, replay_dir, legacy)
        result = RouteAgreement(routing_replay=inputs.routing.replay)
        if not inputs.routing_ranks:
            return result
        check_whole_fits(inputs.model, inputs.effective_precision, "cpu", "route agreement")
        model = build_model(inputs.model, replay_dir, "cpu")
        shape = routing_shape(inputs.model)
        counts: dict[int, list[int]] = {}  # layer -> [loss differ, loss total, other differ, other total]
        with torch.no_grad():
            for rank in inputs.routing_ranks:
                batch = load_rank_batch(replay_dir, rank)
                payload = load_rank_routes(replay_dir, rank, batch=batch)
                if payload is None:
                    continue
                check_route_shapes(payload, shape, tuple(batch["tokens"].shape))
                check_route_values(payload, shape)
                recorded = payload.routed_experts.long()
                loss = batch["loss_mask"] != 0
                for i, layer in enumerate(payload.moe_layers[:MAX_ROUTE_LAYERS]):
                    control = RoutingControl(routes=recorded, current_layers=frozenset({layer}))
                    chosen = model(batch["tokens"], control).routes[:, :, i, :]
                    have = (recorded[:, :, i, :] >= 0).all(dim=-1)
                    differ = (chosen.sort(dim=-1).values != recorded[:, :, i, :].sort(dim=-1).values).any(dim=-1)
                    c = counts.setdefault(layer, [0, 0, 0, 0])
                    c[0] += int((differ & have & loss).sum())
                    c[1] += int((have & loss).sum())
                    c[2] += int((differ & have & ~loss).sum())
                    c[3] += int((have & ~loss).sum())
        for layer in sorted(counts):
            d_loss, n_loss, d_other, n_other = counts[layer]
            result.layers.append(
                LayerAgreement(
                    layer,
                    n_loss,
                    n_other,
                    d_loss / n_loss if n_loss else None,
                    d_other / n_other if n_other else None,
                )
            )
        return result


def run_step_evidence(snapshot: str | Path) -> StepEvidence:
    """The signal check and the loss channel of the step, here (CPU, nothing written)."""
    from axrl_spike_replay.replay.step_evidence import step_evidence

    return step_evidence(snapshot)


def routes_of(check: SignalCheck) -> RouteAgreement:
    """The per-rank route comparison of a signal check, merged over the ranks per MoE layer (token-weighted)."""
    counts: dict[int, list[float]] = {}  # layer -> [loss differ, loss total, other differ, other total]
    for rank in check.ranks:
        for x in rank.routes:
            c = counts.setdefault(x.layer, [0.0, 0.0, 0.0, 0.0])
            c[0] += (x.loss_disagreement or 0.0) * x.loss_tokens
            c[1] += x.loss_tokens
            c[2] += (x.other_disagreement or 0.0) * x.other_tokens
            c[3] += x.other_tokens
    result = RouteAgreement(routing_replay=check.routing_replay)
    for layer in sorted(counts):
        d_loss, n_loss, d_other, n_other = counts[layer]
        result.layers.append(
            LayerAgreement(
                layer,
                int(n_loss),
                int(n_other),
                d_loss / n_loss if n_loss else None,
                d_other / n_other if n_other else None,
            )
        )
    return result
