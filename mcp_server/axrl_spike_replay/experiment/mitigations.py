"""Named replay-only mitigations, each declared once in `MITIGATIONS`: parsed from `NAME=VALUE` or YAML,
validated, normalised, applied.

A mitigation's declaration holds everything about it: its name, what it changes, its accepted values
in words, its parser (value type and range), what it does, when to try it, and the function that
applies it to the replay's loss (`LossConfig`), routing (`RoutingConfig`) or starting weights. The
server's tool descriptions, `axrl://mitigations`, the skill's mitigation catalogue and docs/mitigations.md
are all generated from it (`experiment/mitigation_catalogue.py`, `scripts/render_mitigation_catalogue.py`), and so is
what each trainer sets to make the same change in training (`settings`, see `experiment/trainer_settings.py`).
Torch-free: the server imports this module to describe its tools.

Each mitigation is off unless named in a config. A config is a mapping {name: value}; its one normal
form (`normal_form`, what `parse_config` returns) has sorted names and typed values, so two spellings of
one config compare equal; the task record and the method files keep that form, and its hash
(`workspace.changes.config_key`) is taken over `canonical` values, so 2 and 2.0 hash alike.
The training path is never touched.

Layer ids are absolute decoder layers. `current_routing_layers: first` names the model's first MoE layer
without knowing the model: its normal form is the text `first` (so `first`, `[first]` and `FIRST` hash alike,
and never like an id list: on deepseek_v3 it means layer 1, elsewhere usually 0). `apply_config` resolves it
against the snapshot's model; `AppliedConfig.resolved` holds the ids used, which results record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.recompute import Recompute, parse_recompute, recompute_of
from axrl_spike_replay.experiment.trainer_settings import (
    NO_MEGATRON_FLAG,
    TrainerSetting,
    flow,
    none,
    override,
    per_value,
    run_config_key,
    verl_kl,
    verl_rejection,
)
from axrl_spike_replay.training.loss_config import (
    KL_ESTIMATORS,
    LOGPROB_BASES,
    LOSS_AGG_MODES,
    LossConfig,
    RatioOutlierMask,
)
from axrl_spike_replay.training.routing_config import ROUTING_REPLAY_MODES, RoutingConfig
from axrl_spike_replay.training.sample_masks import SCOPES, SampleFilter, pairs_of, parse_pairs, parse_ranks
from axrl_spike_replay.untrusted_yaml import load_untrusted_yaml, read_untrusted_yaml

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


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


def _number(name: str, raw: Any) -> float:
    if isinstance(raw, bool):
        raise ConfigError(f"mitigation {name}: expected a number, got {shown(raw)}")
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise ConfigError(f"mitigation {name}: expected a number, got {shown(raw)}") from None
    else:
        raise ConfigError(f"mitigation {name}: expected a number, got {type(raw).__name__} {shown(raw)}")
    if not math.isfinite(value):
        raise ConfigError(f"mitigation {name}: expected a finite number, got {shown(raw)}")
    return value


def _positive(name: str, raw: Any) -> float:
    value = _number(name, raw)
    if value <= 0:
        raise ConfigError(f"mitigation {name}: must be > 0, got {shown(raw)}")
    return value


def _non_negative(name: str, raw: Any) -> float:
    value = _number(name, raw)
    if value < 0:
        raise ConfigError(f"mitigation {name}: must be >= 0, got {shown(raw)}")
    return value


def _above_one(name: str, raw: Any) -> float:
    value = _number(name, raw)
    if value <= 1:
        raise ConfigError(f"mitigation {name}: must be > 1, got {shown(raw)}")
    return value


def _choice(options: Sequence[str]) -> Callable[[str, Any], str]:
    def parse(name: str, raw: Any) -> str:
        text = str(raw).strip() if isinstance(raw, str) else raw
        if text not in options:
            raise ConfigError(f"mitigation {name}: must be one of {', '.join(options)}; got {shown(raw)}")
        return str(text)

    return parse


def _flag(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
        return raw.strip().lower() in _TRUE
    raise ConfigError(f"mitigation {name}: expected true or false, got {shown(raw)}")


FIRST_MOE_LAYER = "first"  # `current_routing_layers: first`: the model's first MoE layer, resolved when applied


def _names_first(item: Any) -> bool:
    return isinstance(item, str) and item.strip().strip("[]").strip().lower() == FIRST_MOE_LAYER


def _layers(name: str, raw: Any) -> list[int] | str:
    """Absolute layer ids as a sorted list, or `first` (alone: it cannot be mixed with ids)."""
    items: Sequence[Any]
    if _names_first(raw) or (isinstance(raw, (list, tuple)) and len(raw) == 1 and _names_first(raw[0])):
        return FIRST_MOE_LAYER
    if isinstance(raw, str):
        items = [part for part in re.split(r"[,\s]+", raw.strip().strip("[]")) if part]
    elif isinstance(raw, int) and not isinstance(raw, bool):
        items = [raw]
    elif isinstance(raw, (list, tuple)):
        items = raw
    else:
        raise ConfigError(f"mitigation {name}: expected MoE layer ids such as 1 or 0,1, or first, got {shown(raw)}")
    layers = set()
    for item in items:
        if _names_first(item):
            raise ConfigError(f"mitigation {name}: {FIRST_MOE_LAYER} stands alone; to add other layers, name their ids")
        try:
            layer = int(str(item).strip()) if not isinstance(item, bool) else -1
        except ValueError:
            layer = -1
        if layer < 0:
            raise ConfigError(
                f"mitigation {name}: {shown(item)} is not a layer id (an integer >= 0) nor {FIRST_MOE_LAYER}"
            )
        layers.add(layer)
    if not layers:
        raise ConfigError(f"mitigation {name}: name at least one MoE layer id")
    return sorted(layers)


def _path(name: str, raw: Any) -> str:
    if not isinstance(raw, (str, os.PathLike)) or not str(raw).strip():
        raise ConfigError(f"mitigation {name}: expected a path to a checkpoint or snapshot directory, got {shown(raw)}")
    return os.path.abspath(os.path.expanduser(str(raw).strip()))


_MASK_KEYS = tuple(f.name for f in dataclasses.fields(RatioOutlierMask))


def _ratio_mask(name: str, raw: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if raw is False or (isinstance(raw, str) and raw.strip().lower() in _FALSE):
        raise ConfigError(f"mitigation {name}: to leave it off, do not name it")
    if raw is True or (isinstance(raw, str) and raw.strip().lower() in _TRUE):
        pass  # the defaults
    elif isinstance(raw, str) and raw.strip() in ("token", "sequence"):
        doc = {"level": raw.strip()}
    elif isinstance(raw, str):
        text = raw.strip()
        if text.startswith("{"):
            loaded = load_untrusted_yaml(text, f"mitigation {name}")
            if not isinstance(loaded, dict):
                raise ConfigError(f"mitigation {name}: {shown(raw)} is not a mapping")
            doc = loaded
        else:
            for part in filter(None, (p.strip() for p in text.split(","))):
                key, sep, value = part.partition(":")
                if not sep:
                    raise ConfigError(
                        f"mitigation {name}: {shown(part)} is not KEY:VALUE (keys: {', '.join(_MASK_KEYS)})"
                    )
                doc[key.strip()] = value.strip()
    elif isinstance(raw, Mapping):
        doc = dict(raw)
    else:
        raise ConfigError(f"mitigation {name}: expected true, token, sequence or a mapping, got {shown(raw)}")
    unknown = sorted(str(key) for key in set(doc) - set(_MASK_KEYS))
    if unknown:
        raise ConfigError(f"mitigation {name}: unknown keys {shown(unknown)} (known: {', '.join(_MASK_KEYS)})")
    defaults = RatioOutlierMask()
    spec = {
        "level": _choice(("token", "sequence"))(f"{name}.level", doc.get("level", defaults.level)),
        "low": _non_negative(f"{name}.low", doc.get("low", defaults.low)),
        "high": _positive(f"{name}.high", doc.get("high", defaults.high)),
        "base": _choice(LOGPROB_BASES)(f"{name}.base", doc.get("base", defaults.base)),
    }
    try:
        RatioOutlierMask(**spec)
    except ConfigError as exc:
        raise ConfigError(f"mitigation {name}: {exc}") from None
    return dict(sorted(spec.items()))


def _loss(field_name: str, convert: Callable[[Any], Any] = float) -> Callable[[ReplaySetup, Any], ReplaySetup]:
    """Set one `LossConfig` field (numbers as floats, as the run config has them)."""

    def apply(setup: ReplaySetup, value: Any) -> ReplaySetup:
        return dataclasses.replace(setup, loss=dataclasses.replace(setup.loss, **{field_name: convert(value)}))

    return apply


def _apply_ratio_mask(setup: ReplaySetup, value: Any) -> ReplaySetup:
    low, high = float(value["low"]), float(value["high"])
    mask = RatioOutlierMask(level=value["level"], low=low, high=high, base=value["base"])
    return dataclasses.replace(setup, loss=dataclasses.replace(setup.loss, ratio_outlier_mask=mask))


def _apply_routing_replay(setup: ReplaySetup, value: Any) -> ReplaySetup:
    return dataclasses.replace(setup, routing=dataclasses.replace(setup.routing, replay=str(value)))


def resolve_layers(value: Any, moe_layers: Sequence[int]) -> tuple[int, ...]:
    """The absolute layer ids of a `current_routing_layers` value: `first` is the lowest of `moe_layers`."""
    if value != FIRST_MOE_LAYER:
        return tuple(int(v) for v in value)
    if not moe_layers:
        raise ConfigError(
            f"current_routing_layers={FIRST_MOE_LAYER} names the model's first MoE layer, and the model has none"
            " (or was not given)"
        )
    return (min(moe_layers),)


def _apply_current_routing_layers(setup: ReplaySetup, value: Any) -> ReplaySetup:
    layers = resolve_layers(value, setup.moe_layers)
    return dataclasses.replace(setup, routing=dataclasses.replace(setup.routing, current_routing_layers=layers))


def _apply_initial_model(setup: ReplaySetup, value: Any) -> ReplaySetup:
    return dataclasses.replace(setup, weights=str(value))


_OUTLIER_KEYS = ("scope", "threshold")


def _advantage_outlier(name: str, raw: Any) -> dict[str, Any]:
    """`T`, `T,scope:group`, `{threshold: T, scope: group}` -> {scope, threshold} (threshold > 0)."""
    doc: dict[str, Any]
    if isinstance(raw, Mapping):
        doc = dict(raw)
    elif isinstance(raw, str) and ":" in raw:
        doc = {}
        for part in filter(None, (p.strip() for p in raw.split(","))):
            key, sep, value = part.partition(":")
            if not sep:
                doc["threshold"] = part
                continue
            doc[key.strip()] = value.strip()
    else:
        doc = {"threshold": raw}
    unknown = sorted(str(key) for key in set(doc) - set(_OUTLIER_KEYS))
    if unknown:
        raise ConfigError(f"mitigation {name}: unknown keys {shown(unknown)} (known: {', '.join(_OUTLIER_KEYS)})")
    if "threshold" not in doc:
        raise ConfigError(f"mitigation {name}: give the threshold, e.g. {name}=5")
    return {
        "scope": _choice(SCOPES)(f"{name}.scope", doc.get("scope", "batch")),
        "threshold": _positive(f"{name}.threshold", doc["threshold"]),
    }


def _apply_advantage_outlier(setup: ReplaySetup, value: Any) -> ReplaySetup:
    samples = dataclasses.replace(
        setup.samples, outlier_threshold=float(value["threshold"]), outlier_scope=str(value["scope"])
    )
    return dataclasses.replace(setup, samples=samples)


def _apply_drop_samples(setup: ReplaySetup, value: Any) -> ReplaySetup:
    return dataclasses.replace(setup, samples=dataclasses.replace(setup.samples, drop=pairs_of(value)))


def _apply_drop_ranks(setup: ReplaySetup, value: Any) -> ReplaySetup:
    ranks = frozenset(int(v) for v in value)
    return dataclasses.replace(setup, samples=dataclasses.replace(setup.samples, drop_ranks=ranks))


def _apply_keep_ranks(setup: ReplaySetup, value: Any) -> ReplaySetup:
    ranks = frozenset(int(v) for v in value)
    return dataclasses.replace(setup, samples=dataclasses.replace(setup.samples, keep_ranks=ranks))


def _apply_recompute(setup: ReplaySetup, value: Any) -> ReplaySetup:
    return dataclasses.replace(setup, recompute=recompute_of(value))


def _ranks_id(value: Any) -> Any:
    return "-".join(f"r{v}" for v in value)


def _recompute_id(value: Any) -> Any:
    return "-".join(
        str(v)
        .replace("old_logprobs", "old")
        .replace("rollout_logprobs", "rollout")
        .replace(":rank", "r")
        .replace(":layer", "l")
        for v in value
    )


def _outlier_id(value: Any) -> Any:
    return value["threshold"] if value.get("scope") == "batch" else value


def _pairs_id(value: Any) -> Any:
    return "-".join("r{}s{}".format(*str(v).split(":")) for v in value)


def _mask_id(value: Any) -> Any:
    """Only the keys that differ from the defaults; a mask with all defaults is just the name."""
    defaults = dataclasses.asdict(RatioOutlierMask())
    return {k: v for k, v in value.items() if v != defaults[k]} or True


def _path_id(value: Any) -> Any:
    return Path(str(value)).name or "root"


MITIGATIONS: dict[str, Mitigation] = {
    m.name: m
    for m in (
        Mitigation(
            "mismatch_token_clip_max",
            "loss",
            "float C > 0",
            "truncated importance sampling against the rollout engine: per-token loss weighted by "
            "min(exp(old - rollout), C), ratio taken against the old logprobs",
            _positive,
            _loss("mismatch_token_clip_max"),
            advice=(
                Advice(
                    "mismatch",
                    "`mismatch_token_clip_max: 2` first (the standard truncated-IS fix); then 1.5 / 5 to see the "
                    "slope.",
                ),
            ),
            caveat=(
                "when the rollout and trainer logprobs agree (no mismatch) it only down-weights ordinary "
                "tokens; a cap too low biases the gradient towards the rollout policy"
            ),
            settings=(
                run_config_key("loss.mismatch_token_clip_max"),
                override(
                    "algorithm.rollout_correction.rollout_is=token "
                    "algorithm.rollout_correction.rollout_is_threshold={value}",
                    "verl's token-level truncated importance sampling in decoupled mode: the same weights",
                ),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "ratio_outlier_mask",
            "loss",
            "true | token | sequence | {level, low, high, base}",
            "mask tokens (or whole sequences, by the geometric mean) whose importance ratio against the rollout "
            "(or old) logprobs leaves [low, high]; defaults level=token low=0.5 high=2.0 base=rollout",
            _ratio_mask,
            _apply_ratio_mask,
            advice=(
                Advice(
                    "mismatch",
                    "`ratio_outlier_mask: token` (or `sequence` when whole responses are off) — masks instead of "
                    "clipping.",
                ),
            ),
            bare=True,
            id_value=_mask_id,
            caveat=(
                "when many tokens leave [low, high] it masks much of the batch (check the footprint); it "
                "hides the mismatch rather than fixing the engine"
            ),
            settings=(
                run_config_key("loss.ratio_outlier_mask"),
                TrainerSetting(
                    "verl",
                    verl_rejection,
                    "verl's rejection sampling, whose k1 bounds are on pi_rollout/pi_old: ours on pi/pi_rollout, "
                    "inverted; base old and low 0 have no verl form",
                ),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "advantage_clip",
            "loss",
            "float A > 0",
            "clamp advantages to [-A, A]",
            _positive,
            _loss("advantage_clip"),
            advice=(Advice("negative_advantages", "`advantage_clip: 1` (or the group std of advantages)."),),
            caveat=(
                "it clips every large advantage, healthy ones included; with well-normalised advantages "
                "(|A| mostly under the clip) it changes little and hides a mis-scaled reward"
            ),
            settings=(
                run_config_key("loss.advantage_clip"),
                none("verl", "no setting in verl 0.9.1: clamp the advantages where they are computed (a patch)"),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "log_ratio_clip",
            "loss",
            "float c > 0",
            "clamp the policy log-ratio to [-c, c] before exponentiating",
            _positive,
            _loss("log_ratio_clip"),
            advice=(Advice("mismatch", "`log_ratio_clip: 5` — a blunt guard against overflow in exp()."),),
            caveat="a blunt guard: it changes every token whose ratio is far from 1, healthy policy moves included",
            settings=(
                run_config_key("loss.log_ratio_clip"),
                none(
                    "verl",
                    "no setting in verl 0.9.1: compute_policy_loss_vanilla clamps the log-ratio at +-20, fixed in its "
                    "code (a patch there)",
                ),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "loss_agg_mode",
            "loss",
            " | ".join(LOSS_AGG_MODES),
            "how per-token losses reduce to the rank's loss (the denominator)",
            _choice(LOSS_AGG_MODES),
            _loss("loss_agg_mode", str),
            advice=(
                Advice(
                    "negative_advantages",
                    "`loss_agg_mode: seq-mean-token-mean` — stops long responses from dominating the token mean.",
                ),
            ),
            caveat=(
                "it changes the weighting of every sample, so the run's loss is no longer comparable with"
                " its earlier steps"
            ),
            settings=(
                run_config_key("loss.loss_agg_mode"),
                override("actor_rollout_ref.actor.loss_agg_mode={value}"),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "is_base_logprobs",
            "loss",
            " | ".join(LOGPROB_BASES),
            "which logprobs the PPO ratio is taken against",
            _choice(LOGPROB_BASES),
            _loss("is_base_logprobs", str),
            advice=(
                Advice(
                    "mismatch",
                    "`is_base_logprobs: rollout` — if the ratio against the rollout is what blows up, this shows it.",
                ),
            ),
            caveat=(
                "it changes which policy the update is importance-weighted against for the whole run, not"
                " just the spike"
            ),
            settings=(
                run_config_key("loss.is_base_logprobs"),
                per_value(
                    "verl",
                    {
                        "old": "algorithm.rollout_correction.bypass_mode=false",
                        "rollout": "algorithm.rollout_correction.bypass_mode=true",
                    },
                    "decoupled mode, verl's default, takes the PPO ratio against old_log_probs; bypass mode "
                    "against the rollout's, with verl's bypass loss",
                ),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "clip_eps_low",
            "loss",
            "float >= 0",
            "PPO clip range below 1 (ratio >= 1 - eps)",
            _non_negative,
            _loss("clip_eps_low"),
            advice=(Advice("policy_drift", "a tighter `clip_eps_low` (e.g. 0.1)."),),
            caveat="a tighter clip slows learning on every step, not only the spike",
            settings=(
                run_config_key("loss.clip_eps_low"),
                override("actor_rollout_ref.actor.clip_ratio_low={value}"),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "clip_eps_high",
            "loss",
            "float >= 0",
            "PPO clip range above 1 (ratio <= 1 + eps)",
            _non_negative,
            _loss("clip_eps_high"),
            advice=(Advice("policy_drift", "a tighter `clip_eps_high` (e.g. 0.1)."),),
            caveat="a tighter clip slows learning on every step, not only the spike",
            settings=(
                run_config_key("loss.clip_eps_high"),
                override("actor_rollout_ref.actor.clip_ratio_high={value}"),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "dual_clip_c",
            "loss",
            "float > 1",
            "dual clip: negative-advantage loss capped at -A * c",
            _above_one,
            _loss("dual_clip_c"),
            advice=(
                Advice(
                    "negative_advantages",
                    "`dual_clip_c: 3` — caps the loss of negative-advantage tokens with large ratios.",
                ),
            ),
            caveat="only negative-advantage tokens are capped; a spike from positive advantages is untouched",
            settings=(
                run_config_key("loss.dual_clip_c"),
                override("actor_rollout_ref.actor.clip_ratio_c={value}", "verl's dual clip, on by default with c = 3"),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "kl_coef",
            "loss",
            "float >= 0",
            "weight of the k3 KL penalty against the reference policy",
            _non_negative,
            _loss("kl_coef"),
            advice=(Advice("policy_drift", "`kl_coef` up."),),
            caveat="a stronger KL pull slows learning on every step",
            settings=(
                run_config_key("loss.kl_coef"),
                TrainerSetting(
                    "verl",
                    verl_kl,
                    "the KL loss against the reference policy; kl_loss_type low_var_kl is k3",
                ),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "entropy_coef",
            "loss",
            "float >= 0",
            "weight of the entropy bonus",
            _non_negative,
            _loss("entropy_coef"),
            caveat="it changes exploration for the whole run",
            settings=(
                run_config_key("loss.entropy_coef"),
                override("actor_rollout_ref.actor.entropy_coeff={value}"),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "aux_loss_coef",
            "loss",
            "float >= 0",
            "weight of the MoE load-balancing loss",
            _non_negative,
            _loss("aux_loss_coef"),
            advice=(Advice("routing", "`aux_loss_coef` up (x10) — if the router logits themselves explode."),),
            caveat="a stronger balancing loss trades model quality for balance on every step",
            settings=(
                run_config_key("loss.aux_loss_coef"),
                override(
                    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff={value}",
                    "Megatron engine: a Megatron-core TransformerConfig field",
                ),
                override(
                    "actor_rollout_ref.model.override_config.router_aux_loss_coef={value}",
                    "FSDP engine: the HF model config's field, in qwen*_moe, mixtral, olmoe",
                ),
                override("--moe-aux-loss-coeff {value}", trainer="megatron"),
            ),
        ),
        Mitigation(
            "z_loss_coef",
            "loss",
            "float >= 0",
            "weight of the router z-loss",
            _non_negative,
            _loss("z_loss_coef"),
            advice=(Advice("routing", "`z_loss_coef` up (x10) — if the router logits themselves explode."),),
            caveat="a stronger z-loss constrains the router on every step",
            settings=(
                run_config_key("loss.z_loss_coef"),
                override(
                    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff={value}",
                    "Megatron engine: a Megatron-core TransformerConfig field",
                ),
                override("--moe-z-loss-coeff {value}", trainer="megatron"),
            ),
        ),
        Mitigation(
            "routing_replay",
            "routing",
            " | ".join(ROUTING_REPLAY_MODES),
            "replay recorded expert routes on all tokens, on loss tokens only (current routing elsewhere), or off",
            _choice(ROUTING_REPLAY_MODES),
            _apply_routing_replay,
            advice=(
                Advice("routing", "`routing_replay: loss_tokens` — replay only where the loss is taken."),
                Advice(
                    "routing",
                    "`routing_replay: off` — **diagnostic only**: if the spike grows, routing replay was helping; "
                    "never write it up as a fix.",
                ),
            ),
            caveat="`off` is a diagnostic only; replaying routes the rollout engine did not use hides a routing bug",
            settings=(
                run_config_key("routing.replay"),
                per_value(
                    "verl",
                    {
                        "all": "actor_rollout_ref.actor.megatron.router_replay.mode=R3 "
                        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                        "off": "actor_rollout_ref.actor.megatron.router_replay.mode=disabled",
                    },
                    "Megatron engine: R3 replays the rollout's routes in training; verl has no loss-tokens-only mode",
                ),
                per_value(
                    "megatron",
                    {"all": "--moe-enable-routing-replay", "off": "(leave out --moe-enable-routing-replay)"},
                    "the RL trainer records the rollout's routes and hands them to the router; no loss-tokens mode",
                ),
            ),
        ),
        Mitigation(
            "current_routing_layers",
            "routing",
            "MoE layer ids (absolute decoder layers), e.g. 1 or 0,1; or first",
            "these MoE layers route on current scores while the others replay the recorded routes; `first` is "
            "the model's first MoE layer, resolved against the snapshot's model (layer 1 of deepseek_v3, whose "
            "layer 0 is dense) and recorded in the result's `resolved_mitigations`",
            _layers,
            _apply_current_routing_layers,
            advice=(
                Advice(
                    "routing",
                    "`current_routing_layers: first` — current routing in the first MoE layer, replay elsewhere "
                    "(the seed workflow's config, on any architecture).",
                ),
                Advice(
                    "routing",
                    "`current_routing_layers: [<the layer>]` — current routing in the layer that spikes, replay "
                    "elsewhere.",
                ),
            ),
            caveat="it mixes recorded and current routes; use it to locate a layer, then fix that layer's routing",
            settings=(
                TrainerSetting(
                    "axrl",
                    lambda value: (
                        None if value == FIRST_MOE_LAYER else f"routing.current_routing_layers: {flow(value)}"
                    ),
                    "layer ids; a replay resolves `first` against the model and records them as resolved_mitigations",
                ),
                none("verl", "no setting: verl replays the routes of every MoE layer alike (a patch)"),
                none("megatron", "no flag: routing replay covers every MoE layer alike (a patch)"),
            ),
        ),
        Mitigation(
            "balance_negative_advantages",
            "loss",
            "true | false",
            "scale negative advantages so their total magnitude matches the positives'",
            _flag,
            _loss("balance_negative_advantages", bool),
            advice=(Advice("negative_advantages", "`balance_negative_advantages: true`."),),
            bare=True,
            caveat=(
                "it rescales every negative advantage of the batch; when negatives are rightly dominant "
                "(a bad batch of answers) it weakens a real signal"
            ),
            settings=(
                run_config_key("loss.balance_negative_advantages"),
                none("verl", "no setting in verl 0.9.1: rescale the advantages where they are computed (a patch)"),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "advantage_outlier_mask",
            "loss",
            "float T > 0, or {threshold: T, scope: batch | group}",
            "mask whole samples whose advantage (mean over its loss tokens) is a robust outlier in the saved rank's "
            "batch (or its prompt group): |A - median| / (1.4826 * MAD) > T",
            _advantage_outlier,
            _apply_advantage_outlier,
            advice=(
                Advice(
                    "outlier_advantage",
                    "`advantage_outlier_mask: 5` — masks the few samples whose advantage is > 5 robust standard "
                    "deviations from their batch's median; `{threshold: 5, scope: group}` judges each prompt group.",
                ),
                Advice("outlier_advantage", "`advantage_clip: 1` — clamps instead of masking (keeps the sample)."),
            ),
            id_value=_outlier_id,
            caveat=(
                "when the outlier advantage is right (a rare but real reward) it throws that signal away;"
                " a threshold too low masks ordinary samples (check the footprint); fix the reward or "
                "advantage scaling where it went wrong"
            ),
            settings=(
                none(
                    "axrl",
                    "no run_config key: a replay-only sample filter; drop such samples where advantages are "
                    "computed (a patch to the trainer)",
                ),
                none("verl", "no setting in verl 0.9.1: drop such samples where advantages are computed (a patch)"),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "drop_samples",
            "loss",
            "rank:sample pairs, e.g. 0:3,1:2",
            "leave the named samples (saved rank : sample index) out of the loss — a diagnostic: is the spike "
            "those samples?",
            parse_pairs,
            _apply_drop_samples,
            advice=(
                Advice(
                    "outlier_advantage",
                    "`drop_samples: <rank:sample of attribution's top samples>` — **diagnostic only**: if leaving "
                    "them out clears the spike, the cause is in those samples; find the mechanism, never write it "
                    "up as a fix.",
                ),
            ),
            id_value=_pairs_id,
            diagnostic="it leaves hand-picked samples out of one replayed step: it locates the cause but is no rule "
            "a trainer could apply to the next batch",
            caveat="never as a fix: it names samples of one step by hand",
        ),
        Mitigation(
            "drop_ranks",
            "loss",
            "saved DP rank ids, e.g. 1 or 0,2",
            "leave every sample of the named saved ranks out of the loss (the DP mean still divides by the saved world "
            "size) — a diagnostic: is the spike that rank's batch or one of its stored signals?",
            parse_ranks,
            _apply_drop_ranks,
            advice=(
                Advice(
                    "one_rank",
                    "`drop_ranks: <the rank diagnose names>` — **diagnostic only**: if leaving that rank out clears "
                    "the spike, the cause is on that rank; then find which of its stored signals is broken.",
                ),
            ),
            id_value=_ranks_id,
            diagnostic="it leaves whole ranks of one replayed step out: it locates the cause, no trainer rule",
            caveat="never as a fix: it throws away a rank's batch",
        ),
        Mitigation(
            "keep_ranks",
            "loss",
            "saved DP rank ids, e.g. 0,2",
            "keep only the named saved ranks' samples in the loss (the others' samples left out; the DP mean still "
            "divides by the saved world size) — a diagnostic",
            parse_ranks,
            _apply_keep_ranks,
            id_value=_ranks_id,
            diagnostic="it leaves whole ranks of one replayed step out: it locates the cause, no trainer rule",
            caveat="never as a fix: it throws away the other ranks' batches",
        ),
        Mitigation(
            "recompute",
            "signals",
            "old_logprobs[:rankR] | rollout_logprobs[:rankR] | routes[:rankR][:layerL], comma-separated",
            "replace a stored signal by what the snapshot's weights give on the named ranks (every rank without "
            ":rankR): `old_logprobs` by the replay's own log-probs (the trainer's old log-probs at these weights), "
            "`rollout_logprobs` likewise (an engine that agreed with the trainer), `routes` by the model's own "
            "routing (every MoE layer without :layerL) — a diagnostic: is that stored signal the broken part?",
            parse_recompute,
            _apply_recompute,
            advice=(
                Advice(
                    "stored_signal",
                    "`recompute: old_logprobs:rank<R>` — **diagnostic only**: if the spike goes, rank R's stored old "
                    "log-probs were stale or misaligned (recompute them in the trainer at the step's weights).",
                ),
                Advice(
                    "stored_signal",
                    "`recompute: routes:rank<R>,old_logprobs:rank<R>` — **diagnostic only**: rank R routes as the "
                    "model does, with the old log-probs taken under those routes; if the spike goes, rank R's routing "
                    "payload was the broken part. Without `old_logprobs` the stored old log-probs (computed under the "
                    "recorded routes) disagree with the new routes and the spike grows whatever the payload: that "
                    "growth is no evidence for the payload.",
                ),
            ),
            id_value=_recompute_id,
            diagnostic="it replaces a stored signal of one replayed step: it says which signal is broken, the fix is "
            "in the trainer that stored it",
            caveat="never as a fix: the trainer must store the right signal",
        ),
        Mitigation(
            "kl_estimator",
            "loss",
            " | ".join(KL_ESTIMATORS),
            "the KL estimator of the KL term, as verl's `kl_penalty` computes it: k1/kl (log p - log ref), abs, "
            "k2/mse (half the squared log-ratio), k3/low_var_kl (exp(ref - logp) - (ref - logp) - 1, clamped at +-10 "
            "as verl does; the axrl convention's own k3 is unclamped), a trailing + takes k2's gradient",
            _choice(KL_ESTIMATORS),
            _loss("kl_estimator", str),
            advice=(
                Advice(
                    "kl",
                    "`kl_estimator: k2` (or `k1`) — when the KL term carries the spike through k3's exp(ref - logp) "
                    "on a few tokens: k2's gradient grows linearly in the log-ratio, k1's not at all.",
                ),
            ),
            caveat="k1's and abs's gradients ignore how far the policy is from the reference; k3 without a clamp "
            "explodes where ref - logp is tens of nats",
            settings=(
                run_config_key("loss.kl_estimator"),
                override("actor_rollout_ref.actor.kl_loss_type={value}", "verl's actor KL loss estimator"),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "kl_clamp",
            "loss",
            "float C > 0",
            "clamp each token's KL estimate to [-C, C] (a clamped token's KL has no gradient), as verl clamps k3 / "
            "low_var_kl at 10; C replaces verl's 10 and bounds the other estimators alike",
            _positive,
            _loss("kl_clamp"),
            advice=(
                Advice(
                    "kl",
                    "`kl_clamp: 10` (verl's own bound; under verl's k3 a smaller C) — when a few tokens' "
                    "exp(ref - logp) carries the KL term's gradient.",
                ),
            ),
            caveat="it silences the KL term exactly where the policy left the reference furthest",
            settings=(
                run_config_key("loss.kl_clamp"),
                none(
                    "verl",
                    "no setting in verl 0.9.1: core_algos.kl_penalty_forward clamps k3 / low_var_kl at +-10, fixed "
                    "in its code (a patch there; or kl_loss_type=low_var_kl where another estimator is used)",
                ),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "initial_model",
            "weights",
            "path to a DCP checkpoint dir or a snapshot dir",
            "replay from other weights (e.g. the run's initial model) instead of the snapshot's",
            _path,
            _apply_initial_model,
            advice=(
                Advice(
                    "from_the_start",
                    "`initial_model: <the run's initial checkpoint>` — if the spike reproduces from the initial "
                    "weights, the batch (data) is the cause, not the drifted policy.",
                ),
            ),
            id_value=_path_id,
            caveat="a diagnostic: it says whether the batch or the drifted policy causes the spike, it is no fix",
            settings=(
                none("axrl", "a diagnostic (batch or drifted policy?), no training setting"),
                none("verl", "a diagnostic (batch or drifted policy?), no training setting"),
                none("megatron", "a diagnostic (batch or drifted policy?), no training setting"),
            ),
        ),
    )
}


def valid_mitigations(docs: bool = True) -> str:
    """`name (values): doc` for every mitigation, one per line, for help; without `docs`, `name (values)` only (an
    error names what is valid; the docs are in the catalogue and the help)."""
    if not docs:
        return "\n".join(f"  {m.name} ({m.values})" for m in MITIGATIONS.values())
    return "\n".join(f"  {m.name} ({m.values}): {m.doc}" for m in MITIGATIONS.values())


def _lookup(name: str) -> Mitigation:
    key = str(name).strip()
    if key not in MITIGATIONS:
        raise ConfigError(f"unknown mitigation {shown(key)}; valid mitigations:\n{valid_mitigations(docs=False)}")
    return MITIGATIONS[key]


def parse_config(doc: Mapping[str, Any], source: str = "mitigation config") -> dict[str, Any]:
    """A config mapping {name: value} in normal form (sorted names, typed values); ConfigError on bad input."""
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{source}: expected a mapping of mitigation names to values, got {shown(doc)}")
    out: dict[str, Any] = {}
    for name, raw in doc.items():
        mitigation = _lookup(name)
        if raw is None:
            if mitigation.bare is None:
                raise ConfigError(f"{source}: mitigation {mitigation.name} needs a value ({mitigation.values})")
            raw = mitigation.bare
        out[mitigation.name] = mitigation.parse(mitigation.name, raw)
    if out.get("balance_negative_advantages") is False:
        del out["balance_negative_advantages"]  # false is the default: off
    return dict(sorted(out.items()))


_INT_RE = re.compile(r"^[+-]?\d+$")
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


def normal_form(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The one normal form of a config: sorted names, each known mitigation's value as its parser types it
    (numbers as floats, layers as sorted ints or `first`, a full ratio mask), unset entries dropped.

    `parse_config` returns it for the configs it validates; the task record and the method files store it,
    also for configs of older records that name something else (kept in `canonical` form).
    """
    out: dict[str, Any] = {}
    for name, raw in dict(config or {}).items():
        key = str(name).strip()
        value = canonical(raw)
        mitigation = MITIGATIONS.get(key)
        if mitigation is not None and value is not None:
            with contextlib.suppress(ConfigError):  # a record is kept as written, never refused
                value = mitigation.parse(key, raw)
        if value is not None and value != {} and value != []:
            out[key] = value
    return dict(sorted(out.items()))


