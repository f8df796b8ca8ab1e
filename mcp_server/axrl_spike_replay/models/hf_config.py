"""The `model:` section for a transformers MoE policy (`kind: hf`): parsed, bounded and checked before anything runs.

The HF config comes from a run config we did not write, so every size in it is bounded here and the model is
only ever built on the meta device (no memory) until its shapes have been checked against the weights on disk.
Nothing is downloaded: configs are built from transformers' own config classes, never from a hub or remote code.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown, shown_names
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.architectures import ARCHITECTURES, MAX_EXPERT_WIDTH, MAX_EXPERTS
from axrl_spike_replay.untrusted.untrusted_bytes import read_bounded
from axrl_spike_replay.untrusted.untrusted_json import UntrustedJsonError, parse_untrusted_json

if TYPE_CHECKING:
    import torch
    from torch import nn

DTYPES = ("float32", "bfloat16", "float16")
# the trainer's attention kernel, recorded and replayed (`models.attention_kernels`: where each runs, its bound)
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
# transformers' experts implementations that run on CPU and GPU alike (deepgemm and sonicmoe need GPU kernels).
EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
BACKEND_HINT = "replay it with `--backend command` and the trainer's own replay command"
# Sizes a hostile config could inflate: those every architecture has, then each declared architecture's own
# (experts, expert widths); every other integer is bounded by GENERIC_INT_LIMIT.
SIZE_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 1 << 16,
    "vocab_size": 1 << 20,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "num_experts_per_tok": MAX_EXPERTS,
    "intermediate_size": MAX_EXPERT_WIDTH,
}
for _spec in ARCHITECTURES.values():
    SIZE_LIMITS.update(_spec.size_limits)
GENERIC_INT_LIMIT = 1 << 24
# 8G parameters: the same ceiling as the tiny model's, for a model built with memory; a config above it still
# parses and builds on the meta device, so `plan` can say what a replay of it needs
MAX_MODEL_PARAMETERS = 1 << 33
MAX_CONFIG_JSON_BYTES = 1 << 20
# Keys that would make transformers run code or quantise: refused, not ignored.
REFUSED_KEYS = ("auto_map", "quantization_config")
DROPPED_KEYS = ("architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path")


@dataclass(frozen=True)
class HFModelConfig:
    """`model:` with `kind: hf`: the architecture, its HF config (inline or from `path`) and the pinned kernels."""

    architecture: str
    config: dict[str, Any] = field(hash=False)
    path: str | None = None
    dtype: str = "float32"
    attn_implementation: str = "eager"
    experts_implementation: str = "eager"
    temperature: float = 1.0  # logits are divided by it before the log-softmax, as RL trainers do
    deterministic_algorithms: bool = True  # torch.use_deterministic_algorithms(True) while built: pinned and recorded

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"model.architecture {shown(self.architecture, 60)} cannot be built by the torch engine "
                f"(built: {', '.join(ARCHITECTURES)}); {BACKEND_HINT}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {DTYPES}, got {shown(self.dtype, 40)}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"model.attn_implementation {shown(self.attn_implementation, 40)} is not built by the torch engine "
                f"(built: {ATTN_IMPLEMENTATIONS}); {BACKEND_HINT}"
            )
        if self.experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            raise ConfigError(
                f"model.experts_implementation {shown(self.experts_implementation, 40)} is not built by the torch "
                f"engine (built: {EXPERTS_IMPLEMENTATIONS}); {BACKEND_HINT}"
            )
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not (0 < self.temperature < float("inf"))
        ):
            raise ConfigError(f"model.temperature must be a number > 0, got {shown(self.temperature, 40)}")
        if not isinstance(self.deterministic_algorithms, bool):
            raise ConfigError(
                f"model.deterministic_algorithms must be true or false, got {shown(self.deterministic_algorithms, 40)}"
            )
        check_config_sizes(self.config)
        model_type = self.config.get("model_type", self.architecture)
        if model_type != self.architecture:
            raise ConfigError(
                f"model.config says model_type {shown(model_type, 40)} but model.architecture is {self.architecture}"
            )
        expected_hf_shapes(self)  # built on the meta device: a config transformers refuses is named here
        _check_routers(_meta_layout(self.key)[3])  # top_k beyond the experts, named when the config is read

    @property
    def key(self) -> str:
        """The config as canonical JSON: what the cached meta build is keyed by."""
        return json.dumps(
            [self.architecture, self.config, self.dtype, self.attn_implementation, self.experts_implementation],
            sort_keys=True,
        )

    @property
    def n_layers(self) -> int:
        """Decoder layers, as the model is built."""
        return _meta_layout(self.key)[3].decoder_layers

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Absolute decoder layers with a router, as the architecture builds them (dense layers left out)."""
        return _meta_layout(self.key)[1]

    @property
    def top_k(self) -> int:
        return _meta_layout(self.key)[2]

    @property
    def n_experts(self) -> int:
        """Routed experts per MoE layer, as the routers are built (0 without MoE layers)."""
        return _meta_layout(self.key)[3].num_experts

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": "hf", "architecture": self.architecture}
        if self.path is not None:
            doc["path"] = self.path
        else:
            doc["config"] = self.config
        doc.update(
            dtype=self.dtype,
            attn_implementation=self.attn_implementation,
            experts_implementation=self.experts_implementation,
            temperature=self.temperature,
            deterministic_algorithms=self.deterministic_algorithms,
        )
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> HFModelConfig:
        """Build from the `model:` section (kind: hf); `config` inline or `path` to an HF directory's config.json."""
        known = {"kind", "architecture", "config", "path", "dtype", "attn_implementation", "experts_implementation"}
        known.update(("temperature", "deterministic_algorithms"))
        unknown = sorted(str(k) for k in set(doc) - known)
        if unknown:
            raise ConfigError(f"model: unknown keys {shown_names(unknown)} (known: {sorted(known)})")
        if "architecture" not in doc:
            raise ConfigError(f"model: kind hf needs `architecture` (one of {', '.join(ARCHITECTURES)})")
        inline, path = doc.get("config"), doc.get("path")
        if (inline is None) == (path is None):
            raise ConfigError("model: kind hf needs exactly one of `config` (the HF config, inline) or `path`")
        for key in ("architecture", "dtype", "attn_implementation", "experts_implementation", "path"):
            if key in doc and doc[key] is not None and not isinstance(doc[key], str):
                raise ConfigError(f"model.{key} must be a string, got {shown(doc[key], 60)}")
        config = read_hf_config(Path(path)) if path is not None else inline
        if not isinstance(config, dict):
            raise ConfigError(f"model.config must be a mapping (the HF config), got {type(config).__name__}")
        values = {k: v for k, v in doc.items() if k not in ("kind", "config")}
        return cls(config=_cleaned(config), **values)


