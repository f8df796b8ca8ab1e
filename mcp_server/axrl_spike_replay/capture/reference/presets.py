"""Presets of the reference trainer: which burst of bad data (if any) it injects, and the config it runs with.

Torch-free: `capture --help` and the server list the presets from here without loading the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.vocabulary import CAUSE_FAMILIES

MAX_FAULT_INDEXES = 4096  # ranks or samples a fault names
FAULT_SPEC_DEPTH = 8  # a spec nests 3 levels ({"params": {"layers": [...]}}); deeper is refused before parsing


@dataclass(frozen=True)
class EngineFaults:
    """Engine bugs a preset switches on during its burst (all off by default)."""

    logprob_temperature: float | None = None  # report logprobs of logits / this while sampling at temperature
    stale_route_layer: int | None = None  # MoE layer index whose recorded routes come from a stale expert table
    route_shift: int = 0  # recorded routes moved this many tokens later than the tokens they belong to


@dataclass(frozen=True)
class FaultSpec:
    """A built-in fault of `capture.fault_injection.faults` (torch-free, so the presets list without loading torch): its
    `kind` (a key of `faults.FAULT_KINDS`), the data-parallel ranks it hits (None: every rank; negative: from the last),
    the samples of those ranks' batches (None: all) and its parameters."""

    kind: str
    ranks: tuple[int, ...] | None = None
    samples: tuple[int, ...] | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, doc: Any, source: str = "fault") -> FaultSpec:
        """A FaultSpec from its `to_dict` form; ConfigError naming `source` and the bad key otherwise (the kind
        itself is checked when the fault is built: `faults.make_fault`)."""
        if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str) or not doc["kind"]:
            raise ConfigError(f"{source}: expected a mapping with a `kind` (a fault name), got {shown(doc, 120)}")
        unknown = set(doc) - {"kind", "ranks", "samples", "params"}
        if unknown:
            raise ConfigError(
                f"{source}: unknown keys {shown(sorted(map(str, unknown)), 120)} (known: kind, ranks, samples, params)"
            )
        lists: dict[str, tuple[int, ...] | None] = {}
        for key in ("ranks", "samples"):
            value = doc.get(key)
            if value is not None and (
                not isinstance(value, list)
                or len(value) > MAX_FAULT_INDEXES
                or not all(isinstance(x, int) and not isinstance(x, bool) and abs(x) < 2**31 for x in value)
            ):
                raise ConfigError(
                    f"{source}: `{key}` must be a list of integers (at most {MAX_FAULT_INDEXES}, each below 2^31 in "
                    f"size), got {shown(value, 80)}"
                )
            lists[key] = None if value is None else tuple(value)
        params = doc.get("params") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: `params` must be a mapping, got {shown(params, 80)}")
        return cls(doc["kind"], lists["ranks"], lists["samples"], dict(params))

    def to_dict(self) -> dict[str, Any]:
        """The fault as the run config records it (`train.fault.injected`)."""
        doc: dict[str, Any] = {"kind": self.kind}
        if self.ranks is not None:
            doc["ranks"] = list(self.ranks)
        if self.samples is not None:
            doc["samples"] = list(self.samples)
        if self.params:
            doc["params"] = dict(self.params)
        return doc


@dataclass(frozen=True)
class Specialisation:
    """How the freshly initialised policy is made to behave like a trained one whose experts differ.

    A random init has near-uniform routers, experts that barely touch the residual stream and logits of
    about 0.2 nats spread, so forcing a wrong expert changes nothing measurable. Sharp routers give each
    token a clear first choice, scaled experts dominate the residual stream, and a scaled output head
    turns that into peaked next-token distributions: a wrong expert then moves log-probs by several nats.
    """

    router_std: float | None = 2.0  # routers redrawn with this std (None: left as initialised)
    expert_scale: float = 8.0  # routed experts' weights (both projections) multiplied by this
    logit_scale: float = 30.0  # output head multiplied by this


@dataclass(frozen=True)
class Preset:
    """A named fault scenario: config overrides plus what goes wrong during the burst."""

    name: str
    description: str
    loss: dict[str, Any] = field(default_factory=dict)  # overrides of the `loss:` section
    train: dict[str, Any] = field(default_factory=dict)  # overrides of the `train:` section
    faults: EngineFaults | None = None  # rollout engine bugs during the burst
    reward_penalty: float | None = None  # broken reward function during the burst: -penalty for every sample
    specialise: Specialisation | None = None  # policy made expert-sensitive at init, so a wrong expert matters
    injected: FaultSpec | None = None  # a built-in fault of `fault_injection.faults`, called at its stage of every step
    family: str | None = None  # the cause family the fault plants (the diagnosis families; see FAULT_FAMILIES)

    def fault_summary(self) -> dict[str, Any]:
        """What goes wrong during the burst, for `train.fault` in the run config."""
        doc: dict[str, Any] = {}
        if self.faults and self.faults.logprob_temperature is not None:
            doc["rollout_logprob_temperature"] = self.faults.logprob_temperature
        if self.faults and self.faults.stale_route_layer is not None:
            doc["stale_route_layer"] = self.faults.stale_route_layer
        if self.faults and self.faults.route_shift:
            doc["route_shift"] = self.faults.route_shift
        if self.reward_penalty is not None:
            doc["broken_reward_penalty"] = self.reward_penalty
        if self.injected is not None:
            doc["injected"] = self.injected.to_dict()
        return doc