def canonical(value: Any) -> Any:
    """A value in canonical JSON form: sorted mappings without unset entries, lists for sequences, whole floats
    as ints (2.0 == "2" -> 2), "true"/"false" as booleans. What `workspace.changes.config_key` hashes, so equal
    configs hash alike however their numbers are spelled."""
    if isinstance(value, Mapping):
        items = {str(k): canonical(v) for k, v in value.items()}
        return {k: items[k] for k in sorted(items) if items[k] is not None and items[k] != {} and items[k] != []}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        if text.lower() in ("none", "null", ""):
            return None
        if _INT_RE.match(text):
            return int(text)
        if _FLOAT_RE.match(text):
            return canonical(float(text))
        return text
    return str(value)


def parse_mitigation_args(items: Sequence[str]) -> dict[str, Any]:
    """One config from CLI `NAME[=VALUE]` items (each name at most once)."""
    doc: dict[str, Any] = {}
    for item in items:
        name, sep, value = str(item).partition("=")
        name = name.strip()
        if name in doc:
            raise ConfigError(
                f"`mitigations` {name} is given twice; give each mitigation once per config", "mitigations"
            )
        mitigation = _lookup(name)
        if not sep and mitigation.bare is None:
            raise ConfigError(f"`mitigations` {name} needs a value: {name}=VALUE ({mitigation.values})", "mitigations")
        doc[name] = value if sep else None
    return parse_config(doc, "--mitigation")


