"""What a replay-only mitigation declares (`Mitigation`), the setup it changes (`ReplaySetup`), and the symptoms
the catalogue groups their advice under. The declarations themselves are `experiment.mitigation.mitigation_table`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from axrl_spike_replay.experiment.mitigation.rank_scope import REQUIRED
from axrl_spike_replay.experiment.mitigation.recompute import Recompute
from axrl_spike_replay.experiment.mitigation.trainer_settings import (
    TrainerSetting,
)
from axrl_spike_replay.training.loss_config import (
    LossConfig,
)
from axrl_spike_replay.training.routing_config import RoutingConfig
from axrl_spike_replay.training.sample_masks import SampleFilter


@dataclass(frozen=True)
class ReplaySetup:
    """What a replay runs with: the loss, the routing, the weights (None: the snapshot's own) and the samples left
    out of the loss; `moe_layers` are the model's MoE layers (absolute ids), what `first` resolves against."""

    loss: LossConfig
    routing: RoutingConfig
    weights: str | None = None
    samples: SampleFilter = field(default_factory=SampleFilter)
    moe_layers: tuple[int, ...] = ()
    recompute: Recompute = field(default_factory=Recompute)


@dataclass(frozen=True)
class Advice:
    """When to try a mitigation: the symptom (a key of `SYMPTOMS`) and one catalogue bullet (markdown)."""

    symptom: str
    text: str


@dataclass(frozen=True)
class Mitigation:
    """One named knob, declared once: everything the tool, its faces and its docs know about it."""

    name: str
    target: str  # what it changes: loss | routing | weights | signals (the stored signals a replay reads)
    values: str  # the accepted values, in words (help, errors, the catalogue)
    doc: str  # what it does
    parse: Callable[[str, Any], Any]  # value type and range: (name, raw) -> value, ConfigError otherwise
    apply: Callable[[ReplaySetup, Any], ReplaySetup]  # the setup with this mitigation's normal-form value set
    advice: tuple[Advice, ...] = ()  # when to try it
    bare: Any = None  # value when given as a bare `NAME`; None: a value is required
    id_value: Callable[[Any], Any] | None = None  # how its value shows in a config id (default: the value)
    diagnostic: str | None = None  # why it is a diagnostic only (never written up as a method); None: a real fix
    caveat: str = ""  # when not to use it (method files quote it)
    settings: tuple[TrainerSetting, ...] = ()  # the same change in each trainer's own config (trainer_settings)
    # whether it can be scoped to saved ranks, `NAME=VALUE@RANKS` (experiment.mitigation.rank_scope): "" no,
    # "optional", or "required" (it has a meaning on some ranks only); a scoped config is a hypothesis, judged against
    # the recording
    per_rank: str = ""

    @property
    def production(self) -> bool:
        """Whether a trainer can keep it as its setting: no diagnostic (`diagnostic`), no hypothesis about what some
        ranks computed (`per_rank` required) and no replay from other weights (`target` weights)."""
        return self.diagnostic is None and self.per_rank != REQUIRED and self.target in ("loss", "routing")


# The symptoms the catalogue groups its advice under, in order: key -> the paragraph that opens the group.
SYMPTOMS: dict[str, str] = {
    "mismatch": "**Rollout/train mismatch** — large abs(log-ratio) between old (trainer) and rollout (inference "
    "engine) logprobs on a few tokens; attribution on those samples:",
    "negative_advantages": "**Negative-advantage dominance** — `sign_balance` far on the negative side; many "
    "long wrong answers:",
    "routing": "**Routing instability (MoE)** — router weights or one MoE layer's experts top the grad norms; "
    "routes differ between rollout and training:",
    "policy_drift": "**Policy moving too far** — ratios far from 1 on many tokens, not just mismatch outliers:",
    "outlier_advantage": "**Outlier advantage on a few samples** — attribution puts most of the norm on one or two "
    "samples whose |advantage| is far beyond the rest of their batch or group (a mis-scaled reward or advantage):",
    "from_the_start": "**Spike present from the start** — is it the batch or the drifted policy?",
    "one_rank": "**One rank carries it** — one saved rank's share of the gradient, or one rank's stored signal out "
    "of line with the replay (`diagnose` compares every stored signal per rank):",
    "stored_signal": "**A stored signal is the odd one out** — on some rank the replayed policy disagrees with one "
    "stored signal (old log-probs, routes) while the others agree with it:",
    "kl": "**The KL term carries it** — `diagnose`'s channel puts the gradient on the KL term (a wrong reference, or "
    "routes that moved the policy far from it on a few tokens):",
}
