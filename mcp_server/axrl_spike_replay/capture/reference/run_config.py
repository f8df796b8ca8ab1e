"""The reference trainer's `run_config.yaml`: built from a preset, parsed back into typed sections.

The document holds everything needed to rebuild the model, the loss and the routing of a step:
`model` (TinyMoEConfig, or a transformers MoE model: `kind: hf`), `loss` (LossConfig), `routing`
(RoutingConfig), `parallel`, `train`, `detector`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from axrl_spike_replay.capture.detectors import DEFAULT_WARMUP_RATIO
from axrl_spike_replay.capture.reference.model_choice import (
    DEFAULT_CAPTURE_MODEL,
    HF_RESPONSE_LEN,
    check_capture_model,
    hf_model_section,
)
from axrl_spike_replay.capture.reference.presets import get_preset
from axrl_spike_replay.capture.reference.toy_task import ADVANTAGE_ESTIMATORS
from axrl_spike_replay.display import shown, shown_names
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.policy import ModelSpec, parse_model_config
from axrl_spike_replay.models.tiny_moe import TinyMoEConfig
from axrl_spike_replay.training.policy_loss import LossConfig
from axrl_spike_replay.training.routing_replay import RoutingConfig
from axrl_spike_replay.vocabulary import GUARD_ACTIONS

DETECTOR_KINDS = ("median_ratio", "zscore")
# The `loss:` keys a trainer sets; LossConfig's other fields are replay-only mitigations.
TRAIN_LOSS_KEYS = (
    "clip_eps_low",
    "clip_eps_high",
    "dual_clip_c",
    "kl_coef",
    "entropy_coef",
    "loss_agg_mode",
    "is_base_logprobs",
    "aux_loss_coef",
    "z_loss_coef",
)

DEFAULT_MODEL = TinyMoEConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, d_ff=64, n_experts=4, top_k=2)
DEFAULT_LOSS = LossConfig(kl_coef=0.01, aux_loss_coef=0.01, z_loss_coef=0.001)


@dataclass(frozen=True)
class TrainSettings:
    """`train:` section: optimisation, batch shape, task, fault burst and guard behaviour."""

    lr: float = 3e-3
    grad_clip: float = 1.0
    seed: int = 0
    steps: int = 32
    group_size: int = 4
    prompts_per_rank: int = 2
    prompt_len: int = 6
    response_len: int = 8
    temperature: float = 1.0
    advantage_estimator: str = "grpo"
    baseline_momentum: float = 0.9
    task: str = "echo_first_token"
    preset: str = "none"
    burst: tuple[int, ...] = (20, 21, 22)
    fault: dict[str, Any] = field(default_factory=dict)
    skip_iterations: tuple[int, ...] = ()
    guard_action: str = "skip"
    keep_last: int = 4
    checkpoint_interval: int = 10

    def __post_init__(self) -> None:
        positive = ("steps", "group_size", "prompts_per_rank", "prompt_len", "response_len", "keep_last")
        for name in (*positive, "checkpoint_interval"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"train.{name} must be an integer >= 1, got {shown(value, 60)}")
        for name in ("lr", "grad_clip", "temperature"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                raise ConfigError(f"train.{name} must be a number > 0, got {shown(value, 60)}")
        if self.group_size < 2:
            raise ConfigError(f"train.group_size must be >= 2 (advantages compare samples), got {self.group_size}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(f"train.advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}")
        if self.guard_action not in GUARD_ACTIONS:
            raise ConfigError(f"train.guard_action must be one of {GUARD_ACTIONS}, got {self.guard_action!r}")
        if self.task != "echo_first_token":
            raise ConfigError(f"train.task {self.task!r} is not built in (built in: echo_first_token)")
        if not _is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"train.seed must be an integer >= 0, got {shown(self.seed, 60)}")

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["burst"] = list(self.burst)
        doc["skip_iterations"] = list(self.skip_iterations)
        return doc

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> TrainSettings:
        values = dict(_known(doc, cls, "train"))
        for key in ("burst", "skip_iterations"):
            if key in values:
                steps = values[key] or ()
                if not isinstance(steps, (list, tuple)) or not all(_is_int(x) and x >= 0 for x in steps):
                    raise ConfigError(f"train.{key} must be a list of step numbers, got {shown(steps, 80)}")
                values[key] = tuple(steps)
        for key in ("advantage_estimator", "task", "preset", "guard_action"):
            if key in values and not isinstance(values[key], str):
                raise ConfigError(f"train.{key} must be a string, got {shown(values[key], 60)}")
        if "fault" in values and not isinstance(values["fault"], Mapping):
            raise ConfigError(f"train.fault must be a mapping, got {shown(values['fault'], 60)}")
        if "baseline_momentum" in values and not _is_number(values["baseline_momentum"]):
            raise ConfigError(f"train.baseline_momentum must be a number, got {shown(values['baseline_momentum'], 60)}")
        return cls(**values)


@dataclass(frozen=True)
class DetectorSettings:
    """`detector:` section: spike detector on the pre-clip global grad norm."""

    kind: str = "median_ratio"
    window: int = 10
    threshold: float = 5.0
    warmup: int = 8
    # armed from step 1 (capture.detectors): in the warm-up, a norm this many times the median of the norms seen so
    # far trips (None: a blind warm-up); `max_norm`: an absolute bar until the window has filled (None: none)
    warmup_ratio: float | None = DEFAULT_WARMUP_RATIO
    max_norm: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in DETECTOR_KINDS:
            raise ConfigError(f"detector.kind must be one of {DETECTOR_KINDS}, got {shown(self.kind, 60)}")
        for name in ("window", "warmup"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"detector.{name} must be an integer >= 1, got {shown(value, 60)}")
        if not _is_number(self.threshold) or not math.isfinite(self.threshold) or self.threshold <= 0:
            raise ConfigError(f"detector.threshold must be a finite number > 0, got {shown(self.threshold, 60)}")
        for name, low in (("warmup_ratio", 1.0), ("max_norm", 0.0)):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or not math.isfinite(value) or value <= low):
                raise ConfigError(f"detector.{name} must be a finite number > {low:g} or null, got {shown(value, 60)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> DetectorSettings:
        return cls(**_known(doc, cls, "detector"))


@dataclass(frozen=True)
class RunSpec:
    """A run config parsed into its typed sections."""

    model: ModelSpec
    loss: LossConfig
    routing: RoutingConfig
    train: TrainSettings
    detector: DetectorSettings
    world_size: int
    document: dict[str, Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _known(doc: Mapping[str, Any], cls: type, section: str) -> dict[str, Any]:
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{section}: expected a mapping, got {type(doc).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(str(k) for k in set(doc) - known)
    if unknown:
        raise ConfigError(f"{section}: unknown keys {shown_names(unknown)} (known: {sorted(known)})")
    return dict(doc)


def build_run_config(
    *,
    preset: str = "ratio_outliers",
    steps: int = 32,
    seed: int = 0,
    world_size: int = 1,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    model: str = DEFAULT_CAPTURE_MODEL,
) -> dict[str, Any]:
    """The run config document for a preset and a model (`model_choice.CAPTURE_MODELS`), with per-section
    `overrides` applied last."""
    check_capture_model(model)
    chosen = get_preset(preset)
    loss = {key: value for key, value in DEFAULT_LOSS.to_dict().items() if key in TRAIN_LOSS_KEYS}
    loss.update(chosen.loss)
    train = TrainSettings(steps=steps, seed=seed, preset=preset).to_dict()
    if model != DEFAULT_CAPTURE_MODEL:
        train["response_len"] = HF_RESPONSE_LEN
    train.update(chosen.train)
    train["fault"] = chosen.fault_summary()
    if preset == "none":
        train["burst"] = []
    doc: dict[str, Any] = {
        "model": DEFAULT_MODEL.to_dict() if model == DEFAULT_CAPTURE_MODEL else hf_model_section(model),
        "loss": loss,
        "routing": RoutingConfig(replay="all").to_dict(),
        "parallel": {"world_size": world_size, "tp": 1, "pp": 1, "dp": world_size, "ep": 1, "etp": 1, "cp": 1},
        "train": train,
        "detector": DetectorSettings().to_dict(),
    }
    for section, values in (overrides or {}).items():
        if section not in doc:
            raise ConfigError(f"overrides: unknown section {section!r} (known: {sorted(doc)})")
        doc[section].update(copy.deepcopy(dict(values)))
    spec = parse_run_config(doc)  # validate now, not in a rank process
    if spec.loss.convention_version is not None:  # the trainer release whose loss the run used, on record
        doc["loss"]["convention_version"] = spec.loss.convention_version
    return doc


def parse_run_config(doc: Mapping[str, Any]) -> RunSpec:
    """Typed sections of a run config; ConfigError naming the section and key on bad values."""
    for section in ("model", "loss", "routing", "parallel", "train", "detector"):
        if not isinstance(doc.get(section), Mapping):
            raise ConfigError(f"run config: section {section!r} is missing or not a mapping")
    world_size = doc["parallel"].get("world_size")
    if not _is_int(world_size) or world_size < 1:
        raise ConfigError(f"parallel.world_size must be an integer >= 1, got {shown(world_size, 60)}")
    try:
        loss = LossConfig.from_dict(dict(doc["loss"]))
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ConfigError(f"loss: invalid value ({shown(str(exc), 160, quote=False)})") from None
    model = parse_model_config(dict(doc["model"]))
    if not isinstance(model, (TinyMoEConfig, HFModelConfig)):  # kind megatron: Megatron trains it, not us
        raise ConfigError(
            "model: kind megatron is captured inside the Megatron-core trainer "
            "(axrl_spike_replay.integrations.megatron); the reference trainer trains tiny_moe and hf models"
        )
    spec = RunSpec(
        model=model,
        loss=loss,
        routing=RoutingConfig.from_dict(dict(doc["routing"])),
        train=TrainSettings.from_dict(doc["train"]),
        detector=DetectorSettings.from_dict(doc["detector"]),
        world_size=world_size,
        document=copy.deepcopy(dict(doc)),
    )
    seq = spec.train.prompt_len + spec.train.response_len
    if not isinstance(spec.model, TinyMoEConfig):
        limit = spec.model.config.get("max_position_embeddings")
        if isinstance(limit, int) and seq > limit:
            raise ConfigError(
                f"train.prompt_len + train.response_len ({seq}) exceeds model.config.max_position_embeddings"
            )
    elif seq > spec.model.max_seq_len:
        raise ConfigError(f"train.prompt_len + train.response_len ({seq}) exceeds model.max_seq_len")
    return spec