# The cause families a fault plants: the diagnosis's families (a preset's `family`, the fault matrix's answer).
FAULT_FAMILIES = CAUSE_FAMILIES
LAST = (-1,)  # the last data-parallel rank (rank 1 at world size 2; rank 0 alone at world size 1)
# A policy as peaked as a trained LLM's (most sampled tokens near-certain), its routers and experts as initialised:
# a log-prob taken from the wrong token or the wrong weights is then off by nats, as in a real run.
PEAKED = Specialisation(router_std=None, expert_scale=1.0, logit_scale=8.0)
# Less peaked: more sampled tokens are unlikely ones, whose log-probs (and gradients) a wrong stored value moves.
SOFTER = Specialisation(router_std=None, expert_scale=1.0, logit_scale=4.0)

_LEGACY = (
    Preset(
        name="none",
        description="no injected fault: a healthy run",
    ),
    Preset(
        name="ratio_outliers",
        description=(
            "the trainer takes importance ratios against the rollout engine's logprobs; during the burst the "
            "engine reports logprobs at the wrong temperature (logits/0.2 while sampling at 1.0), so sampled "
            "non-argmax tokens get huge ratios and negative-advantage tokens escape the clip"
        ),
        loss={"is_base_logprobs": "rollout"},
        faults=EngineFaults(logprob_temperature=0.2),
        family="engine_mismatch",
    ),
    Preset(
        name="negative_advantage_dominance",
        description=(
            "REINFORCE with a running-mean baseline; during the burst the reward function is broken and returns "
            "a large penalty for every sample, so every advantage is strongly negative and the gradient is coherent"
        ),
        train={"advantage_estimator": "reinforce_baseline"},
        reward_penalty=10.0,
        family="negative_advantage_dominance",
    ),
    Preset(
        name="stale_routes",
        description=(
            "routing replay forces routes the rollout engine never used: during the burst the engine's routing "
            "payload is one token behind the tokens (as when the engine counts a token the trainer's sequence "
            "lacks), on a policy whose experts differ (sharp routers, experts that dominate the residual "
            "stream, peaked outputs). Under the replayed wrong experts the trainer's log-probs move by tens of "
            "nats: the k3 KL penalty against the reference policy (exp(ref - logp)) and the ratios against the "
            "rollout log-probs blow up"
        ),
        loss={"is_base_logprobs": "rollout"},
        faults=EngineFaults(route_shift=1),
        specialise=Specialisation(),
        family="routing_payload",
    ),
)

