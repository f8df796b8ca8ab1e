"""A policy held one decoder layer at a time: built on the meta device, each layer given memory and read from the
checkpoint when it is used, and given back after.

The reads are the sharded replay's regional readers (`models.sharded_weights`: a DCP checkpoint through DCP, an HF
directory through `safe_open`, verl FSDP shards memory-mapped; a Megatron `torch_dist` checkpoint through route 1's
mapping onto the transformers model, `models.mcore.megatron_source`: each layer's slice of the stacked Megatron keys,
a fused QKV or gate/up split as route 1 splits it), restricted to one layer's names. The policy is the one the whole
replay builds (for a Megatron snapshot route 1's transformers model), so every parameter and its gradient norms
carry the whole replay's names. The modules outside the decoder layers (embedding, final norm, head) are read once
and held. Before anything is computed, `check` refuses a checkpoint whose entries for some layer are missing, of
another shape or not backed by its data files, naming the layer (a Megatron checkpoint is checked first as route 1
checks it, naming the key).

One read runs ahead (`prefetch`): the next layer the pass needs is read on a background thread while the current
one computes, into that layer's own modules, so at most two layers are held at once (the plan counts both). The
main thread waits for it only when it needs the layer (`ReadFigures.waited`); a failed read is raised there.

A recorded precision policy (`training.precision`) is computed in as the whole replay computes it: the policy is
built with float32 master weights and cast as FSDP would (`cast_for_compute`) while still on the meta device, so
each layer is given memory in the compute dtype and the checkpoint's values are rounded into it as they are read
(the master weights' rounding, one layer at a time), and each decoder layer (each FSDP unit) casts its floating
inputs. The head's outputs are cast as the root's (`cast_outputs`), and each pass's gradient is reduced in the
policy's reduce dtype (`layer_gradients`).
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.policy import ModelSpec, build_policy, hf_weights_dir, restore_buffers, shard_units
from axrl_spike_replay.models.sharded_weights import (
    DcpSource,
    WeightSource,
    conversion_plan,
    load_sharded,
    open_source,
)
from axrl_spike_replay.replay.compute.model_build import master_spec
from axrl_spike_replay.replay.streamed.expert_share import ExpertShare, SplitRows, check_expert_split, split_experts
from axrl_spike_replay.replay.streamed.layer_program import LayerProgram, for_policy
from axrl_spike_replay.snapshot.layout import DCP_METADATA
from axrl_spike_replay.training.precision import PrecisionPolicy, cast_for_compute

_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")


@dataclass
class ReadFigures:
    """Bytes read from the checkpoint, how many layer reads, the seconds reading took (on whichever thread) and the
    seconds the computing thread waited for a read."""

    bytes_read: int = 0
    layer_reads: int = 0
    seconds: float = 0.0
    waited: float = 0.0
    by_layer: dict[int, int] = field(default_factory=dict)


def _state_names(module: nn.Module, prefix: str) -> list[str]:
    return [prefix + name for name in module.state_dict(keep_vars=True)]


def _check_storage(directory: Path) -> None:
    """SnapshotError naming the first decoder layer (or the embedding and head) whose DCP entries are not backed by
    the checkpoint's data files (`check_checkpoint_storage`), before anything is read."""
    from axrl_spike_replay.snapshot.dcp.checkpoint import check_checkpoint_storage

    problems = check_checkpoint_storage(directory)
    if not problems:
        return
    layers = sorted({int(m.group(1)) for p in problems if (m := _LAYER.search(p))})
    if layers:
        first = next(p for p in problems if (m := _LAYER.search(p)) and int(m.group(1)) == layers[0])
        where = f"decoder layer {layers[0]}" + (f" (and layers {layers[1:5]})" if len(layers) > 1 else "")
    else:
        first, where = problems[0], "the embedding and head"
    raise SnapshotError(f"{where}: {first}")


def check_streamable(spec: ModelSpec, precision: PrecisionPolicy | None) -> None:
    """ConfigError naming what a streamed replay does not read or compute yet (before anything is written)."""
    if isinstance(spec, MegatronModelConfig) and spec.hf.config.get("tie_word_embeddings", False):
        raise ConfigError(
            "a streamed replay of a Megatron checkpoint with tied input and output embeddings is not built (route "
            "1's mapping of a shared output layer is not streamed); use `shard` on or off",
            "shard",
        )


