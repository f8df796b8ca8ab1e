"""The experiments a diagnosis suggests, in TRL's terms on a TRL snapshot (`loss.convention: trl`).

Causes are read the same whatever the trainer; their experiments name this tool's mitigations, some of which TRL's
loss has no place for. On a TRL snapshot each is put as TRL's own objective where TRL has one (the dual clip is
TRL's two-sided `delta`; masking tokens whose ratio against the rollout leaves [0.5, 2] is TRL's rollout
correction `token_mask` with those caps), a mismatch cause gains the objectives proposed against it (GSPO's
sequence-level ratio, for token ratios that are extreme while whole sequences agree; CISPO, for a few tokens whose
ratios dominate), and a suggestion that TRL's loss would refuse is left out (the KL estimator and clamp: TRL's KL
is k3). Other conventions' experiments are returned as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from axrl_spike_replay.diagnosis.causes import Experiment
from axrl_spike_replay.diagnosis.signal_causes import REFUTE_STAYS
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.mitigations import apply_config, parse_mitigation_args
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig

_AS_TRL = {
    "ratio_outlier_mask=token": "rollout_correction=token_mask:0.5:2",
    "ratio_outlier_mask=sequence": "rollout_correction=sequence_mask:0.5:2",
}
_AGAINST_MISMATCH = (
    Experiment(
        "importance_sampling_level=sequence",
        "GSPO: one importance ratio per sequence (the geometric mean of its tokens'), so a few extreme token ratios "
        "in a sequence that agrees as a whole no longer carry the step",
        refutes=REFUTE_STAYS,
    ),
    Experiment(
        "trl_loss_type=cispo",
        "CISPO: each token's importance weight clipped (detached) at epsilon_high, its gradient kept: a few tokens "
        "whose ratios dominate are bounded",
        refutes=REFUTE_STAYS,
    ),
)


def _as_trl(item: str) -> str:
    if item in _AS_TRL:
        return _AS_TRL[item]
    name, _, value = item.partition("=")
    return f"delta={value}" if name == "dual_clip_c" else item


def in_convention(
    experiments: Sequence[Experiment], loss: LossConfig | None, routing: RoutingConfig | None
) -> list[Experiment]:
    """`experiments` as the snapshot's convention takes them (see the module doc); unchanged unless it is trl."""
    if loss is None or routing is None or loss.convention != "trl":
        return list(experiments)
    out: list[Experiment] = []
    for experiment in experiments:
        item = _as_trl(experiment.mitigation)
        if item != experiment.mitigation:
            experiment = replace(experiment, mitigation=item, why=f"{experiment.why} (TRL's form: {item})")
        try:
            apply_config(parse_mitigation_args([item]), loss, routing)
        except AxrlError:
            continue  # TRL's loss has no such setting: the replay would refuse it
        out.append(experiment)
        if item.startswith("mismatch_token_clip_max"):
            out += [e for e in _AGAINST_MISMATCH if e.mitigation not in {x.mitigation for x in experiments}]
    return out
