"""The policy protocol: one place that knows which model kinds exist (`tiny_moe`, `hf`, `megatron`).

Training (capture), replay and attribution parse, build, load and forward a policy through these functions,
so a replay recomputes exactly what training computed, whatever the model kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.hf_config import BACKEND_HINT, HFModelConfig
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.tiny_moe import TinyMoEConfig
from axrl_spike_replay.models.tiny_moe_weights import check_tiny_moe_weights

if TYPE_CHECKING:
    import torch
    from torch import nn

    from axrl_spike_replay.models.tiny_moe import RoutingControl

ModelSpec = Union[TinyMoEConfig, HFModelConfig, MegatronModelConfig]  # noqa: UP007 - a runtime alias on Python 3.10
MODEL_KINDS = ("tiny_moe", "hf", "megatron")


def parse_model_config(doc: Any) -> ModelSpec:
    """The `model:` section as a spec; an unknown kind is a ConfigError pointing to the command backend."""
    if not isinstance(doc, dict):
        raise ConfigError(f"model: expected a mapping, got {type(doc).__name__}")
    kind = doc.get("kind", "tiny_moe")
    if kind == "hf":
        return HFModelConfig.from_dict(doc)
    if kind == "megatron":
        return MegatronModelConfig.from_dict(doc)
    if kind == "tiny_moe":
        return TinyMoEConfig.from_dict(doc)
    raise ConfigError(f"model.kind {shown(kind, 60)} is not built in (built: {', '.join(MODEL_KINDS)}); {BACKEND_HINT}")


def build_policy(spec: ModelSpec, device: str = "cpu") -> nn.Module:
    """A freshly initialised policy for the spec (seed torch first for reproducible weights).

    An HF spec with `deterministic_algorithms` (the default, recorded in the run config) pins
    `torch.use_deterministic_algorithms(True)` in this process, in capture and replay alike. A Megatron spec
    builds its transformers model (replay route 1: the checkpoint is mapped onto it when loaded)."""
    if isinstance(spec, MegatronModelConfig):
        from axrl_spike_replay.models.mcore.megatron_weights import megatron_semantics

        return megatron_semantics(build_policy(spec.hf, device))
    if isinstance(spec, HFModelConfig):
        from axrl_spike_replay.models.hf_policy import HFPolicy

        if spec.deterministic_algorithms:
            import torch

            torch.use_deterministic_algorithms(True)
        return HFPolicy(spec, device)
    from axrl_spike_replay.models.tiny_moe import TinyMoEPolicy

    if device == "meta":
        import torch

        with torch.device("meta"):  # shapes only: nothing allocated, nothing initialised
            return TinyMoEPolicy(spec)
    return TinyMoEPolicy(spec).to(device)


def parameter_count(spec: ModelSpec) -> int:
    """Elements of the spec's parameters and persistent buffers, from its declared shapes (nothing built)."""
    from axrl_spike_replay.models.hf_config import expected_hf_shapes
    from axrl_spike_replay.models.tiny_moe import expected_state_shapes

    if isinstance(spec, MegatronModelConfig):
        spec = spec.hf
    shapes = expected_hf_shapes(spec) if isinstance(spec, HFModelConfig) else expected_state_shapes(spec)
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules a sharded replay makes FSDP units of, in forward order (the root holds the rest): the
    decoder layers, and for a transformers model with untied embeddings the input embedding and the output head
    too, as verl's FSDP2 wraps them (`verl.utils.fsdp_utils._select_fsdp2_wrap_targets`). The root keeps its own
    parameters gathered from the forward through the backward, so a unit of its own lets each of those
    vocabulary-sized matrices be resharded when it is not in use."""
    from axrl_spike_replay.models.hf_policy import HFPolicy

    if isinstance(model, HFPolicy):
        lm = model.causal_lm
        layers = list(lm.model.layers)
        if getattr(lm.config, "tie_word_embeddings", False):
            return layers
        ends = [lm.model.embed_tokens], [lm.lm_head]
        return [*ends[0], *layers, *ends[1]]
    blocks = getattr(model, "blocks", None)
    return list(blocks) if blocks is not None else []


def restore_buffers(model: nn.Module) -> None:
    """Recompute the buffers no checkpoint holds (non-persistent: rotary inverse frequencies) after a model built on
    the meta device got its memory (`to_empty`), with transformers' own initialisation of those modules."""
    from axrl_spike_replay.models.hf_policy import HFPolicy

    if not isinstance(model, HFPolicy):
        return
    lm = model.causal_lm
    for module in lm.modules():
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
            lm._init_weights(module)