def _source(spec: ModelSpec, directory: Path) -> WeightSource:
    """The checkpoint as a sliced source of the policy's tensors, its storage checked first: a Megatron checkpoint
    through route 1's mapping (`MegatronSource`, checked as route 1 checks it), an HF spec's weights (DCP, HF
    safetensors, verl shards), our own DCP."""
    if isinstance(spec, MegatronModelConfig):
        from axrl_spike_replay.models.mcore.megatron_source import MegatronSource

        return MegatronSource(directory, spec)
    if not isinstance(spec, HFModelConfig) or (directory / DCP_METADATA).is_file():
        _check_storage(directory)
    return open_source(directory) if isinstance(spec, HFModelConfig) else DcpSource(directory)


class StreamedWeights:
    """The policy of `spec` on the meta device, its layers read one at a time from `weights_dir`."""

    def __init__(
        self,
        spec: ModelSpec,
        weights_dir: str,
        device: str,
        precision: PrecisionPolicy | None,
        read_ahead: bool = True,
        share: ExpertShare | None = None,
    ) -> None:
        check_streamable(spec, precision)
        if share is not None:
            check_expert_split(spec, share.processes)
        self.read_ahead = read_ahead
        self.spec, self.device = spec, torch.device(device)
        self.policy = build_policy(master_spec(spec, precision), "meta")
        self.program: LayerProgram = for_policy(self.policy)
        self.precision = precision if precision is not None and precision.recorded else None
        if self.precision is not None:  # as the whole replay casts (`model_build`): parameters, units' inputs
            cast_for_compute(self.policy, shard_units(self.policy), self.precision)
        self.share = share  # each MoE layer's experts split over processes (`expert_share`): this one's block
        self.split: dict[str, SplitRows] = {} if share is None else split_experts(self.policy, share)
        directory = Path(weights_dir)
        self.directory = hf_weights_dir(spec, directory) if isinstance(spec, HFModelConfig) else directory
        self.label = str(self.directory)
        self.source = _source(spec, self.directory)
        prefixes = {id(m): name for name, m in self.policy.named_modules()}
        self.layer_prefixes = [prefixes[id(layer)] + "." for layer in self.program.layers]
        self.layer_names = [
            _state_names(layer, prefix) for layer, prefix in zip(self.program.layers, self.layer_prefixes, strict=True)
        ]
        self.embedding_names = {
            prefixes[id(m)] + "." + name for m in self.program.embed_modules() for name, _ in m.named_parameters()
        }
        self._ties = _ties(self.program)
        named = dict(self.policy.named_parameters())
        tied = {id(source) for _, _, source in _tie_sources(self.program, self._ties)}
        # tied input and output embeddings: the one weight the head and the embedding both compute with
        self.tied_names = sorted(n for n in self.embedding_names if id(named[n]) in tied)
        in_layers = {name for names in self.layer_names for name in names}
        self.end_names = [name for name in self.policy.state_dict(keep_vars=True) if name not in in_layers]
        self.read = ReadFigures()
        self._figures = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, Future[None]] | None = None
        self._ready: int | None = None  # a layer read ahead, then passed over for another: kept until it is loaded
        self._sharers = 1  # backwards taken together on these weights (`shared_by`)
        self._held: int | None = None  # the layer loaded and not yet freed by every one of them
        self._frees = 0

    @property
    def n_layers(self) -> int:
        return len(self.program.layers)

    def check(self) -> None:
        """SnapshotError naming the layer (or the ends) whose saved entries are missing, misshapen or not backed."""
        state = self.policy.state_dict(keep_vars=True)
        for index, names in [(-1, self.end_names), *enumerate(self.layer_names)]:
            where = "the embedding and head" if index < 0 else f"decoder layer {index}"
            direct, converted = conversion_plan(self.policy, self.source.shapes, names)
            missing = [n for n in names if n not in direct and n not in converted]
            if missing:
                raise SnapshotError(
                    f"{self.label}: the checkpoint lacks {len(missing)} tensor(s) of {where} ({', '.join(missing[:4])})"
                )
            per_expert = sorted(n for n in converted if n in self.split)
            if per_expert:
                raise SnapshotError(
                    f"{self.label}: {where}: {per_expert[0]} is saved one tensor per expert; splitting each layer's "
                    "experts over processes reads the stacked tensor's rows (split the saved ranks instead)"
                )
            for name, saved in direct.items():
                shape = tuple(self.source.shapes[saved][0])
                model = self.split[name].shape if name in self.split else tuple(state[name].shape)
                if shape != model:
                    raise SnapshotError(f"{self.label}: {where}: {saved} is saved as {shape}, the model has {model}")

    def _bytes(self, names: list[str]) -> int:
        direct, converted = conversion_plan(self.policy, self.source.shapes, names)
        saved = [
            *direct.items(),
            *((None, k) for plan in converted.values() for ks in plan.by_pattern.values() for k in ks),
        ]
        total = 0
        for name, key in saved:
            shape, dtype = self.source.shapes[key]
            numel = 1
            for d in shape:
                numel *= d
            if name in self.split:  # this process's rows only
                rows = self.split[name]
                numel = numel // rows.shape[0] * (rows.end - rows.first)
            total += numel * getattr(torch, dtype).itemsize
        return total

    def expert_bytes(self) -> tuple[int, int]:
        """(bytes of this process's share, bytes of all) of every MoE layer's routed expert weights together."""
        mine = whole = 0
        for name, rows in self.split.items():
            size = self.policy.get_parameter(name).dtype.itemsize
            per_row = size * math.prod(rows.shape[1:])
            mine, whole = mine + per_row * (rows.end - rows.first), whole + per_row * rows.shape[0]
        return mine, whole

    def _load(
        self, modules: list[nn.Module], names: list[str], prefixes: list[str] | None = None, tie: bool = False
    ) -> None:
        start = time.perf_counter()
        for module in modules:
            module.to_empty(device=self.device)
        if tie:
            for owner, leaf, source in _tie_sources(self.program, self._ties):
                setattr(owner, leaf, source)
        state = None
        if prefixes is not None:  # the modules' own tensors: the policy's state dict is not read off this thread
            state = {}
            for module, prefix in zip(modules, prefixes, strict=True):
                state.update(module.state_dict(prefix=prefix, keep_vars=True))
        split = [n for n in names if n in self.split]
        if split:  # this process's rows of each MoE layer's expert weights (`expert_share`)
            assert state is not None  # decoder layers are read with their modules' own tensors
            self._read_rows({n: state[n] for n in split})
            state = {n: t for n, t in state.items() if n not in self.split}
        load_sharded(self.policy, self.source, self.label, only=[n for n in names if n not in self.split], state=state)
        with self._figures:
            self.read.bytes_read += self._bytes(names)
            self.read.seconds += time.perf_counter() - start

    def _read_rows(self, targets: dict[str, torch.Tensor]) -> None:
        """Fill each split parameter with its rows of the saved tensor (read as saved, then cast)."""
        direct, _ = conversion_plan(self.policy, self.source.shapes, list(targets))
        regions = {}
        for name, target in targets.items():
            saved = direct[name]
            buffer = torch.empty(tuple(target.shape), dtype=getattr(torch, self.source.shapes[saved][1]))
            regions[saved] = (self.split[name].first, buffer)
        self.source.read(regions)
        with torch.no_grad():
            for name, target in targets.items():
                target.copy_(regions[direct[name]][1])

    def load_ends(self) -> None:
        """Read the embedding, final norm and head (held until `close`); a weight the head shares with the
        embedding is one tensor again once both have memory (`to_empty` gives each module its own)."""
        self._load(self.program.end_modules(), self.end_names, tie=True)
        restore_buffers(self.policy)  # rotary frequencies: no checkpoint holds them

    def _read_layer(self, index: int) -> None:
        self._load([self.program.layers[index]], self.layer_names[index], [self.layer_prefixes[index]])
        with self._figures:
            self.read.layer_reads += 1
            self.read.by_layer[index] = self.read.by_layer.get(index, 0) + 1

    def prefetch(self, index: int) -> None:
        """Start reading decoder layer `index` on the background thread (nothing when out of range, when a read
        is already ahead: one at a time, or without `read_ahead`: the plan left it out)."""
        if not self.read_ahead or not 0 <= index < self.n_layers or self._ahead is not None or self._ready is not None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, initializer=_one_thread, thread_name_prefix="layer-read")
        self._ahead = (index, self._pool.submit(self._read_layer, index))

    def _settle(self) -> int | None:
        """Wait for the read ahead, if any; the layer it read (raising what it raised)."""
        if self._ahead is None:
            return self._ready
        index, future = self._ahead
        self._ahead = None
        start = time.perf_counter()
        try:
            future.result()
        finally:
            self.read.waited += time.perf_counter() - start
        return index

    @contextlib.contextmanager
    def shared_by(self, count: int) -> Iterator[None]:
        """Within: `count` backwards on these weights are taken a layer at a time in turn (`piece_dots.together`),
        so each decoder layer is read once for all of them: loaded by the first, freed by the last."""
        self._sharers, self._frees = max(count, 1), 0
        try:
            yield
        finally:
            held, self._sharers, self._frees, self._held = self._held, 1, 0, None
            if held is not None:  # left early (an error, a stop): given back as its last user would have
                self.free_layer(held)

    def load_layer(self, index: int) -> nn.Module:
        """Decoder layer `index` with its weights read from the checkpoint (by the read ahead, when it read it),
        or as already loaded for another backward taken beside this one (`shared_by`).

        A layer read ahead and then passed over for another (two backwards on different weights taken a layer at a
        time in turn: the second loads the layer the first just freed) stays held, not read twice, until it is
        loaded; reads never overlap each other."""
        if self._held == index:
            return self.program.layers[index]
        self._held, self._frees = index, 0
        ahead = self._settle()
        self._ready = ahead if ahead is not None and ahead != index else None
        if ahead != index:
            self._read_layer(index)
        return self.program.layers[index]

    def free_layer(self, index: int) -> None:
        """Give layer `index`'s memory back (its parameters on the meta device again, gradients dropped); under
        `shared_by`, once every backward sharing it has freed it."""
        if self._held == index:
            self._frees += 1
            if self._frees < self._sharers:
                return
            self._held, self._frees = None, 0
        if self._ready == index:
            self._ready = None
        layer = self.program.layers[index]
        for p in layer.parameters():
            p.grad = None
        layer.to_empty(device="meta")

    def close(self) -> None:
        """Give every tensor's memory back (after the read ahead, if any, has ended)."""
        with contextlib.suppress(Exception):  # closing after a failure: the read's own error is not the one raised
            self._settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.policy.to_empty(device="meta")


