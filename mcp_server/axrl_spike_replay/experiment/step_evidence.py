"""What a forward at the snapshot's weights says about the stored signals and the loss terms
(`replay.analyses.step_evidence_forward` computes it; `diagnose` judges it). Torch-free: the MCP face names these types
without loading the engine.

Signals, per saved rank (never merged): the replayed current log-probs (`current`: the policy at the snapshot's
weights under the routing the run replays) and, when the run replays recorded routes, the same policy under its own
routing (`own`), against the stored `old`, `rollout` and `ref` log-probs, and `old` against `rollout`; each pair
over the rank's loss tokens and per sample. Routes: per rank and MoE layer, how often the model's own routing in
that layer (the recorded routes replayed in the others) picks another expert set than the recorded one, on loss
and on other tokens. Data: per sample, the replayed policy's mean log-prob over its loss tokens (how likely what the
rank was fed is to the policy). Masks: per sample, the generated tokens after its last loss token (`samples_tail`).

Channel: the step's DP-mean gradient split by loss term (`policy`: the PPO ratio term with its IS weights and
clips; `kl`; `entropy`; `aux` and `z`: the router losses), each term's gradient taken by its own backward at the
same forward, in the loss's own convention; per rank, each term's part of the reduced gradient (g_term,r / W),
its norm and its share <g_term,r / W, g> / ||g||^2 (the shares over every term and rank sum to 1), the term's value
in the rank's loss, and the loss tokens that pull hardest in it (|d term / d log p_t|); and each rank's whole loss and
per-parameter norms before the mean, what its recorded loss and norms are compared with, with the ranks' gradients'
dots per parameter (the reduced norm under any per-rank scale follows from them).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

SIGNALS = ("old", "rollout", "ref")  # the stored log-prob signals
PAIRS = (
    "current_vs_old",
    "current_vs_rollout",
    "current_vs_ref",
    "old_vs_rollout",
    "own_vs_old",
    "own_vs_rollout",
    "own_vs_ref",
)
TERMS = ("policy", "kl", "entropy", "aux", "z")


@dataclass
class PairFigures:
    """One pair of log-prob signals (a - b) on one rank's loss tokens."""

    pair: str
    tokens: int
    mean_abs: float  # mean |a - b| (nats)
    max_abs: float
    outside: float  # fraction of tokens with |a - b| > ln 2 (the ratio outside [0.5, 2])
    mean: float  # signed mean of a - b
    zeros: int = 0  # tokens where b is exactly 0 (a padded value, not a log-prob) while |a| > ln 2
    samples_mean_abs: list[float | None] = field(default_factory=list)  # per sample (None: no loss token)
    samples_max_abs: list[float | None] = field(default_factory=list)


@dataclass
class LayerRoutes:
    """Recorded routes against the model's own routing in one MoE layer, on one rank."""

    layer: int
    loss_tokens: int
    other_tokens: int
    loss_disagreement: float | None  # fraction of routed loss tokens whose expert set differs
    other_disagreement: float | None


@dataclass
class RankSignals:
    rank: int
    pairs: dict[str, PairFigures] = field(default_factory=dict)
    routes: list[LayerRoutes] = field(default_factory=list)
    samples: int = 0
    # per sample, the replayed policy's mean log π over its loss tokens: how likely the rank's data is to the policy
    samples_mean_logprob: list[float | None] = field(default_factory=list)
    samples_mean_logprob_own: list[float | None] = field(default_factory=list)  # ... under the model's own routing
    # per sample, the replayed policy's mean entropy over its loss tokens: -log π of its own samples, on average
    samples_mean_entropy: list[float | None] = field(default_factory=list)
    # per sample, the tokens after its last loss token that still hold a stored rollout log-prob (a token the engine
    # generated, attended, not a 0 fill): 0 when the loss mask runs to the end of what was generated
    samples_tail: list[int] = field(default_factory=list)
    # where a stored log-prob signal sits off the policy: per signal (old, rollout, ref), {offset "+1", "-2", ...: mean
    # |log π - stored| over the stored loss tokens with the rank's tokens moved by that offset (the policy under the
    # model's own routing)}: which offset, if any, brings the stored values back onto the policy
    shifted: dict[str, dict[str, float]] = field(default_factory=dict)

    def typical_logprob(self) -> float | None:
        """The median over samples of their mean log π (None: no sample with a finite loss token)."""
        known = sorted(v for v in self.samples_mean_logprob if v is not None)
        return statistics.median(known) if known else None

    def typical_surprise(self) -> float | None:
        """The median over samples of (mean -log π - mean entropy) on loss tokens: how many nats per token less
        likely the rank's tokens are than the policy's own samples at those positions would be (0 on-policy)."""
        known = sorted(
            -lp - h
            for lp, h in zip(self.samples_mean_logprob, self.samples_mean_entropy, strict=False)
            if lp is not None and h is not None
        )
        return statistics.median(known) if known else None

    def typical_logprob_own(self) -> float | None:
        """As `typical_logprob`, under the model's own routing (None: not taken, the run replays no routes)."""
        known = sorted(v for v in self.samples_mean_logprob_own if v is not None)
        return statistics.median(known) if known else None

    def route_disagreement(self) -> float | None:
        """The rank's disagreement over its layers, loss and other tokens together (None: no routes compared)."""
        differ = total = 0.0
        for x in self.routes:
            for frac, n in ((x.loss_disagreement, x.loss_tokens), (x.other_disagreement, x.other_tokens)):
                if frac is not None and n:
                    differ, total = differ + frac * n, total + n
        return differ / total if total else None


