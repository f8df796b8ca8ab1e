"""The streamed step's passes: the forward layer by layer over every micro-batch, and one config's loss and backward
layer by layer in reverse.

Forward (once per forward group: configs sharing weights and routing): the embedding of every micro-batch of every
saved rank, then for each decoder layer in order its weights read, every micro-batch run through it with its rank's
recorded routes, the layer's outputs (next hidden states, router logits or losses, routes) kept as boundaries, the
layer freed. Nothing records a graph. Each pass reads one layer ahead (`StreamedWeights.prefetch`): the next
layer's read overlaps the current layer's compute.

Backward (once per config): the head and the config's loss on every micro-batch, as `rank_passes.forward_group` computes
them (`loss_batch`, `config_loss`, the micro-batch's scale), backpropagated to the last hidden states and to every
layer's router outputs; then for each layer in reverse its weights read again, each micro-batch's layer recomputed
from its saved input with the routes it took, its saved output gradient backpropagated into the layer's parameters
(`PieceGradient`: summed over micro-batches and ranks, measured, freed) and into its input, which becomes the next
layer's output gradient; last, the embedding.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.compute.outcome_figures import RankTrace
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, config_loss, loss_batch
from axrl_spike_replay.replay.compute.rank_passes import rank_step_metrics
from axrl_spike_replay.replay.streamed.boundaries import BoundaryStore
from axrl_spike_replay.replay.streamed.layer_gradients import PieceGradient, StepFigures
from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights
from axrl_spike_replay.replay.streamed.rank_chain import RankChain
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.micro_batches import MicroBatch, stitch, take, take_routing
from axrl_spike_replay.training.policy_loss import LossOutput
from axrl_spike_replay.training.precision import cast_outputs


@dataclass
class Item:
    """One micro-batch of one saved rank: its batch, routing, and where it stands in the rank's passes."""

    rank: int
    index: int
    mb: MicroBatch
    batch: dict[str, Any]
    routing: Any
    passes: int  # micro-batches of its rank


def stream_items(inputs: RankInputs, group: Sequence[AppliedConfig]) -> list[Item]:
    """Every saved rank's micro-batches in the whole replay's order (ranks in order, each rank's micro-batches)."""
    items = []
    for rank in sorted(inputs.batches):
        saved = inputs.batches[rank]
        size = int(saved["tokens"].shape[0])
        left_out = not any(cfg.samples.keeps_rank(rank) for cfg in group)
        control = inputs.routing(group[0], rank, left_out=left_out)
        plan = inputs.plan(rank)
        for index, mb in enumerate(plan):
            items.append(Item(rank, index, mb, take(saved, mb), take_routing(control, mb, size), len(plan)))
    return items


def forward_layers(
    weights: StreamedWeights,
    items: Sequence[Item],
    store: BoundaryStore,
    cancel: threading.Event | None = None,
    say: Callable[[str], None] | None = None,
) -> None:
    """The forward (see the module docstring): boundaries ("h", layer, item) and ("x", layer, item) in `store`."""
    program = weights.program
    weights.prefetch(0)  # read while the embedding computes
    with torch.no_grad():
        for k, item in enumerate(items):
            store.put(("h", 0, k), (program.embed(item.batch),))
        for layer in range(weights.n_layers):
            check_cancel(cancel, "replay")
            weights.load_layer(layer)
            weights.prefetch(layer + 1)
            for k, item in enumerate(items):
                hidden = store.get(("h", layer, k))[0]
                assert hidden is not None
                out = program.run_layer(layer, hidden, item.batch, item.routing, None)
                store.put(("h", layer + 1, k), (out.hidden,))
                store.put(("x", layer, k), (*out.extras, out.chosen))
            weights.free_layer(layer)
            if say is not None:
                say(f"streamed forward: layer {layer + 1}/{weights.n_layers} done")


@dataclass
class ConfigPass:
    """What one config's backward gives: its figures, each rank's metrics, its traces and the per-piece gradients
    a caller asked to see (`on_piece`)."""

    figures: StepFigures
    rank_metrics: list[dict[str, Any]]
    traces: dict[int, RankTrace]


PieceHook = Callable[[str, Sequence[str], Sequence[torch.Tensor | None]], None]


def _leaf(value: torch.Tensor | None, grad: bool) -> torch.Tensor:
    assert value is not None
    return value.detach().requires_grad_(grad)