Tie = tuple[int, str, int, str]  # (head module, path of its parameter, embedding module, path of the one it is)


def _ties(program: LayerProgram) -> list[Tie]:
    """Where a head module's parameter is an embedding module's (tied embeddings), by module index and path."""
    embeds = program.embed_modules()
    sources = {id(p): (i, path) for i, m in enumerate(embeds) for path, p in m.named_parameters()}
    ends = program.end_modules()
    ties = []
    for i, module in enumerate(ends):
        if any(module is e for e in embeds):
            continue
        for path, p in module.named_parameters(remove_duplicate=False):
            if id(p) in sources:
                ties.append((i, path, *sources[id(p)]))
    return ties


def _tie_sources(program: LayerProgram, ties: list[Tie]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(the module holding a tied head parameter, its attribute, the embedding's parameter it is)."""
    ends, embeds = program.end_modules(), program.embed_modules()
    out = []
    for head, path, embed, source in ties:
        owner_path, _, leaf = path.rpartition(".")
        owner = ends[head].get_submodule(owner_path) if owner_path else ends[head]
        out.append((owner, leaf, embeds[embed].get_parameter(source)))
    return out


def _one_thread() -> None:
    """The read thread computes (copies, expert merges) on one intra-op thread, as the computing thread does."""
    torch.set_num_threads(1)
