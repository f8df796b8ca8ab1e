"""Presets of the reference trainer: which burst of bad data (if any) it injects, and the config it runs with.

Torch-free: `capture --help` and the server list the presets from here without loading the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from axrl_spike_replay.errors import ConfigError


@dataclass(frozen=True)
class EngineFaults:
    """Engine bugs a preset switches on during its burst (all off by default)."""

    logprob_temperature: float | None = None  # report logprobs of logits / this while sampling at temperature
    stale_route_layer: int | None = None  # MoE layer index whose recorded routes come from a stale expert table
    route_shift: int = 0  # recorded routes moved this many tokens later than the tokens they belong to


@dataclass(frozen=True)
class Specialisation:
    """How the freshly initialised policy is made to behave like a trained one whose experts differ.

    A random init has near-uniform routers, experts that barely touch the residual stream and logits of
    about 0.2 nats spread, so forcing a wrong expert changes nothing measurable. Sharp routers give each
    token a clear first choice, scaled experts dominate the residual stream, and a scaled output head
    turns that into peaked next-token distributions: a wrong expert then moves log-probs by several nats.
    """

    router_std: float = 2.0  # routers redrawn with this std
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
        return doc


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
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
        ),
        Preset(
            name="negative_advantage_dominance",
            description=(
                "REINFORCE with a running-mean baseline; during the burst the reward function is broken and returns "
                "a large penalty for every sample, so every advantage is strongly negative and the gradient is coherent"
            ),
            train={"advantage_estimator": "reinforce_baseline"},
            reward_penalty=10.0,
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
        ),
    )
}


def get_preset(name: str) -> Preset:
    """The preset called `name`; ConfigError listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"preset {name!r} is not known (known: {', '.join(PRESETS)})") from None
