"""The experiments a diagnosis suggests, as the snapshot's convention takes them, and the newer objectives where
the stored log-probs point to them.

Causes are read the same whatever the trainer; their experiments name this tool's mitigations, some of which TRL's
loss has no place for. On a TRL snapshot (`loss.convention: trl`) each is put as TRL's own objective where TRL has
one (the dual clip is TRL's two-sided `delta`; masking tokens whose ratio against the rollout leaves [0.5, 2] is
TRL's rollout correction `token_mask` with those caps), and a suggestion that TRL's loss would refuse is left out
(the KL estimator and clamp: TRL's KL is k3).

On every convention, a mismatch cause's truncated IS gains the objectives proposed against that instability where
the snapshot's stored old and rollout log-probs point to them (`diagnosis.ratio_shape`): GSPO's sequence-level
ratio where token ratios are extreme but the sequences holding them agree as wholes, CISPO where a few tokens'
ratios dominate. Each is suggested only where it runs on the snapshot's config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from axrl_spike_replay.diagnosis.evidence.ratio_shape import RatioShape, few_tokens_dominate, sequences_agree
from axrl_spike_replay.diagnosis.rules.causes import Experiment
from axrl_spike_replay.diagnosis.rules.signal_families.signal_parts import REFUTE_STAYS
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_mitigation_args
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig

_AS_TRL = {
    "ratio_outlier_mask=token": "rollout_correction=token_mask:0.5:2",
    "ratio_outlier_mask=sequence": "rollout_correction=sequence_mask:0.5:2",
}


def objective_experiments(shape: RatioShape | None) -> list[Experiment]:
    """GSPO and CISPO, each where `shape` (the stored old-vs-rollout ratios) points to it, with that evidence."""
    if shape is None:
        return []
    out = []
    agree = sequences_agree(shape)
    if agree is not None:
        out.append(
            Experiment(
                "importance_sampling_level=sequence",
                f"GSPO: one importance ratio per sequence (the geometric mean of its tokens'), so a few extreme token "
                f"ratios in a sequence that agrees as a whole no longer carry the step: {agree}",
                refutes=REFUTE_STAYS,
            )
        )
    dominate = few_tokens_dominate(shape)
    if dominate is not None:
        out.append(
            Experiment(
                "trl_loss_type=cispo",
                f"CISPO: each token's importance weight clipped (detached), its gradient kept, so the few tokens "
                f"whose ratios dominate are bounded: {dominate}",
                refutes=REFUTE_STAYS,
            )
        )
    return out


def _as_trl(item: str) -> str:
    if item in _AS_TRL:
        return _AS_TRL[item]
    name, _, value = item.partition("=")
    return f"delta={value}" if name == "dual_clip_c" else item


def _runs(item: str, loss: LossConfig, routing: RoutingConfig) -> bool:
    try:
        apply_config(parse_mitigation_args([item]), loss, routing)
    except AxrlError:
        return False  # the snapshot's loss has no such setting: the replay would refuse it
    return True


def in_convention(
    experiments: Sequence[Experiment],
    loss: LossConfig | None,
    routing: RoutingConfig | None,
    shape: RatioShape | None = None,
) -> list[Experiment]:
    """`experiments` as the snapshot's convention takes them, with the objectives `shape` points to after a
    mismatch cause's truncated IS (see the module doc); unchanged without a loss and routing config."""
    if loss is None or routing is None:
        return list(experiments)
    named = {e.mitigation for e in experiments}
    out: list[Experiment] = []
    for experiment in experiments:
        if loss.convention == "trl":
            item = _as_trl(experiment.mitigation)
            if item != experiment.mitigation:
                experiment = replace(experiment, mitigation=item, why=f"{experiment.why} (TRL's form: {item})")
            if not _runs(item, loss, routing):
                continue
        out.append(experiment)
        if experiment.mitigation.startswith("mismatch_token_clip_max"):
            out += [
                e
                for e in objective_experiments(shape)
                if e.mitigation not in named and _runs(e.mitigation, loss, routing)
            ]
    return out
