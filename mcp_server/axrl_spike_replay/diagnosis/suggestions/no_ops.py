"""Suggestions that cannot work: an experiment whose mitigation leaves the snapshot's own config as it is
(`is_base_logprobs=old` on a run whose base is already old), or changes a term the run does not have
(a KL estimator under `kl_coef: 0`). `diagnose` drops them before it suggests anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_mitigation_args
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig

KL_KNOBS = ("kl_estimator", "kl_clamp")


def run_configs(
    snapshot: Path, not_checked: list[str]
) -> tuple[LossConfig | None, RoutingConfig | None, tuple[int, ...]]:
    """The snapshot's loss and routing configs and its MoE layers from `run_config.yaml`; (None, None, ()) with a
    line in `not_checked` when they cannot be read (suggestions are then not checked for no-ops)."""
    from axrl_spike_replay.replay.reading.inputs import read_run_config

    try:
        doc = read_run_config(snapshot)
        loss = LossConfig.from_dict(dict(doc["loss"]))
        routing = RoutingConfig.from_dict(dict(doc["routing"]))
    except (AxrlError, TypeError, ValueError) as exc:
        not_checked.append(f"suggestions against the run's own config ({exc})")
        return None, None, ()
    layers = doc.get("model", {}).get("moe_layers") if isinstance(doc.get("model"), dict) else None
    moe = tuple(int(x) for x in layers) if isinstance(layers, list) and all(isinstance(x, int) for x in layers) else ()
    return loss, routing, moe


def no_op_reason(
    item: str, loss: LossConfig | None, routing: RoutingConfig | None, moe_layers: Sequence[int] = ()
) -> str | None:
    """Why the `--mitigation` item would change nothing in this run's replay, or None when it changes something
    (or the run's config is unknown)."""
    if loss is None or routing is None:
        return None
    try:
        config = parse_mitigation_args([item])
        applied = apply_config(config, loss, routing, moe_layers)
        base = apply_config({}, loss, routing, moe_layers)
    except AxrlError:
        return None  # not judged here: the replay names what is wrong with it
    if (applied.loss, applied.routing, applied.samples, applied.weights, applied.recompute) == (
        base.loss,
        base.routing,
        base.samples,
        base.weights,
        base.recompute,
    ):
        return "it leaves the snapshot's own config as it is"
    if any(name in KL_KNOBS for name in config) and not loss.kl_coef:
        return "the run has no KL term (kl_coef 0)"
    if "current_routing_layers" in config and applied.routing.replay == "off":
        return "no recorded route is replayed (routing replay off): every layer already routes on current scores"
    return None