@dataclass
class SignalCheck:
    """Every stored signal against the replay, per rank."""

    ranks: list[RankSignals] = field(default_factory=list)
    routing_replay: str = "off"  # the run's mode: `current` replays recorded routes unless "off"
    base: str = "old"  # the logprobs the run's PPO ratio is taken against
    has_own: bool = False  # whether `own_vs_*` pairs were taken (the run replays routes)

    def rank(self, rank: int) -> RankSignals | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TermRank:
    rank: int
    grad_norm: float  # ||g_term,r|| / W: this rank's part of the term in the reduced gradient
    share: float  # <g_term,r, g> / (W ||g||^2)
    value: float | None = None  # the term's value in the rank's loss (None: not recorded)


@dataclass
class TermFigures:
    term: str
    coef: float
    grad_norm: float  # ||sum_r g_term,r|| / W
    share: float  # <g_term, g> / ||g||^2
    ranks: list[TermRank] = field(default_factory=list)
    top_tokens: list[dict[str, Any]] = field(default_factory=list)  # rank, sample, position, pull
    top_samples: list[dict[str, Any]] = field(default_factory=list)  # rank, sample, share of the term's pull


@dataclass
class LossChannel:
    """The spike's gradient by loss term, per rank."""

    grad_norm: float
    terms: list[TermFigures] = field(default_factory=list)
    sum_rel_error: float = 0.0  # ||sum of the terms' gradients - g|| / ||g||
    # each saved rank's whole loss as the replay computes it ({rank, loss}): what its recorded loss is compared with
    rank_losses: list[dict[str, Any]] = field(default_factory=list)
    # each saved rank's per-parameter norms of its own whole-loss gradient, before the data-parallel mean ({rank,
    # norms: {name: norm}}): what its recorded per-parameter norms are compared with (empty: not computed)
    rank_param_norms: list[dict[str, Any]] = field(default_factory=list)
    # per parameter, the dots <g_r, g_q> of the ranks' own gradients ({"ranks": [r...], "params": {name: W x W}}):
    # enough to compute the reduced norm under any per-rank, per-parameter scale (empty: not computed)
    param_gram: dict[str, Any] = field(default_factory=dict)

    def param_norms_of(self, rank: int) -> dict[str, float] | None:
        """Saved rank `rank`'s replayed per-parameter norms before the mean (None: not computed)."""
        row = next((x for x in self.rank_param_norms if x.get("rank") == rank), None)
        return None if row is None else {str(k): float(v) for k, v in row["norms"].items()}

    def rank_loss(self, rank: int) -> float | None:
        """Saved rank `rank`'s replayed whole loss (None: not recorded)."""
        return next((float(x["loss"]) for x in self.rank_losses if x.get("rank") == rank), None)

    def term(self, name: str) -> TermFigures | None:
        return next((t for t in self.terms if t.term == name), None)

    @property
    def carrier(self) -> TermFigures | None:
        """The term with the largest share of the gradient."""
        return max(self.terms, key=lambda t: t.share, default=None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepEvidence:
    """Both, from one load of the model."""

    signals: SignalCheck
    channel: LossChannel | None
    seconds: float = 0.0
