"""Replay route 1: a Megatron `torch_dist` checkpoint loaded into the matching transformers model.

Plain `torch.distributed.checkpoint` reads the checkpoint with no process group and in any saved layout (its
chunks carry global offsets). Shapes are checked against the table first (meta tensors, nothing allocated);
then the weights are read one layer at a time into buffers of that layer's size (`load_regions`) and copied
into the model, so loading holds the model plus one layer, never a second copy of the model.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.models.hf_config import expected_hf_shapes, hf_config_object
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.mcore.megatron_mapping import Heads, Rule, hf_names, rules_for, split_value
from axrl_spike_replay.snapshot.trainer_formats.megatron_checkpoint import (
    COMMAND_BACKEND_HINT,
    check_megatron_storage,
    layout_problems,
    load_regions,
    read_megatron_checkpoint,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from axrl_spike_replay.snapshot.metadata import ParallelLayout


def heads_of(spec: MegatronModelConfig) -> Heads:
    """Query heads, KV heads and head size of the spec's attention (transformers' defaults filled in)."""
    config = hf_config_object(spec.hf)
    query = int(config.num_attention_heads)
    size = int(getattr(config, "head_dim", None) or int(config.hidden_size) // query)
    return Heads(query=query, groups=int(getattr(config, "num_key_value_heads", None) or query), size=size)


def _rules(spec: MegatronModelConfig) -> tuple[Rule, ...]:
    tied = bool(hf_config_object(spec.hf).tie_word_embeddings)
    return tuple(r for r in rules_for(spec.architecture, spec.config) if not (r.optional and tied))


def layer_rules(spec: MegatronModelConfig, layer: int | None) -> list[Rule]:
    """The rules with a key for decoder layer `layer` (None: the global keys)."""
    if layer is None:
        return [r for r in _rules(spec) if not r.layered]
    moe = frozenset(spec.moe_layer_ids)
    return [r for r in _rules(spec) if r.layered and r.applies(layer, moe)]


@functools.lru_cache(maxsize=8)
def _expected(spec: MegatronModelConfig) -> dict[str, tuple[int, ...]]:
    hf = expected_hf_shapes(spec.hf)
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in (None, *range(spec.n_layers)):
        for rule in layer_rules(spec, layer):
            parts = [hf[name] for name in hf_names(rule, layer)]
            shape = (sum(p[0] for p in parts), *parts[0][1:]) if rule.split != "copy" else parts[0]
            shapes[rule.key(layer)] = (spec.n_layers, *shape) if rule.stacked else shape
    return shapes


def expected_megatron_shapes(spec: MegatronModelConfig) -> dict[str, tuple[int, ...]]:
    """{checkpoint key: global shape} a Megatron-core checkpoint of the spec's model holds (meta build)."""
    return dict(_expected(spec))


def check_megatron_weights(directory: Path, spec: MegatronModelConfig, label: str) -> None:
    """SnapshotError unless the Megatron checkpoint in `directory` is the spec's model, key for key and shape for
    shape, with every size it declares backed by its data files. Reads headers only."""
    ckpt = read_megatron_checkpoint(directory)
    check_megatron_storage(directory)
    expected = expected_megatron_shapes(spec)
    missing = sorted(k for k in expected if k not in ckpt.tensors)
    if missing:
        raise SnapshotError(
            f"{directory}: {label} lacks {len(missing)} tensors a {spec.architecture} Megatron checkpoint holds "
            f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})"
        )
    wrong = [
        f"{key} {ckpt.tensors[key][0]} (the run config's model needs {shape})"
        for key, shape in expected.items()
        if tuple(ckpt.tensors[key][0]) != shape
    ]
    if wrong:
        raise SnapshotError(f"{directory}: {label} does not fit the run config's model: {'; '.join(wrong[:4])}")
    unplaced = sorted(k for k in ckpt.tensors if k not in expected)
    if unplaced:
        # multi-token prediction layers: transformers' models build none, so route 1 would drop their loss
        mtp = (
            " (multi-token prediction layers, which transformers' model does not build)"
            if any(k.startswith("mtp.") for k in unplaced)
            else ""
        )
        raise SnapshotError(
            f"{directory}: {label} holds tensors the {spec.architecture} mapping does not place "
            f"({shown(unplaced[:4], 200)}){mtp}: a model Megatron builds that is not mapped onto transformers here; "
            f"{COMMAND_BACKEND_HINT}"
        )


def _buffer(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype))


def _place(rule: Rule, layer: int | None, value: torch.Tensor, heads: Heads, params: dict[str, torch.Tensor]) -> None:
    names = hf_names(rule, layer)
    values = split_value(rule, value, heads)
    for name, part in zip(names, values, strict=True):
        target = params[name]
        if tuple(target.shape) != tuple(part.shape):  # checked against the table already: a table error
            raise SnapshotError(f"{name}: mapped a {tuple(part.shape)} tensor onto {tuple(target.shape)}")
        target.copy_(part)


def load_megatron_weights(model: nn.Module, spec: MegatronModelConfig, directory: Path) -> None:
    """Fill the transformers policy's parameters from the Megatron checkpoint in `directory`, layer by layer."""
    import torch

    check_megatron_weights(directory, spec, "the checkpoint")
    ckpt = read_megatron_checkpoint(directory)
    heads = heads_of(spec)
    params = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for layer in (None, *range(spec.n_layers)):
            regions = {}
            for rule in layer_rules(spec, layer):
                key = rule.key(layer)
                shape, dtype = ckpt.tensors[key]
                size = (1, *shape[1:]) if rule.stacked else shape
                regions[key] = ((layer if rule.stacked else 0,) + (0,) * (len(shape) - 1), _buffer(size, dtype))
            load_regions(directory, regions)
            for rule in layer_rules(spec, layer):
                value = regions[rule.key(layer)][1]
                _place(rule, layer, value[0] if rule.stacked else value, heads, params)


def check_saved_layout(directory: Path, layout: ParallelLayout) -> None:
    """SnapshotError unless the checkpoint's shards and files fit the snapshot's saved layout (TP/ETP shards,
    writer ranks, every pipeline stage's files present)."""
    problems = layout_problems(read_megatron_checkpoint(directory), layout)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        hint = f"; fix the run config's `parallel:`, or {COMMAND_BACKEND_HINT}"
        hint = "" if COMMAND_BACKEND_HINT in problems[0] else hint
        raise SnapshotError(f"{problems[0]}{more}{hint}")


def megatron_semantics(policy: nn.Module) -> nn.Module:
    """The transformers policy computing what Megatron's GPTModel computes where the two differ by design, both
    visible only where a loss reaches pad positions (the router z-loss counts every token). Transformers'
    embedding keeps the pad token's row out of every gradient (`padding_idx`), Megatron's
    `VocabParallelEmbedding` has no such row; transformers' eager attention adds its mask to the scores, Megatron
    fills them (`models.mcore.megatron_attention`). Route 1 follows Megatron."""
    from axrl_spike_replay.models.mcore.megatron_attention import use_megatron_attention

    embedding = getattr(getattr(policy, "model", None), "embed_tokens", None)
    if embedding is not None and getattr(embedding, "padding_idx", None) is not None:
        embedding.padding_idx = None
    config = getattr(getattr(policy, "causal_lm", policy), "config", None)  # HFPolicy keeps the model aside
    if config is not None:
        use_megatron_attention(config)
    return policy