# One preset per cause family, each a trainer bug injected through `capture.fault_injection.faults` during the burst.
_FAMILY_PRESETS = (
    Preset(
        name="engine_logprob_offset",
        description=(
            "engine/trainer mismatch on every rank: the trainer takes its importance ratios against the rollout "
            "engine's log-probs, and the engine reports them one position late (it counts a BOS the trainer's "
            "sequence lacks), so every token is scored with its predecessor's log-prob"
        ),
        loss={"is_base_logprobs": "rollout"},
        injected=FaultSpec("rollout_logprob_shift"),
        specialise=PEAKED,
        family="engine_mismatch",
    ),
    Preset(
        name="stale_old_logprobs",
        description=(
            "the last rank's old log-probs are wrong: its old-log-prob worker accumulates into a buffer it never "
            "zeroes, so every old log-prob is counted twice; the PPO ratio exp(logp - 2 logp) = 1/p explodes on the "
            "unlikely sampled tokens, unclipped where the advantage is negative"
        ),
        injected=FaultSpec("logprob_scale", ranks=LAST, params={"signal": "old_logprobs", "factor": 2.0}),
        specialise=SOFTER,
        family="stale_old_logprobs",
    ),
    Preset(
        name="missing_ref_logprobs",
        description=(
            "the last rank's reference log-probs are never filled in (its reference worker skips the micro-batch and "
            "the buffer stays at zero); with the KL penalty on, the k3 term exp(ref - logp) = 1/p explodes on every "
            "unlikely sampled token"
        ),
        loss={"kl_coef": 1.0},
        injected=FaultSpec("logprob_scale", ranks=LAST, params={"signal": "ref_logprobs", "factor": 0.0}),
        specialise=PEAKED,
        family="bad_ref_logprobs",
    ),
    Preset(
        name="one_rank_routes_shifted",
        description=(
            "routing replay on a policy whose experts differ: the last rank's engine worker records its routes one "
            "token late (it counts a chat-template token the trainer's sequence lacks); the old log-probs are "
            "recomputed under the same replayed routes, so only the rollout and reference log-probs disagree"
        ),
        injected=FaultSpec("routes_shift", ranks=LAST),
        specialise=Specialisation(),
        family="routing_payload",
    ),
    Preset(
        name="reward_scale_bug",
        description=(
            "REINFORCE with a running-mean baseline; the verifier returns one sample's reward as a percentage "
            "instead of a fraction (x100), so that sample's advantage is two orders above the others'"
        ),
        train={"advantage_estimator": "reinforce_baseline"},
        injected=FaultSpec("reward_scale", ranks=LAST, samples=(3,), params={"factor": 100.0, "offset": 100.0}),
        family="outlier_advantage",
    ),
    Preset(
        name="misaligned_loss_mask",
        description=(
            "the stack keeps log-probs for the response only (zero padding elsewhere) and the last rank's loss "
            "mask starts four tokens early (another sequence's left-padding offset): it takes in the last prompt "
            "tokens, whose stored reference and old log-probs are the zero padding; the k3 KL term exp(0 - logp) "
            "and the PPO ratio against them are off there"
        ),
        injected=FaultSpec("mask_shift", ranks=LAST, params={"shift": 4}),
        specialise=PEAKED,
        family="mask_misalignment",
    ),
    Preset(
        name="length_penalty_everywhere",
        description=(
            "REINFORCE with a running-mean baseline; the response-length limit of the reward is set below every "
            "response, so every sample gets the over-length penalty (-5) and every advantage is negative"
        ),
        train={"advantage_estimator": "reinforce_baseline"},
        injected=FaultSpec("reward_penalty", params={"penalty": 5.0}),
        family="negative_advantage_dominance",
    ),
    Preset(
        name="one_rank_foreign_shard",
        description=(
            "the last rank's data loader reads a shard of another source (a replay buffer of old responses): its "
            "responses are not the policy's samples, though every stored signal scores them correctly; that rank's "
            "batch alone carries the spike"
        ),
        injected=FaultSpec("off_policy_responses", ranks=LAST),
        specialise=PEAKED,
        family="one_rank_data",
    ),
    Preset(
        name="verifier_nan",
        description="the verifier times out on one sample of the last rank and its client returns NaN as the reward",
        injected=FaultSpec("reward_nan", ranks=LAST, samples=(5,)),
        family="non_finite",
    ),
    Preset(
        name="one_rank_loss_scale",
        description=(
            "the last rank computes its loss with a loss scale of 16 the run config does not record (a setting read "
            "from one node's environment): its loss, recorded as computed, and its gradient are 16 times what the "
            "snapshot's batch and weights give; the step does not reproduce"
        ),
        injected=FaultSpec("loss_setting", ranks=LAST, params={"loss_scale": 16.0}),
        family="step_not_reproduced",
    ),
    Preset(
        name="hard_batch",
        description=(
            "no broken part: every rank's burst batch holds responses the policy finds very unlikely (as after a "
            "curriculum switch), scored by the engine and the trainer alike; the batch is simply hard"
        ),
        injected=FaultSpec("off_policy_responses"),
        specialise=PEAKED,
        family="natural_spike",
    ),
)

# Healthy runs to plant your own faults in (`capture_reference_run(..., faults=[...])`): no fault of their own.
_BASES = (
    Preset(
        name="peaked",
        description=(
            "no injected fault, on a policy as peaked as a trained LLM's: the base for a fault of your own "
            "(`capture.fault_injection.faults`) that corrupts a log-prob, a mask or the data"
        ),
        specialise=PEAKED,
    ),
    Preset(
        name="peaked_rollout_ratio",
        description=(
            "as `peaked`, with the trainer's importance ratios taken against the rollout engine's log-probs: the "
            "base for a fault of your own in the engine's log-probs"
        ),
        loss={"is_base_logprobs": "rollout"},
        specialise=PEAKED,
    ),
    Preset(
        name="peaked_kl",
        description=(
            "as `peaked`, with a KL penalty of 0.1: the base for a fault of your own in the reference log-probs"
        ),
        loss={"kl_coef": 0.1},
        specialise=PEAKED,
    ),
    Preset(
        name="reinforce_baseline",
        description=(
            "no injected fault, REINFORCE with a running-mean baseline (GRPO's group normalisation bounds one "
            "sample's advantage): the base for a fault of your own in the rewards"
        ),
        train={"advantage_estimator": "reinforce_baseline"},
    ),
    Preset(
        name="expert_sensitive",
        description=(
            "no injected fault, on a policy whose experts differ (a wrong expert moves log-probs by nats): the base "
            "for a fault of your own that corrupts the routing payload"
        ),
        specialise=Specialisation(),
    ),
)

PRESETS: dict[str, Preset] = {preset.name: preset for preset in (*_LEGACY, *_FAMILY_PRESETS, *_BASES)}
FAMILY_PRESETS: dict[str, str] = {preset.family or "": preset.name for preset in _FAMILY_PRESETS}  # family -> preset


def get_preset(name: str) -> Preset:
    """The preset called `name`; ConfigError listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"preset {name!r} is not known (known: {', '.join(PRESETS)})") from None