def _rank_rows(
    results: dict[int, list[tuple[LossOutput, float]]], extra: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    return [{"rank": rank, **rank_step_metrics(results[rank]), **extra.get(rank, {})} for rank in sorted(results)]


def _traces(
    items: Sequence[Item], results: dict[int, list[tuple[LossOutput, float]]], inputs: RankInputs
) -> dict[int, RankTrace]:
    traces = {}
    for rank, parts in results.items():
        plan = inputs.plan(rank)
        size, width = sum(len(mb.rows) for mb in plan), max(mb.width for mb in plan)
        traces[rank] = RankTrace(
            mask=stitch([r.mask.detach() for r, _ in parts], plan, size, width),
            per_token=stitch([r.per_token.detach() for r, _ in parts], plan, size, width),
        )
    return traces


def backward_config(
    weights: StreamedWeights,
    items: Sequence[Item],
    store: BoundaryStore,
    inputs: RankInputs,
    cfg: AppliedConfig,
    counts: GlobalCounts | None,
    world_size: int,
    *,
    need_entropy: bool,
    keep_own: bool,
    reduce_dtype: torch.dtype | None = None,
    on_piece: PieceHook | None = None,
    cancel: threading.Event | None = None,
    pulls: dict[int, list[torch.Tensor]] | None = None,
    chain: RankChain | None = None,
) -> ConfigPass:
    """One config's loss and backward through every layer (see the module docstring); `chain`: this process streams
    a block of the saved ranks, its piece sums chained to the other processes' (`rank_chain`)."""
    steps = backward_steps(
        weights, items, store, inputs, cfg, counts, world_size, need_entropy=need_entropy, keep_own=keep_own,
        reduce_dtype=reduce_dtype, on_piece=on_piece, cancel=cancel, pulls=pulls, chain=chain,
    )  # fmt: skip
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def backward_steps(
    weights: StreamedWeights,
    items: Sequence[Item],
    store: BoundaryStore,
    inputs: RankInputs,
    cfg: AppliedConfig,
    counts: GlobalCounts | None,
    world_size: int,
    *,
    need_entropy: bool,
    keep_own: bool,
    reduce_dtype: torch.dtype | None = None,
    on_piece: PieceHook | None = None,
    cancel: threading.Event | None = None,
    pulls: dict[int, list[torch.Tensor]] | None = None,
    tag: str = "",
    chain: RankChain | None = None,
) -> Generator[str, None, ConfigPass]:
    """`backward_config` a piece at a time: yields each piece's label (head, layer i, embedding) once it is
    measured and its layer freed, and returns the config's pass. Several configs' steps taken in turn see the same
    piece together (`streamed.piece_dots`); `tag` keeps their output gradients apart in one store. With `pulls`,
    each kept micro-batch's dLoss/dlogprobs lands there, per saved rank in plan order."""
    program, policy = weights.program, weights.policy
    named = dict(policy.named_parameters())
    head_names = [n for n in weights.end_names if n in named and not _is_embedding(weights, n)]
    embed_names = [n for n in weights.end_names if n in named and _is_embedding(weights, n)]
    figures = StepFigures()
    results: dict[int, list[tuple[LossOutput, float]]] = {}
    extra: dict[int, dict[str, Any]] = {}
    kept: list[bool] = []
    head = PieceGradient(head_names, world_size, reduce_dtype, keep_own, chain)
    tied_names = list(weights.tied_names)  # tied embeddings: the head's half summed here, measured with the embedding
    tied = PieceGradient(tied_names, world_size, reduce_dtype, keep_own, chain)
    tied.defer = lambda rank, own: store.put(("tied", tag, rank), own)  # each rank's own head half, until the end
    last = weights.n_layers
    weights.prefetch(last - 1)  # read while the head and the loss compute
    for k, item in enumerate(items):
        check_cancel(cancel, "replay")
        bounds = [store.get(("x", layer, k)) for layer in range(last)]
        keeps = cfg.samples.keeps_rank(item.rank)
        kept.append(keeps)
        with torch.enable_grad():
            hidden = _leaf(store.get(("h", last, k))[0], keeps)
            extras = [tuple(_leaf(t, keeps) for t in b[:-1]) for b in bounds]
            out = program.head(hidden, item.batch, extras, [b[-1] for b in bounds], need_entropy)
            if weights.precision is not None:
                out = cast_outputs(out, weights.precision)
            batch = loss_batch(inputs.batches[item.rank], item.rank, cfg, out.logprobs, item.mb)
            result = config_loss(out, batch, cfg, item.rank, counts, cfg.needs_entropy)
            loss = result.loss * item.mb.scale if item.mb.scale != 1.0 else result.loss
        results.setdefault(item.rank, []).append((result, item.mb.scale))
        if not keeps:  # left out: nothing of this rank reaches the step, router terms too
            extra[item.rank] = {"left_out": True}
            head.skip(item.rank, item.passes)
            tied.skip(item.rank, item.passes)
            continue
        flat = [t for layer in extras for t in layer]
        wrt = [named[n] for n in head_names + tied_names] + [hidden, *flat]
        if pulls is not None:
            wrt.append(out.logprobs)
        grads = list(torch.autograd.grad(loss, wrt, allow_unused=True))
        if pulls is not None:
            pull = grads.pop()
            pulls.setdefault(item.rank, []).append(
                (pull if pull is not None else torch.zeros_like(out.logprobs)).detach()
            )
        head.add(item.rank, grads[: len(head_names)], item.passes)
        ends = len(head_names) + len(tied_names)
        if tied_names:
            tied.add(item.rank, grads[len(head_names) : ends], item.passes)
        got = grads[ends:]
        store.put(("g", tag, k), (got[0] if got[0] is not None else torch.zeros_like(hidden),))
        at = 1
        for layer, layer_extras in enumerate(extras):
            if layer_extras:
                store.put(("gx", tag, layer, k), tuple(got[at : at + len(layer_extras)]))
                at += len(layer_extras)
        del loss, result, out, grads, got
    _measure(head, figures, on_piece, "head")
    held = tied.hand_on() if tied_names else []
    if tied_names and chain is not None:
        chain.hand_back(held)  # the last process's sum to the first, where the embedding's sum starts
    yield "head"
    for layer in reversed(range(last)):
        check_cancel(cancel, "replay")
        module = weights.load_layer(layer)
        weights.prefetch(layer - 1)
        params = [(n, p) for n, p in zip(_param_names(weights, layer), module.parameters(), strict=True)]
        piece = PieceGradient([n for n, _ in params], world_size, reduce_dtype, keep_own, chain)
        piece.precise = frozenset(weights.split)
        for k, item in enumerate(items):
            if not kept[k]:
                piece.skip(item.rank, item.passes)
                continue
            saved = store.get(("x", layer, k))
            grad_out = store.get(("g", tag, k))[0]
            grad_extras = store.get(("gx", tag, layer, k)) if ("gx", tag, layer, k) in store else ()
            with torch.enable_grad():
                hidden = _leaf(store.get(("h", layer, k))[0], True)
                out = program.run_layer(layer, hidden, item.batch, item.routing, saved[-1])
                outputs, seeds = [out.hidden], [grad_out]
                for value, seed in zip(out.extras, grad_extras, strict=False):
                    if seed is not None:
                        outputs.append(value)
                        seeds.append(seed)
                grads = torch.autograd.grad(outputs, [p for _, p in params] + [hidden], seeds, allow_unused=True)
            piece.add(item.rank, grads[:-1], item.passes)
            back = grads[-1]
            store.put(("g", tag, k), (back if back is not None else torch.zeros_like(hidden),))
            store.drop(("gx", tag, layer, k))
            del out, grads, outputs, seeds
        _measure(piece, figures, on_piece, f"layer {layer}")
        weights.free_layer(layer)
        yield f"layer {layer}"
    embed = PieceGradient(embed_names, world_size, reduce_dtype, keep_own, chain)
    if tied_names:
        if chain is not None and not chain.last:
            held = chain.take_back(len(tied_names))
        embed.seed(tied_names, held)
        embed.resume = partial(_resumed, store, tag, [embed_names.index(n) for n in tied_names], len(embed_names))
    for k, item in enumerate(items):
        if not kept[k]:
            embed.skip(item.rank, item.passes)
            continue
        seed = store.get(("g", tag, k))[0]
        with torch.enable_grad():
            hidden = program.embed(item.batch)
            grads = torch.autograd.grad([hidden], [named[n] for n in embed_names], [seed], allow_unused=True)
        embed.add(item.rank, grads, item.passes)
        store.drop(("g", tag, k))
    _measure(embed, figures, on_piece, "embedding")
    if chain is not None:
        chain.settle()
    yield "embedding"
    if weights.share is not None:  # the experts split over processes: every process's figures put together
        figures = weights.share.merged(figures, weights.split)
    return ConfigPass(figures, _rank_rows(results, extra), _traces(items, results, inputs))


def _resumed(store: BoundaryStore, tag: str, at: list[int], count: int, rank: int) -> list[torch.Tensor | None]:
    """Rank `rank`'s own head half of the tied weights (`PieceGradient.defer`), placed in the embedding piece's
    order; empty when the head kept none (the rank left out)."""
    key = ("tied", tag, rank)
    if key not in store:
        return []
    held = store.get(key)
    store.drop(key)
    own: list[torch.Tensor | None] = [None] * count
    for i, value in zip(at, held, strict=True):
        own[i] = value
    return own


def _measure(piece: PieceGradient, figures: StepFigures, on_piece: PieceHook | None, label: str) -> None:
    reduced = piece.measure(figures)
    if on_piece is not None:
        on_piece(label, piece.names, reduced)


def _param_names(weights: StreamedWeights, layer: int) -> list[str]:
    prefix = weights.layer_prefixes[layer]
    return [prefix + name for name, _ in weights.program.layers[layer].named_parameters()]


def _is_embedding(weights: StreamedWeights, name: str) -> bool:
    return name in weights.embedding_names