def read_hf_config(directory: Path) -> dict[str, Any]:
    """`config.json` of an HF directory (or of a verl actor checkpoint: `huggingface/config.json` beside the shards),
    read as untrusted JSON (size and depth bounded)."""
    path = directory / "config.json"
    if not path.is_file() and (directory / "huggingface" / "config.json").is_file():
        path = directory / "huggingface" / "config.json"  # verl's FSDPCheckpointManager saves the HF config there
    if not path.is_file():
        raise ConfigError(
            f"model.path {directory}: no config.json (an HF directory holds config.json + *.safetensors; a verl actor "
            "checkpoint huggingface/config.json beside its shards)"
        )
    try:
        doc = parse_untrusted_json(read_bounded(path, MAX_CONFIG_JSON_BYTES), max_depth=16)
    except (UntrustedJsonError, OSError, ValueError) as exc:
        raise ConfigError(f"{path}: {shown(str(exc), 160, quote=False)}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _cleaned(config: dict[str, Any]) -> dict[str, Any]:
    refused = [k for k in REFUSED_KEYS if k in config]
    if refused:
        raise ConfigError(
            f"model.config has {refused}: remote code and quantised weights are not built; {BACKEND_HINT}"
        )
    return {str(k): v for k, v in config.items() if k not in DROPPED_KEYS}


def check_config_sizes(config: dict[str, Any], where: str = "model.config") -> None:
    """ConfigError when an integer in the HF config exceeds its limit (checked before any config class sees it)."""
    for key, value in config.items():
        name = f"{where}.{key}"
        if isinstance(value, dict):
            check_config_sizes(value, name)
        elif isinstance(value, list):
            if len(value) > 4096:
                raise ConfigError(f"{name} has {len(value)} entries, more than 4096")
            for item in value:
                if isinstance(item, int) and not isinstance(item, bool) and abs(item) > GENERIC_INT_LIMIT:
                    raise ConfigError(f"{name} holds {shown(item, 40)}, beyond {GENERIC_INT_LIMIT}")
        elif isinstance(value, int) and not isinstance(value, bool):
            limit = SIZE_LIMITS.get(key, GENERIC_INT_LIMIT)
            low = 1 if key in SIZE_LIMITS else -GENERIC_INT_LIMIT
            if not low <= value <= limit:
                raise ConfigError(f"{name} must be in [{low}, {limit}], got {shown(value, 40)}")


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def hf_config_object(spec: HFModelConfig) -> Any:
    """The architecture's own config class, filled from the dict, with the pinned implementations."""
    import warnings

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    values = {k: v for k, v in spec.config.items() if k != "model_type"}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = CONFIG_MAPPING[spec.architecture](**values)
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as exc:
        raise ConfigError(
            f"model.config: transformers' {spec.architecture} config refuses it ({shown(str(exc), 160, quote=False)})"
        ) from None
    config._attn_implementation = spec.attn_implementation
    config._experts_implementation = spec.experts_implementation
    return config


def instantiate(spec: HFModelConfig, device: str = "cpu") -> nn.Module:
    """`AutoModelForCausalLM.from_config` for the spec on `device` ("meta": shapes only, no memory)."""
    import logging

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if device != "meta":  # shapes cost nothing; memory is committed only below the ceiling (`plan` says the rest)
        parameters = sum(_numel(shape) for shape in expected_hf_shapes(spec).values())
        if parameters > MAX_MODEL_PARAMETERS:
            raise ConfigError(f"model: {parameters} parameters, more than the {MAX_MODEL_PARAMETERS} limit")
    config = hf_config_object(spec)
    attention = spec.attn_implementation
    if device == "meta" and attention == "flash_attention_2":  # shapes only: flash_attn is checked where it runs
        attention = config._attn_implementation = "eager"
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)  # config-consistency warnings of tiny test configs are not ours
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                config,
                attn_implementation=attention,
                experts_implementation=spec.experts_implementation,
                dtype=spec.torch_dtype,
            )
    except (TypeError, ValueError, KeyError, AttributeError, ImportError, RuntimeError) as exc:
        raise ConfigError(
            f"model: transformers cannot build {spec.architecture} from this config "
            f"({shown(str(exc), 160, quote=False)}); {BACKEND_HINT}"
        ) from None
    finally:
        hf_logging.set_verbosity(level)
    return model


