"""The loss settings of a run (`run_config.yaml`'s `loss:` section plus the replay-only knobs). Torch-free: the
mitigation registry and the server read them without loading the training math (`policy_loss`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from axrl_spike_replay.display import shown, shown_names
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.training.trl_settings import TrlSettings
from axrl_spike_replay.training.verl_settings import (
    ROLLOUT_IS_LEVELS,
    VERL_VERSION,
    RejectionOption,
    parse_is_threshold,
    parse_rs,
)

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
LOGPROB_BASES = ("old", "rollout")
# the policy objective under the axrl and verl conventions (verl's policy_loss.loss_mode; training/policy_objectives)
POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo", "sapo")
# whose loss a replay computes: this tool's own, verl's (VERL_VERSION) or TRL's GRPOTrainer (TRL_VERSION)
CONVENTIONS = ("axrl", "verl", "trl")
NORMALIZATIONS = ("per_rank", "global")  # each rank by its own counts, or by the step's global counts
# A trainer's settings its capture could not represent under any convention (each with the reason): a loss section
# listing any describes another loss than the one the step was computed with, so it is refused, never replayed.
UNREPRODUCED_KEY = "unreproduced"
# verl's kl_loss_type values (core_algos.kl_penalty); a trailing "+" is its straight-through k2 gradient.
KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+", "low_var_kl+", "abs+")


@dataclass(frozen=True)
class RatioOutlierMask:
    """Mask tokens (or whole sequences, by the geometric mean) whose importance ratio leaves [low, high]."""

    level: str = "token"  # token | sequence
    low: float = 0.5
    high: float = 2.0
    base: str = "rollout"  # rollout | old: logprobs the current policy's ratio is taken against

    def __post_init__(self) -> None:
        if self.level not in ("token", "sequence"):
            raise ConfigError(f"ratio_outlier_mask.level must be 'token' or 'sequence', got {shown(self.level, 60)}")
        if self.base not in LOGPROB_BASES:
            raise ConfigError(f"ratio_outlier_mask.base must be one of {LOGPROB_BASES}, got {shown(self.base, 60)}")
        if not 0 <= self.low < self.high:
            raise ConfigError(f"ratio_outlier_mask needs 0 <= low < high, got low={self.low}, high={self.high}")


@dataclass(frozen=True)
class LossConfig:
    """Loss knobs from `run_config.yaml`'s `loss:` section, plus replay-only mitigations."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    is_base_logprobs: str = "old"
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    # replay-only mitigations (off by default)
    mismatch_token_clip_max: float | None = None
    advantage_clip: float | None = None
    log_ratio_clip: float | None = None
    ratio_outlier_mask: RatioOutlierMask | None = None
    balance_negative_advantages: bool = False
    loss_scale: float | None = None  # the rank's whole loss times this (None: 1); a per-rank hypothesis, `loss_scale`
    # the trainer's convention (see training/verl_convention.py for what `verl` means)
    convention: str = "axrl"
    convention_version: str | None = None  # verl: the release reproduced (VERL_VERSION, recorded in the snapshot)
    normalization: str = "per_rank"
    kl_estimator: str = "k3"  # verl's kl_loss_type (axrl's k3 is unclamped; its low_var_kl is verl's clamped k3)
    kl_clamp: float | None = None  # clamp of the per-token KL estimate to [-C, C] (None: the convention's own)
    loss_scale_factor: float | None = None  # verl: seq-mean-token-sum-norm divisor (None: the response horizon)
    rollout_is: str | None = None  # verl rollout correction: token | sequence truncated IS against the rollout
    rollout_is_threshold: float | str = 2.0  # verl's spec: an upper bound (TIS) or "lower_upper" (IcePop)
    rollout_rs: str | None = None  # verl rejection sampling: comma-separated ROLLOUT_RS_OPTIONS
    rollout_rs_threshold: float | str | None = None  # verl's spec, one per option or shared
    # the policy objective (axrl, verl): PPO's clipped surrogate (vanilla) or GSPO, CISPO, SAPO as verl forms them
    policy_loss_mode: str = "vanilla"
    sapo_tau_pos: float = 1.0  # SAPO's gate temperatures (verl's tau_pos / tau_neg; TRL's sapo_temperature_*)
    sapo_tau_neg: float = 1.05
    trl: TrlSettings | None = None  # convention trl: TRL's GRPOConfig loss settings (None: TRL's defaults)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ConfigError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {shown(self.loss_agg_mode, 60)}")
        if self.is_base_logprobs not in LOGPROB_BASES:
            raise ConfigError(
                f"is_base_logprobs must be one of {LOGPROB_BASES}, got {shown(self.is_base_logprobs, 60)}"
            )
        for name in ("clip_eps_low", "clip_eps_high", "kl_coef", "entropy_coef", "aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number >= 0, got {shown(value, 60)}")
        for name in ("mismatch_token_clip_max", "advantage_clip", "log_ratio_clip", "loss_scale"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"{name} must be a number > 0, got {shown(value, 60)}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ConfigError(f"dual_clip_c must be > 1, got {shown(self.dual_clip_c, 60)}")
        self._check_objective()
        self._check_convention()

    def _check_objective(self) -> None:
        """The policy objective's own knobs (the trl convention's objective is `loss.trl`'s: refused there)."""
        if self.policy_loss_mode not in POLICY_LOSS_MODES:
            raise ConfigError(
                f"loss.policy_loss_mode must be one of {POLICY_LOSS_MODES}, got {shown(self.policy_loss_mode, 60)}"
            )
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"loss.{name} must be a finite number > 0, got {shown(value, 60)}")
        if self.policy_loss_mode != "vanilla" and self.dual_clip_c is not None:
            raise ConfigError(
                f"loss.dual_clip_c has no meaning with policy_loss_mode {self.policy_loss_mode}: the dual clip is "
                "PPO's (verl's vanilla loss); verl's gspo, cispo and sapo losses read no clip_ratio_c (leave it out)"
            )

    def _check_convention(self) -> None:
        """The convention's own knobs, and the settings that have no meaning under it (refused with the reason)."""
        if self.convention not in CONVENTIONS:
            raise ConfigError(f"loss.convention must be one of {CONVENTIONS}, got {shown(self.convention, 60)}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(
                f"loss.normalization must be one of {NORMALIZATIONS}, got {shown(self.normalization, 60)}"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"loss.kl_estimator must be one of {KL_ESTIMATORS}, got {shown(self.kl_estimator, 60)}")
        if self.kl_clamp is not None and (
            isinstance(self.kl_clamp, bool) or not isinstance(self.kl_clamp, (int, float)) or not self.kl_clamp > 0
        ):
            raise ConfigError(f"loss.kl_clamp must be a number > 0, got {shown(self.kl_clamp, 60)}")
        if self.loss_scale_factor is not None and (
            not isinstance(self.loss_scale_factor, (int, float)) or not self.loss_scale_factor > 0
        ):
            raise ConfigError(f"loss.loss_scale_factor must be a number > 0, got {shown(self.loss_scale_factor, 60)}")
        if self.convention == "verl":
            if self.convention_version is None:
                object.__setattr__(self, "convention_version", VERL_VERSION)  # frozen: set once, here
            check_verl_settings(self)
            return
        if self.convention == "trl":
            if self.trl is None:
                object.__setattr__(self, "trl", TrlSettings())  # frozen: set once, here
            check_trl_settings(self)
            return
        if self.trl is not None:
            raise ConfigError(
                f"loss: trl belongs to convention trl; convention {self.convention} has no such setting "
                "(set loss.convention: trl, or leave it out)"
            )
        verl_only = {
            "convention_version": self.convention_version is not None,
            "loss_agg_mode token-sum": self.loss_agg_mode == "token-sum",
            "loss_scale_factor": self.loss_scale_factor is not None,
            "rollout_rs": self.rollout_rs is not None,
        }
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise ConfigError(f"loss.rollout_is must be one of {ROLLOUT_IS_LEVELS}, got {shown(self.rollout_is, 60)}")
        rollout_is_setting(self)
        named = [name for name, is_set in verl_only.items() if is_set]
        if named:
            raise ConfigError(
                f"loss: {', '.join(named)} belong to convention verl; convention axrl has no such setting "
                "(set loss.convention: verl, or leave them out)"
            )
        if self.normalization == "global" and self.ratio_outlier_mask is not None:
            raise ConfigError(
                "mitigation ratio_outlier_mask has no meaning under convention axrl with normalization global: it "
                "masks by the current policy's ratio, known only after the forward, so the step's global token "
                "count cannot be taken before it (use normalization per_rank, or convention verl's rejection sampling)"
            )

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc.pop("extra")
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any], section: str = "loss") -> LossConfig:
        """Build from a mapping; unknown keys are an error that names them and lists the known ones, and so is a
        non-empty `UNREPRODUCED_KEY` list (the trainer's settings that the section could not hold)."""
        doc = dict(doc)
        _refuse_unreproduced(doc.pop(UNREPRODUCED_KEY, None), section)
        known = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"{section}: unknown keys {shown_names(unknown)} (known: {sorted(known)})")
        values = dict(doc)
        mask = values.get("ratio_outlier_mask")
        if isinstance(mask, dict):
            values["ratio_outlier_mask"] = RatioOutlierMask(**mask)
        if values.get("trl") is not None:
            values["trl"] = TrlSettings.from_dict(values["trl"])
        return cls(**values)


