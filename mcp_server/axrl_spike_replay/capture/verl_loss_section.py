"""verl 0.9.1's actor loss settings as a run config's `loss:` section (convention verl, normalization global).

The patched FSDP engine keeps the loss function it trained with: `functools.partial(ppo_loss, config=actor)` where
`actor` is verl's `ActorConfig` (`verl/workers/config/actor.py`). Its knobs map onto ours as
`verl.workers.utils.losses.ppo_loss` and `core_algos.compute_policy_loss_vanilla` read them:

| verl (actor config)                          | our `loss:` key                                   |
|----------------------------------------------|---------------------------------------------------|
| `clip_ratio_low` / `clip_ratio_high` (else `clip_ratio`) | `clip_eps_low` / `clip_eps_high`      |
| `clip_ratio_c` (dual clip, default 3)        | `dual_clip_c` (vanilla only: no other loss reads it) |
| `policy_loss.loss_mode` gspo / cispo / sapo  | `policy_loss_mode` (training/policy_objectives.py) |
| `tau_pos` / `tau_neg` (sapo)                 | `sapo_tau_pos` / `sapo_tau_neg`                   |
| `loss_agg_mode`, `loss_scale_factor`         | `loss_agg_mode`, `loss_scale_factor`              |
| `entropy_coeff`                              | `entropy_coef`                                    |
| `use_kl_loss`, `kl_loss_coef`, `kl_loss_type`| `kl_coef` (0 without `use_kl_loss`), `kl_estimator` |
| the engine's global counts (always)          | `normalization: global`                           |

Rollout correction (`algorithm.rollout_correction`: `rollout_is`, `rollout_rs`, their thresholds,
`rollout_is_batch_normalize`) is not the actor's: in verl's decoupled mode the driver applies it before the update,
so the mini-batch the engine trains on already holds its effect (`response_mask` after rejection sampling,
`rollout_is_weights`), and a replay uses those as recorded. The section therefore leaves `rollout_is` /
`rollout_rs` unset. Bypass mode (`policy_loss.loss_mode: bypass_mode`) and every loss mode beside vanilla, gspo,
cispo and sapo, or another loss function, are settings this convention does not reproduce: they are listed under
`unreproduced`, which the replay refuses with the list (see `LossConfig.from_dict`), never dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.training.loss_config import KL_ESTIMATORS, POLICY_LOSS_MODES, UNREPRODUCED_KEY, LossConfig
from axrl_spike_replay.training.verl_settings import VERL_VERSION

VERL_LOSS_FUNCTION = "ppo_loss"  # verl.workers.utils.losses.ppo_loss: the loss the verl convention reproduces
# verl's kl_penalty names our list spells otherwise: "kl" is k1, and k2's "+" variant is k2 itself.
_KL_SPELLINGS = {"kl+": "k1+", "mse+": "k2", "k2+": "k2"}
_NOT_SEEN = (
    "the actor's loss settings: the engine kept no loss function (apply the current patch "
    "axrl_spike_replay/integrations/verl-0.9.1.diff, which keeps it beside the mini-batch)"
)


@dataclass(frozen=True)
class VerlLossSection:
    """The `loss:` section, and the trainer's settings it could not represent (each with the reason)."""

    section: dict[str, Any]
    unreproduced: tuple[str, ...] = ()


def setting(config: Any, name: str, default: Any = None) -> Any:
    """`config.name` for verl's config objects (dataclasses, OmegaConf), `config[name]` for plain mappings."""
    if isinstance(config, Mapping) and name in config:
        return config[name]
    return getattr(config, name, default)


def _kl(config: Any, unreproduced: list[str]) -> dict[str, Any]:
    if not setting(config, "use_kl_loss", False):
        return {"kl_coef": 0.0}
    kind = str(setting(config, "kl_loss_type", "low_var_kl"))
    estimator = _KL_SPELLINGS.get(kind, kind)
    if estimator not in KL_ESTIMATORS:
        unreproduced.append(f"kl_loss_type={kind}: not one of the KL estimators the verl convention computes")
        return {"kl_coef": 0.0}
    return {"kl_coef": float(setting(config, "kl_loss_coef", 0.001)), "kl_estimator": estimator}