def load_mitigation_set(path: str | Path) -> list[dict[str, Any]]:
    """The configs of a mitigation-set YAML file: a list of {NAME: VALUE, ...} mappings, normalised.

    The file is untrusted YAML (no aliases, bounded size); errors name it and never echo it whole.
    """
    file = Path(path)
    try:
        is_file = file.is_file()  # a FIFO or device would block or never end
        file.stat()
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read mitigation set ({exc.strerror or exc})") from None
    if not is_file:
        raise ConfigError(f"{file}: cannot read mitigation set (not a regular file)")
    doc = read_untrusted_yaml(file, "mitigation set")
    if not isinstance(doc, list) or not doc:
        raise ConfigError(
            f"mitigation set {file}: expected a non-empty list of mitigation configs such as - {{advantage_clip: 1.0}}"
        )
    return [parse_config(item or {}, f"mitigation set {file} config {i + 1}") for i, item in enumerate(doc)]


def check_distinct(configs: Sequence[Mapping[str, Any]]) -> None:
    """ConfigError when a config is empty (that is the baseline) or two configs are the same."""
    seen: dict[str, int] = {}
    for i, config in enumerate(configs, start=1):
        if not config:
            raise ConfigError(f"config {i} sets no mitigation: that is the baseline, which every sweep runs anyway")
        key = config_id(config)
        if key in seen:
            raise ConfigError(f"configs {seen[key]} and {i} are the same after normalisation ({key})")
        seen[key] = i