def _refuse_unreproduced(listed: Any, section: str) -> None:
    """ConfigError naming the trainer's settings a capture recorded as not reproduced (none listed: nothing)."""
    if listed is None or listed == []:
        return
    if not isinstance(listed, list) or not all(isinstance(item, str) for item in listed):
        raise ConfigError(f"{section}.{UNREPRODUCED_KEY} must be a list of strings, got {type(listed).__name__}")
    items = "; ".join(shown(item, 300, quote=False) for item in listed[:8])
    more = f" (and {len(listed) - 8} more)" if len(listed) > 8 else ""
    raise ConfigError(
        f"{section}: the trainer used settings this tool's loss does not reproduce: {items}{more}. A torch replay "
        "would compute another loss than the step's, so it is refused; replay with the trainer's own code "
        "(the command backend, --backend command)"
    )


# What the `verl` convention makes of a LossConfig: our mitigations mapped onto verl's own mechanisms (see
# verl_settings' docstring), and the settings with no meaning under it refused.


def rollout_is_setting(cfg: LossConfig) -> tuple[str, float, float | None] | None:
    """(level, upper, lower) of the IS correction applied, or None; `mismatch_token_clip_max` is token TIS."""
    if cfg.mismatch_token_clip_max is not None:
        return "token", float(cfg.mismatch_token_clip_max), None
    if cfg.rollout_is is None:
        return None
    upper, lower = parse_is_threshold(cfg.rollout_is_threshold)
    return cfg.rollout_is, upper, lower