@dataclass(frozen=True)
class BuiltSizes:
    """What the model was built with: its decoder layers and its routers' sizes (the config's own names differ per
    architecture, and a config may leave them to the config class's defaults)."""

    decoder_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    num_group: int | None = None  # deepseek_v3: experts are chosen within the best `topk_group` of `num_group`
    topk_group: int | None = None


def _check_routers(sizes: BuiltSizes) -> None:
    """ConfigError for a routing the router cannot run: transformers would fail only at the first forward
    (after the weights are loaded), inside a rank process."""
    if sizes.num_experts == 0:
        return
    if sizes.top_k > sizes.num_experts:
        raise ConfigError(
            f"model.config: num_experts_per_tok (top-k) is {sizes.top_k}, more than the {sizes.num_experts} routed "
            "experts per layer"
        )
    groups, chosen = sizes.num_group, sizes.topk_group
    if groups is None or chosen is None:
        return
    if groups < 1 or sizes.num_experts % groups or sizes.num_experts // groups < 2:
        raise ConfigError(
            f"model.config: n_group {groups} must split the {sizes.num_experts} routed experts into groups of at "
            "least 2"
        )
    if not 1 <= chosen <= groups or sizes.top_k > chosen * (sizes.num_experts // groups):
        raise ConfigError(
            f"model.config: topk_group {chosen} of n_group {groups} leaves too few experts for top-k {sizes.top_k}"
        )


@functools.lru_cache(maxsize=8)
def _meta_layout(key: str) -> tuple[dict[str, tuple[int, ...]], tuple[int, ...], int, BuiltSizes]:
    """(state shapes, MoE layer ids, top-k, router sizes) of a spec, from a build on the meta device."""
    from axrl_spike_replay.models.hf_routing import find_routers

    architecture, config, dtype, attn, experts = json.loads(key)
    spec = object.__new__(HFModelConfig)  # the spec was validated by whoever made the key
    for name, value in (
        ("architecture", architecture),
        ("config", config),
        ("path", None),
        ("dtype", dtype),
        ("attn_implementation", attn),
        ("experts_implementation", experts),
        ("temperature", 1.0),
    ):
        object.__setattr__(spec, name, value)
    model = instantiate(spec, "meta")
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    routers: dict[int, Any] = dict(find_routers(model, architecture))  # transformers' routers: top_k is an int
    first = next(iter(routers.values()), None)
    decoder: Any = model.model  # transformers' decoder: its layers are an nn.ModuleList
    layers = len(decoder.layers)
    sizes = BuiltSizes(decoder_layers=layers)
    if first is not None:
        group = getattr(first, "num_group", None)
        chosen = getattr(first, "topk_group", None)
        sizes = BuiltSizes(
            decoder_layers=layers,
            num_experts=int(first.num_experts),
            top_k=int(first.top_k),
            num_group=int(group) if isinstance(group, int) else None,
            topk_group=int(chosen) if isinstance(chosen, int) else None,
        )
    return shapes, tuple(sorted(routers)), sizes.top_k, sizes


def expected_hf_shapes(spec: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """{state_dict name: shape} of the spec's model (transformers 5 layout), computed on the meta device."""
    return dict(_meta_layout(spec.key)[0])
