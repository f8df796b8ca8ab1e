"""A Megatron `torch_dist` checkpoint seen as the transformers model's tensors: route 1's mapping
(`models.mcore.megatron_mapping`) behind the sliced-source protocol of `models.sharded_weights` (`WeightSource`).

Its names and shapes are the transformers model's (`model.layers.3.self_attn.q_proj.weight`), each tied to the
Megatron key it comes from: a layer's slice of a stacked key (`decoder.layers.self_attention.linear_qkv.weight`
[L, ...] at layer 3) or a per-layer key (DeepSeek-V3's `decoder.layers.3.…`). A read of some of its names reads, per
Megatron key, only that layer's region (`load_regions`: DCP reads the chunks overlapping it, whatever TP/EP layout
saved them): rows of a key copied as is, the whole layer of a fused one (QKV per query group, gate | up halves),
split as route 1 splits it. So reading one decoder layer's names costs that layer's bytes, and what each parameter
gets is what `load_megatron_weights` gives it. Both readers by rows use it: the sharded replay's FSDP2 processes
(`load_sharded`, each its rows of each tensor) and the streamed replay's one layer at a time
(`replay.streamed.layer_weights`).

The checkpoint is checked first as route 1 checks it (`check_megatron_weights`: every key and shape the spec's
model needs, nothing it would leave out, every declared size backed by the data files).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.models.hf_config import expected_hf_shapes
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.mcore.megatron_mapping import Rule, hf_names, split_value
from axrl_spike_replay.models.mcore.megatron_weights import check_megatron_weights, heads_of, layer_rules
from axrl_spike_replay.snapshot.trainer_formats.megatron_checkpoint import load_regions, read_megatron_checkpoint

if TYPE_CHECKING:
    import torch

    from axrl_spike_replay.models.sharded_weights import Regions


@dataclass(frozen=True)
class _Place:
    """Where a transformers tensor comes from: a rule, its layer (None: a global key) and its part of the split."""

    rule: Rule
    layer: int | None
    part: int
    dtype: str

    @property
    def key(self) -> str:
        """The checkpoint key it is read from."""
        return self.rule.key(self.layer)


class MegatronSource:
    """The Megatron checkpoint in `directory` as the spec's transformers tensors ({name: (shape, saved dtype)}),
    read a layer's regions at a time."""

    def __init__(self, directory: Path, spec: MegatronModelConfig) -> None:
        check_megatron_weights(directory, spec, "the checkpoint")
        self.directory = directory
        self.heads = heads_of(spec)
        saved = read_megatron_checkpoint(directory).tensors
        self.saved_shapes = {key: tuple(shape) for key, (shape, _) in saved.items()}
        hf = expected_hf_shapes(spec.hf)
        self.places: dict[str, _Place] = {}
        self.shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        for layer in (None, *range(spec.n_layers)):
            for rule in layer_rules(spec, layer):
                dtype = saved[rule.key(layer)][1]
                for part, name in enumerate(hf_names(rule, layer)):
                    self.places[name] = _Place(rule, layer, part, dtype)
                    self.shapes[name] = (tuple(hf[name]), dtype)

    def read(self, regions: Regions) -> None:
        """Fill each target with rows [row, row + len(target)) of its transformers tensor: one region per Megatron
        key (a key's rows for a tensor copied as is, the layer's whole tensor for a fused one), then split."""
        import torch

        by_key: dict[str, list[tuple[_Place, int, torch.Tensor]]] = {}
        for name, (row, target) in regions.items():
            place = self.places.get(name)
            if place is None:
                raise SnapshotError(f"{self.directory}: the Megatron mapping places no checkpoint key on {name}")
            by_key.setdefault(place.key, []).append((place, row, target))
        reads: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        for key, wanted in by_key.items():
            place, row, target = wanted[0]
            shape = self.saved_shapes[key]
            lead = (place.layer,) if place.rule.stacked and place.layer is not None else ()
            if place.rule.split == "copy":  # one tensor: the rows asked of the layer's tensor
                size = (*(1,) * len(lead), *target.shape)
                offsets = (*lead, *((row,) + (0,) * (target.dim() - 1) if target.dim() else ()))
            else:  # fused: the projections' rows interleave, the layer's whole tensor is read, then split
                size = (*(1,) * len(lead), *shape[len(lead) :])
                offsets = (*lead, *(0,) * (len(shape) - len(lead)))
            reads[key] = (offsets, torch.empty(size, dtype=getattr(torch, place.dtype)))
        load_regions(self.directory, reads)
        with torch.no_grad():
            for key, wanted in by_key.items():
                value = reads[key][1]
                rule = wanted[0][0].rule
                value = value[0] if rule.stacked and wanted[0][0].layer is not None else value
                parts = split_value(rule, value, self.heads) if rule.split != "copy" else None
                for place, row, target in wanted:
                    if parts is None:
                        target.copy_(value)
                        continue
                    part = parts[place.part]
                    target.copy_(part[row : row + target.shape[0]] if target.dim() else part)