def rejection_options(cfg: LossConfig) -> list[RejectionOption]:
    """Every rejection criterion applied: the trainer's `rollout_rs`, then `ratio_outlier_mask` mapped onto k1."""
    out = parse_rs(cfg.rollout_rs, cfg.rollout_rs_threshold) if cfg.rollout_rs is not None else []
    mask = cfg.ratio_outlier_mask
    if mask is not None:
        # ours keeps pi/pi_rollout in [low, high]; verl's k1 bounds are on pi_rollout/pi_train
        upper = math.inf if mask.low == 0 else 1.0 / mask.low
        option = "token_k1" if mask.level == "token" else "seq_mean_k1"
        out.append(RejectionOption(option, upper, 1.0 / mask.high))
    return out


def check_verl_settings(cfg: LossConfig) -> None:
    """ConfigError for a setting that verl 0.9.1 has no counterpart for, naming it and saying why."""
    if cfg.convention_version != VERL_VERSION:
        raise ConfigError(
            f"loss.convention_version {shown(cfg.convention_version, 60)}: this tool reproduces verl "
            f"{VERL_VERSION}'s loss only; replay a snapshot of another verl release with the command backend"
        )
    if cfg.is_base_logprobs != "old":
        raise ConfigError(
            "mitigation is_base_logprobs=rollout has no meaning under convention verl: verl's PPO ratio is always "
            "against old_log_probs; its bypass mode (old := rollout) uses another loss (compute_policy_loss_"
            "bypass_mode) that this convention does not reproduce"
        )
    mask = cfg.ratio_outlier_mask
    if mask is not None and mask.base != "rollout":
        raise ConfigError(
            "mitigation ratio_outlier_mask with base old has no meaning under convention verl: verl's rejection "
            "sampling compares the trainer's old logprobs with the rollout's (use base rollout)"
        )
    if cfg.balance_negative_advantages and cfg.normalization == "global":
        raise ConfigError(
            "mitigation balance_negative_advantages has no meaning under convention verl with normalization global: "
            "it balances each rank's own sums, while verl normalises over the global batch, so no rank could "
            "compute the step's balance on its own"
        )
    if cfg.rollout_is is not None and cfg.rollout_is not in ROLLOUT_IS_LEVELS:
        raise ConfigError(f"loss.rollout_is must be one of {ROLLOUT_IS_LEVELS}, got {shown(cfg.rollout_is, 60)}")
    rollout_is_setting(cfg)
    rejection_options(cfg)


