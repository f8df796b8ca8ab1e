"""The `model:` section of a policy trained with Megatron-core (`kind: megatron`), parsed and checked before any run.

RL trainers that train with Megatron-core (verl's Megatron workers, slime, NeMo-RL) start from a
transformers checkpoint and build the Megatron model from its HF config (mbridge / Megatron-Bridge),
so the section holds that HF config and the matching transformers `architecture`, as `kind: hf` does,
plus what is Megatron's own: the release that wrote the checkpoint and its format. The weights are the
snapshot's Megatron `torch_dist` checkpoint, read in any saved TP/PP/EP layout.

    model:
      kind: megatron
      architecture: qwen3_moe        # the transformers architecture the checkpoint maps onto
      config: {...}                  # its HF config (or `path:` to an HF directory's config.json)
      megatron_version: 0.16.1       # the megatron-core release the trainer ran
      checkpoint_format: torch_dist

Replay route 1 (built in) rebuilds the transformers model and maps the checkpoint onto it
(`models.mcore.megatron_weights`); route 2 (the `megatron` extra) rebuilds Megatron-core's own `GPTModel`
(`models.mcore.megatron_policy`). Architectures Megatron builds but we do not map are refused here, naming
the command backend.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.architectures import ARCHITECTURES
from axrl_spike_replay.models.hf_config import BACKEND_HINT, HFModelConfig

if TYPE_CHECKING:
    import torch

# transformers architectures whose Megatron-core checkpoint we map (models.mcore.megatron_mapping declares each).
MAPPED_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
CHECKPOINT_FORMATS = ("torch_dist",)
# megatron-core release series whose checkpoints and modules were checked (see models/mcore/megatron_cpu.py).
SUPPORTED_MEGATRON_SERIES = ("0.16",)
MEGATRON_KEYS = ("megatron_version", "checkpoint_format")
# Why an architecture Megatron-core builds is not mapped, where the reason is known (checked on megatron-core 0.16.1).
UNMAPPED_WHY: dict[str, str] = {
    # transformers' OlmoeAttention: q_norm = RMSNorm(hidden_size) over the whole query projection, k_norm over all
    # KV heads at once; megatron-core's q_layernorm / k_layernorm are built with hidden_size_per_attention_head
    # (attention.py, SelfAttention) and no config field widens them: the two models normalise differently.
    "olmoe": (
        "megatron-core 0.16.1 cannot build OLMoE as transformers defines it: OLMoE's q_norm and k_norm normalise "
        "the whole query and key projections (all heads at once), megatron-core's qk_layernorm normalises each head"
    ),
    # megatron-core 0.16.1 has the parts (softmax_type "learnable" for the sinks, window_size with
    # window_attn_skip_freq, activation_func_clamp_value and glu_linear_offset for the clamped SwiGLU, biases with
    # add_bias_linear), but no mapping of ours is checked against a GPTModel built from them.
    "gpt_oss": (
        "megatron-core 0.16.1 builds its parts (attention sinks as a learnable softmax offset, alternating "
        "sliding-window layers, the clamped SwiGLU with its +1 offset, biases on every projection, expert and "
        "router), but route 1 has no mapping checked against it: transformers interleaves gpt-oss's expert "
        "gate/up columns where Megatron stacks gate then up rows, and the sinks and biases have no rule here"
    ),
}


def _supported_version(version: str) -> bool:
    return any(version == s or version.startswith(f"{s}.") for s in SUPPORTED_MEGATRON_SERIES)


@dataclass(frozen=True)
class MegatronModelConfig:
    """`model:` with `kind: megatron`: the matching transformers model (`hf`) and Megatron's own facts."""

    hf: HFModelConfig
    megatron_version: str = "0.16.1"
    checkpoint_format: str = "torch_dist"

    def __post_init__(self) -> None:
        if not isinstance(self.megatron_version, str) or not _supported_version(self.megatron_version):
            raise ConfigError(
                f"model.megatron_version {shown(self.megatron_version, 40)}: checkpoints of this megatron-core "
                f"release are not read by the torch engine (checked: {', '.join(SUPPORTED_MEGATRON_SERIES)}.x); "
                f"{BACKEND_HINT}"
            )
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ConfigError(
                f"model.checkpoint_format {shown(self.checkpoint_format, 40)} is not read (read: "
                f"{', '.join(CHECKPOINT_FORMATS)}); {BACKEND_HINT}"
            )
        check_mappable(self.hf)

    # What the engine asks of any spec, answered by the transformers model route 1 builds.
    @property
    def architecture(self) -> str:
        return self.hf.architecture

    @property
    def config(self) -> dict[str, Any]:
        return self.hf.config

    @property
    def n_layers(self) -> int:
        return self.hf.n_layers

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return self.hf.moe_layer_ids

    @property
    def top_k(self) -> int:
        return self.hf.top_k

    @property
    def temperature(self) -> float:
        return self.hf.temperature

    @property
    def deterministic_algorithms(self) -> bool:
        return self.hf.deterministic_algorithms

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.hf.torch_dtype

    def to_dict(self) -> dict[str, Any]:
        doc = self.hf.to_dict()
        doc["kind"] = "megatron"
        doc.update(megatron_version=self.megatron_version, checkpoint_format=self.checkpoint_format)
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> MegatronModelConfig:
        """Build from the `model:` section (kind: megatron): the HF part as `kind: hf` reads it, plus Megatron's."""
        values = {k: doc[k] for k in MEGATRON_KEYS if k in doc}
        for key, value in values.items():
            if not isinstance(value, str):
                raise ConfigError(f"model.{key} must be a string, got {shown(value, 60)}")
        architecture = doc.get("architecture")
        if isinstance(architecture, str) and architecture not in MAPPED_ARCHITECTURES:
            raise ConfigError(unmapped_message(architecture))
        hf_doc = {k: v for k, v in doc.items() if k not in MEGATRON_KEYS}
        hf_doc["kind"] = "hf"
        # Megatron's experts are separate parameters; transformers' eager loop indexes one fused tensor per
        # expert, whose backward writes a whole [E, ...] gradient per expert (E^2 traffic): 4x slower at 32
        # experts. Route 1 is not the trainer's kernel either way, so unless the config names one it takes
        # transformers' grouped matmul.
        hf_doc.setdefault("experts_implementation", "grouped_mm")
        return cls(hf=HFModelConfig.from_dict(hf_doc), **values)

    def with_hf(self, **changes: Any) -> MegatronModelConfig:
        """The spec with fields of its transformers model changed (dtype, kernels)."""
        return replace(self, hf=replace(self.hf, **changes))