def _clip(config: Any) -> dict[str, Any]:
    base = setting(config, "clip_ratio", 0.2)
    low, high = setting(config, "clip_ratio_low"), setting(config, "clip_ratio_high")
    return {
        "clip_eps_low": float(low if low is not None else base),
        "clip_eps_high": float(high if high is not None else base),
        "dual_clip_c": float(setting(config, "clip_ratio_c", 3.0)),
    }


def section_from_actor_config(config: Any) -> VerlLossSection:
    """Our `loss:` section for verl's `ActorConfig` (the vanilla policy loss through `ppo_loss`). Never raises: it
    runs inside training, so a value it cannot read is listed as unreproduced instead."""
    unreproduced: list[str] = []
    try:
        section = _mapped(config, unreproduced)
    except (TypeError, ValueError) as exc:  # a null or non-numeric knob: verl itself would fail on most of them
        return VerlLossSection(_refused_section(), (f"the actor config could not be read ({exc})",))
    try:
        LossConfig.from_dict(section)
    except ConfigError as exc:
        unreproduced.append(f"{exc} (as verl's actor config sets it)")
    return VerlLossSection(section, tuple(unreproduced))


def _mapped(config: Any, unreproduced: list[str]) -> dict[str, Any]:
    mode = setting(setting(config, "policy_loss", {}), "loss_mode", "vanilla")
    if mode not in POLICY_LOSS_MODES:
        why = "verl's bypass mode (old := rollout logprobs) " if mode == "bypass_mode" else ""
        unreproduced.append(
            f"policy_loss.loss_mode={mode}: {why}the verl convention reproduces the {', '.join(POLICY_LOSS_MODES)} "
            "policy losses"
        )
    scale = setting(config, "loss_scale_factor")
    section = {
        "convention": "verl",
        "convention_version": VERL_VERSION,
        "normalization": "global",  # verl's engine always passes the step's global counts to agg_loss
        "is_base_logprobs": "old",
        "loss_agg_mode": str(setting(config, "loss_agg_mode", "token-mean")),
        "loss_scale_factor": float(scale) if scale is not None else None,
        "entropy_coef": float(setting(config, "entropy_coeff", 0.0)),
        "aux_loss_coef": 0.0,  # ppo_loss adds no router loss
        "z_loss_coef": 0.0,
        **_clip(config),
        **_kl(config, unreproduced),
    }
    if mode in POLICY_LOSS_MODES and mode != "vanilla":
        section["policy_loss_mode"] = mode
        section.pop("dual_clip_c")  # verl's gspo, cispo and sapo losses read no clip_ratio_c
        if mode == "sapo":
            section["sapo_tau_pos"] = float(setting(config, "tau_pos", 1.0))
            section["sapo_tau_neg"] = float(setting(config, "tau_neg", 1.05))
    return section


def section_from_loss_function(loss_function: Any) -> VerlLossSection:
    """The section for the loss function the engine trained with (`partial(ppo_loss, config=actor_config)`)."""
    if loss_function is None:
        return VerlLossSection(_refused_section(), (_NOT_SEEN,))
    function = getattr(loss_function, "func", loss_function)
    name = getattr(function, "__name__", type(function).__name__)
    config = (getattr(loss_function, "keywords", None) or {}).get("config")
    if name != VERL_LOSS_FUNCTION or config is None:
        what = f"loss function {name}" if name != VERL_LOSS_FUNCTION else f"{name} without its actor config"
        return VerlLossSection(
            _refused_section(), (f"{what}: the verl convention reproduces {VERL_LOSS_FUNCTION} with an actor config",)
        )
    return section_from_actor_config(config)


def _refused_section() -> dict[str, Any]:
    return {"convention": "verl", "convention_version": VERL_VERSION, "normalization": "global"}


def loss_section(loss_function: Any) -> dict[str, Any]:
    """The `loss:` mapping to write: the section, with the unreproduced settings under `UNREPRODUCED_KEY`."""
    found = section_from_loss_function(loss_function)
    doc = dict(found.section)
    if found.unreproduced:
        doc[UNREPRODUCED_KEY] = list(found.unreproduced)
    return doc
