"""verl 0.9.1's own loss knobs, parsed as verl parses them: the release reproduced, its rollout-correction levels
and rejection-sampling options, its IS and rejection thresholds. Knows nothing of `LossConfig`, which checks its
settings against these (`loss_config.check_verl_settings`) and maps our mitigations onto them
(`loss_config.rollout_is_setting`, `loss_config.rejection_options`).

Torch-free (the mitigation registry validates configs through `LossConfig`). The math is in
`training/verl_convention.py`.

Mapping of our mitigations onto verl 0.9.1:
- `mismatch_token_clip_max: C` -> verl's token-level truncated IS (`rollout_is: token`, threshold C);
- `ratio_outlier_mask` (base rollout) -> verl's rejection sampling, `token_k1` (level token) or `seq_mean_k1`
  (level sequence, the geometric mean), with our bounds on pi_train/pi_rollout turned into verl's bounds on
  pi_rollout/pi_train: [1/high, 1/low]; it ANDs with the trainer's own `rollout_rs`;
- `log_ratio_clip: c` -> the policy log-ratio clamped to [-c, c] on top of verl's own +-20;
- `advantage_clip`, `balance_negative_advantages` -> the advantages verl's loss is given (per rank);
- `dual_clip_c` -> verl's `clip_ratio_c` (verl's default 3 when unset); `kl_coef` -> `kl_loss_coef`
  (`use_kl_loss` when > 0), `entropy_coef` -> `entropy_coeff`, `clip_eps_*` -> `clip_ratio_low/high`.
"""

from __future__ import annotations

from dataclasses import dataclass

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError

VERL_VERSION = "0.9.1"  # the verl release whose policy loss the verl convention reproduces
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
VERL_DUAL_CLIP_C = 3.0  # verl's clip_ratio_c default: dual-clip is on unless configured otherwise


@dataclass(frozen=True)
class RejectionOption:
    """One rejection-sampling criterion: verl's option name and its bounds (lower only for k1 options)."""

    option: str
    upper: float
    lower: float | None = None


def bounds_spec(lower: float, upper: float) -> str:
    """Two bounds as verl's `LOWER_UPPER` threshold string, written so that no override or YAML reader takes it
    for a number: Hydra and YAML both read `_` as a digit separator (`0.5_2` is 0.52), so the upper bound always
    carries a decimal point (`0.5_2.0`), which no number has twice."""
    return f"{lower:g}_{_with_point(upper)}"


def _with_point(value: float) -> str:
    text = f"{value:.6f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"loss.{what}: {shown(text, 60)} is not a number") from None


def parse_is_threshold(spec: float | str, what: str = "rollout_is_threshold") -> tuple[float, float | None]:
    """(upper, lower or None) from verl's IS threshold spec: a number (TIS) or "lower_upper" (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ConfigError(f"loss.{what} must be a number or a 'lower_upper' string, got {shown(spec, 60)}")
    lower: float | None = None
    if isinstance(spec, str):
        text = spec.strip()
        if "_" in text:
            low_text, up_text = text.split("_", 1)
            lower, upper = _number(low_text, what), _number(up_text, what)
        else:
            upper = _number(text, what)
    else:
        upper = float(spec)
    if not upper > 0 or (lower is not None and not lower > 0):
        raise ConfigError(f"loss.{what}: bounds must be positive, got {shown(spec, 60)}")
    if lower is not None and lower > upper:
        raise ConfigError(f"loss.{what}: lower bound must be <= upper bound, got {shown(spec, 60)}")
    return upper, lower


def parse_rs(options: str, spec: float | str | None) -> list[RejectionOption]:
    """verl's rejection-sampling options with their thresholds (its `_parse_rollout_rs_thresholds` rules)."""
    names: list[str] = []
    for name in (part.strip() for part in options.split(",")):
        if name and name not in names:
            if name not in ROLLOUT_RS_OPTIONS:
                raise ConfigError(
                    f"loss.rollout_rs: {shown(name, 60)} is not one of verl's options {ROLLOUT_RS_OPTIONS}"
                )
            names.append(name)
    if not names:
        raise ConfigError("loss.rollout_rs: name at least one option")
    if spec is None or isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ConfigError(
            f"loss.rollout_rs_threshold is needed with rollout_rs (a number or string), got {shown(spec, 60)}"
        )
    specs = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ConfigError(f"loss.rollout_rs_threshold: give one threshold or {len(names)} (one per option)")
    out = []
    for name, text in zip(names, specs, strict=True):
        if name.endswith("k1"):
            if "_" in text:
                low_text, up_text = text.split("_", 1)
                lower, upper = _number(low_text, "rollout_rs_threshold"), _number(up_text, "rollout_rs_threshold")
            else:
                upper = _number(text, "rollout_rs_threshold")
                lower = 1.0 / upper if upper else 0.0
            if not (lower > 0 and upper > 0 and lower <= upper):
                raise ConfigError(
                    f"loss.rollout_rs_threshold for {name}: need 0 < lower <= upper, got {shown(text, 60)}"
                )
            out.append(RejectionOption(name, upper, lower))
        else:
            if "_" in text:
                raise ConfigError(f"loss.rollout_rs_threshold for {name}: one upper bound, got {shown(text, 60)}")
            upper = _number(text, "rollout_rs_threshold")
            if not upper > 0:
                raise ConfigError(f"loss.rollout_rs_threshold for {name}: must be positive, got {shown(text, 60)}")
            out.append(RejectionOption(name, upper))
    return out