def unmapped_message(architecture: str) -> str:
    """Why an architecture's Megatron checkpoint cannot be mapped onto transformers, and what to use."""
    mapped = f"(mapped: {', '.join(MAPPED_ARCHITECTURES)}); {BACKEND_HINT}"
    if architecture in UNMAPPED_WHY:
        return f"model.architecture {shown(architecture, 60)}: {UNMAPPED_WHY[architecture]} {mapped}"
    built = "Megatron-core builds it, but " if architecture in ARCHITECTURES else ""
    return (
        f"model.architecture {shown(architecture, 60)}: {built}its Megatron checkpoint is not mapped onto a "
        f"transformers model here {mapped}"
    )


def check_mappable(hf: HFModelConfig) -> None:
    """ConfigError unless the HF config is one whose Megatron-core model we map layer for layer: every decoder
    layer an MoE layer (DeepSeek-V3: its dense first layers too), no biases but Qwen2-MoE's QKV bias, no sliding
    window, default RoPE
    (DeepSeek-V3: yarn too), and for DeepSeek-V3 what `_deepseek_problems` checks."""
    if hf.architecture not in MAPPED_ARCHITECTURES:
        raise ConfigError(unmapped_message(hf.architecture))
    config = hf.config
    problems = []
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        problems.append("dense MLP layers among the MoE layers (mlp_only_layers / decoder_sparse_step)")
    if config.get("attention_bias"):
        problems.append("attention biases (attention_bias)")
    if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
        problems.append("sliding-window attention")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind != "default" and not (hf.architecture == "deepseek_v3" and kind == "yarn"):  # MLA's yarn is mapped
        problems.append(f"RoPE scaling {shown(rope.get('rope_type', rope.get('type')), 40)}")
    if hf.architecture == "deepseek_v3":
        problems.extend(_deepseek_problems(config))
    if problems:
        raise ConfigError(
            f"model: a {hf.architecture} Megatron checkpoint with {'; '.join(problems)} is not mapped here; "
            f"{BACKEND_HINT}"
        )


def _deepseek_problems(config: dict[str, Any]) -> list[str]:
    """What of a DeepSeek-V3 config Megatron-core's model and transformers' compute differently (megatron-core 0.16.1,
    transformers 5): each refused by name rather than mapped approximately."""
    problems = []
    if config.get("rope_interleave", True) is False:
        # both de-interleave the RoPE dims of MLA (megatron: `multi_latent_attention` in rope_utils); without
        # rope_interleave transformers rotates them as laid out, and the q_b / kv_a rows would need permuting
        problems.append("rope_interleave false (Megatron's MLA always de-interleaves the RoPE dims)")
    topk, groups = int(config.get("num_experts_per_tok") or 1), int(config.get("n_group") or 1)
    if groups > 1 and topk // int(config.get("topk_group") or 1) != 2:
        # transformers scores a group by its top 2 experts, megatron-core by its top topk // topk_group
        problems.append("group-limited routing whose groups Megatron scores by other than their top 2 experts")
    if topk > 1 and config.get("norm_topk_prob") is False:
        problems.append("norm_topk_prob false (Megatron's sigmoid router always renormalises its top-k)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "yarn":
        # megatron-core's YarnRotaryEmbedding: cos/sin scaled by mscale(f, mscale) / mscale(f, mscale_all_dim)
        # always, transformers' only when both are set (else by mscale(f)); no `attention_factor`, always truncated
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if not (mscale and all_dim) and mscale not in (None, 1, 1.0):
            problems.append("yarn with an mscale but no mscale_all_dim (the two scale cos/sin differently)")
        if rope.get("attention_factor") is not None or rope.get("truncate", True) is False:
            problems.append("yarn with attention_factor or truncate false (megatron-core has neither)")
        if rope.get("factor") is None:
            problems.append("yarn without a factor")
    return problems