def _slug(value: Any) -> str:
    if isinstance(value, dict):
        return "_".join(f"{k}-{_slug(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "-".join(_slug(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def config_id(config: Mapping[str, Any]) -> str:
    """A short, file-name-safe, stable id of a normalised config (`baseline` when empty)."""
    if not config:
        return "baseline"
    parts = []
    for name, value in config.items():
        mitigation = MITIGATIONS.get(name)
        if mitigation is not None and mitigation.id_value is not None:
            value = mitigation.id_value(value)
        parts.append(name if value is True else f"{name}={_slug(value)}")
    text = re.sub(r"[^A-Za-z0-9._=+-]+", "-", "+".join(parts)).strip("-")
    if len(text) > 80:
        digest = hashlib.sha256(repr(sorted(config.items())).encode()).hexdigest()[:10]
        text = f"{text[:68]}~{digest}"
    return text


@dataclass(frozen=True)
class AppliedConfig:
    """A config applied to the saved setup: the loss, routing and weights the replay runs with."""

    config_id: str
    mitigations: dict[str, Any]
    loss: LossConfig
    routing: RoutingConfig
    weights: str | None  # None: the snapshot's own weights
    samples: SampleFilter = field(default_factory=SampleFilter)  # samples left out of the loss
    resolved: dict[str, Any] = field(default_factory=dict)  # values named symbolically, as resolved: {name: ids}
    recompute: Recompute = field(default_factory=Recompute)  # stored signals replaced from the snapshot's weights

    @property
    def label(self) -> str:
        """How errors name this config."""
        return "the saved config" if not self.mitigations else f"config {self.config_id}"

    @property
    def forward_key(self) -> tuple[RoutingConfig, str | None, frozenset[Any]]:
        """Configs with equal keys share one forward pass (they differ in the loss only)."""
        return (self.routing, self.weights, self.recompute.routes)

    @property
    def needs_entropy(self) -> bool:
        return bool(self.loss.entropy_coef)


def apply_config(
    config: Mapping[str, Any], loss: LossConfig, routing: RoutingConfig, moe_layers: Sequence[int] = ()
) -> AppliedConfig:
    """The saved loss/routing with a normalised config's mitigations applied, each by its own declaration.

    `moe_layers`: the snapshot's model's MoE layers (absolute ids), what `current_routing_layers: first`
    resolves against (ConfigError when it is named and none are given)."""
    setup = ReplaySetup(loss=loss, routing=routing, moe_layers=tuple(moe_layers))
    for name, value in config.items():
        setup = _lookup(name).apply(setup, value)
    resolved: dict[str, Any] = {}
    if config.get("current_routing_layers") == FIRST_MOE_LAYER:
        resolved["current_routing_layers"] = list(setup.routing.current_routing_layers)
    if setup.recompute.routes and setup.routing.replay == "off":
        raise ConfigError(
            "mitigation recompute: routes are not replayed (routing replay off): every rank already routes as the "
            "model does, so there is no recorded route to recompute"
        )
    return AppliedConfig(
        config_id=config_id(config),
        mitigations=dict(config),
        loss=setup.loss,
        routing=setup.routing,
        weights=setup.weights,
        samples=setup.samples,
        resolved=resolved,
        recompute=setup.recompute,
    )


def check_current_layers(cfg: AppliedConfig, moe_layers: Iterable[int]) -> None:
    """ConfigError when the config routes a layer on current scores that is no MoE layer of the model."""
    known = set(moe_layers)
    bad = sorted(set(cfg.routing.current_routing_layers) - known)
    if bad:
        raise ConfigError(f"{cfg.label}: current_routing_layers {bad} are not MoE layers (MoE layers: {sorted(known)})")
    bad = sorted(cfg.recompute.layers() - known)
    if bad:
        raise ConfigError(f"{cfg.label}: recompute names layers {bad}, not MoE layers (MoE layers: {sorted(known)})")


def diagnostic_reasons(config: Mapping[str, Any]) -> list[str]:
    """`NAME: why` for each diagnostic-only mitigation a config uses (they are never written up as methods)."""
    found = [MITIGATIONS[name] for name in config if name in MITIGATIONS]
    return [f"{m.name}: {m.diagnostic}" for m in found if m.diagnostic]


def mitigation_args(config: Mapping[str, Any]) -> list[str]:
    """`NAME=VALUE` items that parse back to `config` (for command lines)."""
    items = []
    for name, value in config.items():
        if isinstance(value, dict):
            text = ",".join(f"{k}:{v}" for k, v in value.items())
        elif isinstance(value, list):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, bool):
            text = str(value).lower()
        else:
            text = str(value)
        items.append(f"{name}={text}")
    return items