# What the `trl` convention makes of a LossConfig (training/trl_convention.py has the math).


@dataclass(frozen=True)
class RolloutCorrection:
    """TRL's rollout correction as a replay applies it: the mode, its caps, and whether the batch's recorded ratio
    (the one TRL's loss consumed) is used, or the ratio is computed from old vs rollout log-probs (a mitigation)."""

    mode: str
    low: float | None
    high: float | None
    recorded: bool


def trl_rollout_correction(cfg: LossConfig) -> RolloutCorrection | None:
    """The correction applied under convention trl: `mismatch_token_clip_max: C` is TRL's token_truncate with cap
    C, computed; else the trainer's own `trl.rollout_correction`, as recorded; None when neither is set."""
    if cfg.mismatch_token_clip_max is not None:
        return RolloutCorrection("token_truncate", None, float(cfg.mismatch_token_clip_max), recorded=False)
    s = cfg.trl
    if s is None or s.rollout_correction is None:
        return None
    return RolloutCorrection(
        s.rollout_correction, s.rollout_correction_min, s.rollout_correction_max, s.rollout_correction_recorded
    )


def check_trl_settings(cfg: LossConfig) -> None:
    """ConfigError for a setting that TRL 1.16's GRPOTrainer has no counterpart for, naming it and the route."""
    route = "replay this snapshot with the trainer's own code (--backend command)"
    named = {
        "dual_clip_c": (cfg.dual_clip_c is not None, "TRL has no dual clip (its two-sided clip is loss.trl.delta)"),
        "loss_agg_mode": (cfg.loss_agg_mode != "token-mean", "TRL aggregates by loss.trl.loss_type"),
        "normalization": (cfg.normalization != "per_rank", "TRL normalises by loss.trl.loss_type"),
        "kl_estimator": (cfg.kl_estimator != "k3", "TRL's KL term is k3, unclamped"),
        "kl_clamp": (cfg.kl_clamp is not None, "TRL's KL term is k3, unclamped"),
        "is_base_logprobs": (cfg.is_base_logprobs != "old", "TRL's ratio is against its old log-probs"),
        "ratio_outlier_mask": (cfg.ratio_outlier_mask is not None, "use loss.trl.rollout_correction token_mask"),
        "convention_version": (cfg.convention_version is not None, "the TRL release is loss.trl.version"),
        "z_loss_coef": (bool(cfg.z_loss_coef), "TRL adds no router z-loss"),
        "loss_scale_factor": (cfg.loss_scale_factor is not None, "it is verl's seq-mean-token-sum-norm divisor"),
        "rollout_is": (cfg.rollout_is is not None, "TRL's rollout correction is loss.trl.rollout_correction"),
        "rollout_rs": (cfg.rollout_rs is not None, "TRL's rollout correction is loss.trl.rollout_correction"),
        "policy_loss_mode": (
            cfg.policy_loss_mode != "vanilla",
            "TRL's objective is loss.trl.loss_type (cispo, sapo) and loss.trl.importance_sampling_level (GSPO)",
        ),
        "sapo_tau_pos": (cfg.sapo_tau_pos != 1.0, "TRL's SAPO temperatures are loss.trl.sapo_temperature_pos/neg"),
        "sapo_tau_neg": (cfg.sapo_tau_neg != 1.05, "TRL's SAPO temperatures are loss.trl.sapo_temperature_pos/neg"),
    }
    for name, (is_set, why) in named.items():
        if is_set:
            raise ConfigError(f"loss.{name} has no meaning under convention trl: {why}")
    s = cfg.trl
    assert s is not None
    if cfg.aux_loss_coef and s.gradient_accumulation_steps > 1:
        raise ConfigError(
            "loss.aux_loss_coef (TRL's router_aux_loss_coef) with loss.trl.gradient_accumulation_steps > 1: TRL adds "
            "each micro-batch's router loss on its own, which a replay of the step's whole batch does not; " + route
        )