def load_policy_weights(model: nn.Module, spec: ModelSpec, weights_dir: str | Path) -> None:
    """Fill the policy from a DCP checkpoint dir (either model kind), an HF directory (kind hf) or a Megatron
    `torch_dist` checkpoint (kind megatron)."""
    from axrl_spike_replay.snapshot.dcp.checkpoint import load_model_state

    if isinstance(spec, MegatronModelConfig):
        from axrl_spike_replay.models.mcore.megatron_weights import load_megatron_weights

        load_megatron_weights(model, spec, Path(weights_dir))
        return
    if isinstance(spec, HFModelConfig):
        from axrl_spike_replay.models.hf_weights import load_hf_weights

        load_hf_weights(model, hf_weights_dir(spec, Path(weights_dir)))
        return
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    load_model_state(weights_dir, state)
    model.load_state_dict(state, strict=True)


def load_policy_shards(model: nn.Module, spec: ModelSpec, weights_dir: str | Path) -> None:
    """Fill a sharded policy (FSDP2 `Shard(0)` parameters) with the rows each process holds, reading only those
    (`models.sharded_weights`): from a DCP checkpoint, an HF directory, verl FSDP shards or a Megatron checkpoint."""
    from axrl_spike_replay.models.sharded_weights import DcpSource, load_sharded, open_source

    directory = Path(weights_dir)
    if isinstance(spec, MegatronModelConfig):
        from axrl_spike_replay.models.mcore.megatron_source import MegatronSource

        load_sharded(model, MegatronSource(directory, spec), str(directory))  # a fused QKV read once per layer
        return
    if isinstance(spec, HFModelConfig):
        source_dir = hf_weights_dir(spec, directory)
        load_sharded(model, open_source(source_dir), str(source_dir))
        return
    load_sharded(model, DcpSource(directory), str(directory))


def hf_weights_dir(spec: HFModelConfig, directory: Path) -> Path:
    """Where an HF policy's weights are: `directory` when it holds any, else the spec's `path` (an HF directory or a
    verl FSDP actor checkpoint)."""
    from axrl_spike_replay.snapshot.layout import DCP_METADATA
    from axrl_spike_replay.snapshot.trainer_formats.verl_shards import is_verl_checkpoint

    held = (directory / DCP_METADATA).is_file() or any(directory.glob("*.safetensors")) or is_verl_checkpoint(directory)
    if held or spec.path is None:
        return directory
    return Path(spec.path)


def check_policy_weights(directory: Path, spec: ModelSpec, label: str) -> None:
    """SnapshotError unless the weights in `directory` fit the spec's model. Builds no module (meta tensors)."""
    if isinstance(spec, MegatronModelConfig):
        from axrl_spike_replay.models.mcore.megatron_weights import check_megatron_weights

        check_megatron_weights(directory, spec, label)
        return
    if isinstance(spec, HFModelConfig):
        from axrl_spike_replay.models.hf_weights import check_hf_weights

        check_hf_weights(hf_weights_dir(spec, directory), spec, label)
        return
    check_tiny_moe_weights(directory, spec, label)


@dataclass(frozen=True)
class RoutingShape:
    """What recorded routes must fit to be replayed on a spec's model: experts per layer, top-k, its MoE layers
    (absolute decoder ids, in order) out of `n_layers`; `absolute_slots`: a payload may also hold one slot per
    decoder layer (the transformers policy indexes such a payload by absolute layer)."""

    n_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    n_layers: int
    absolute_slots: bool


def routing_shape(spec: ModelSpec) -> RoutingShape:
    """The spec's routing, from its config (an HF spec: its routers as built on the meta device, cached; a Megatron
    spec: the transformers model it replays on)."""
    if isinstance(spec, MegatronModelConfig):
        spec = spec.hf
    if isinstance(spec, HFModelConfig):
        return RoutingShape(spec.n_experts, spec.top_k, spec.moe_layer_ids, spec.n_layers, absolute_slots=True)
    return RoutingShape(spec.n_experts, spec.top_k, spec.moe_layer_ids, spec.n_layers, absolute_slots=False)


@dataclass
class PolicyOutput:
    """A forward's per-token log-probs [B, T] (fp32; 0 where nothing is predicted), entropies and router losses."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    routes: torch.Tensor  # [B, T, L_moe, K] expert ids the forward used


def policy_forward(
    model: nn.Module, batch: dict[str, Any], routing: RoutingControl, *, need_entropy: bool
) -> PolicyOutput:
    """Forward a rank's batch and take its per-token log-probs, the same way in training and in replay: the head in
    chunks of tokens (`models.chunked_head`), never a [T, V] float32 tensor."""
    from axrl_spike_replay.models.hf_policy import HFPolicy, hf_logprobs

    if isinstance(model, HFPolicy):
        logprobs, entropy, out = hf_logprobs(model, batch, routing, need_entropy)
        return PolicyOutput(logprobs, entropy, out.aux_loss, out.z_loss, out.routes)
    from axrl_spike_replay.models.chunked_head import HeadRequest

    out = model(batch["tokens"], routing, HeadRequest(1, 1.0, need_entropy))
    if out.logprobs is None:
        raise TypeError(f"{type(model).__name__} gave no log-probs for a head request")
    return PolicyOutput(out.logprobs, out.entropy, out.aux_loss, out.z_loss, out.routes)
