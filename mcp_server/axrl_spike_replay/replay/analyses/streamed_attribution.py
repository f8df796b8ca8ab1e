"""Attribution streamed: each sample's contribution to the grad norm, <g_s, g> / ||g||, as per-piece dot products of
each sample's gradient with the total gradient g, one decoder layer at a time.

`replay.analyses.attribution` defines the figures: g is the step's DP-mean gradient, g_s sample s's share of it
through its own log-probs (and entropies), and the batch-level router losses' share is one more term; the shares add
up to ||g||^2. Streamed, the step's forward runs once (`layer_passes.forward_layers`) and its backward once
(`layer_passes.backward_steps`, the whole gradient a piece at a time). Each piece's reduced gradient g_p is complete
once every micro-batch has added to it; then, with the piece still held (`on_piece`), every micro-batch's piece is
computed again from its saved input and taken backward once per sample, from that sample's row of the policy
loss's gradient at the piece's output (the other rows zero: a sample's log-probs depend on its own row only), and
<g_s,p, g_p> (float64) is added to the sample's sum; the router losses' gradient at the piece, carried back on its
own, is dotted with g_p the same way. The policy loss's and the router losses' gradients at the piece's input carry
on to the piece below, as boundaries beside the total one.

Passes: two over the checkpoint (every decoder layer read once in the forward and once in the backward, as one
streamed replay of the step). In the backward, each micro-batch's layer is recomputed twice (the total gradient,
then the samples'), with one backward per sample, one for the policy loss's gradient at the layer's input and one
for the router losses'. The whole attribution's forward-mode pass along g needs all of g before it starts, which
a streamed step never holds.

Split over processes (`streamed_split_dots`), each streams a contiguous block of the saved ranks: the pieces' sums
pass down a chain in the one process's order and the last process's reduced piece is spread back to every process
(`rank_chain`, `everywhere`), which dots its own samples with it; the router terms are added piece by piece in the
one process's order, so every figure is the one process's, bit for bit. The processes run in step, a piece at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.models.policy import routing_shape
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.analyses.rank_micro_batches import joined_loss
from axrl_spike_replay.replay.analyses.sample_signals import base_name, rank_signals, router_loss
from axrl_spike_replay.replay.analyses.sharded_attribution import AttributionJob, ShardedFigures
from axrl_spike_replay.replay.analyses.share_processes import run_share_processes
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, config_loss, loss_batch, step_counts
from axrl_spike_replay.replay.compute.rank_passes import gather_objects
from axrl_spike_replay.replay.reading.inputs import ReplayInputs
from axrl_spike_replay.replay.streamed.boundaries import BoundaryStore, boundary_store
from axrl_spike_replay.replay.streamed.layer_passes import Item, backward_steps, forward_layers, stream_items
from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights
from axrl_spike_replay.replay.streamed.piece_dots import dot64, together
from axrl_spike_replay.replay.streamed.rank_chain import RankChain
from axrl_spike_replay.replay.streamed.settings import StreamSettings
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.micro_batches import stitch
from axrl_spike_replay.training.policy_loss import LossOutput

PASSES = (
    "streamed: 2 passes over the checkpoint (each decoder layer read once in the forward, once in the backward); "
    "in the backward each micro-batch's layer recomputed twice, one backward per sample"
)


def _leaf(value: torch.Tensor | None) -> torch.Tensor:
    assert value is not None
    return value.detach().requires_grad_(True)


def _row(seed: torch.Tensor, j: int) -> torch.Tensor:
    row = torch.zeros_like(seed)
    row[j] = seed[j]
    return row


def _detached(r: LossOutput) -> LossOutput:
    return LossOutput(r.loss.detach(), r.policy_loss.detach(), r.per_token.detach(), r.mask.detach(), r.metrics)


def _dot(grads: Sequence[torch.Tensor | None], g: Sequence[torch.Tensor | None]) -> float:
    return sum(dot64(a, b) for a, b in zip(grads, g, strict=True) if a is not None and b is not None)


class SampleDots:
    """The per-piece hook of the step's backward (see the module docstring): each sample's <g_s, g> and the router
    losses' <., g>, summed piece by piece (before the division by the saved world size)."""

    def __init__(
        self,
        weights: StreamedWeights,
        items: Sequence[Item],
        store: BoundaryStore,
        inputs: RankInputs,
        cfg: AppliedConfig,
        counts: GlobalCounts | None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.weights, self.items, self.store, self.inputs = weights, list(items), store, inputs
        self.cfg, self.counts, self.cancel = cfg, counts, cancel
        self.dots = {r: torch.zeros(int(b["tokens"].shape[0]), dtype=torch.float64) for r, b in inputs.batches.items()}
        self.router: list[list[float]] = []  # per piece, each micro-batch's router losses' <., g> in order
        self.logprobs: dict[int, list[torch.Tensor]] = {}
        self.results: dict[int, list[LossOutput]] = {}
        self.kept = [cfg.samples.keeps_rank(item.rank) for item in self.items]

    def __call__(self, label: str, names: Sequence[str], reduced: Sequence[torch.Tensor | None]) -> None:
        check_cancel(self.cancel, "attribution")
        self.router.append([])
        named = dict(self.weights.policy.named_parameters())
        params = [named[n] for n in names]
        if label == "head":
            self._head(params, reduced)
        elif label == "embedding":
            self._embedding(params, reduced)
        else:
            self._layer(int(label.removeprefix("layer ")), params, reduced)

    def _samples(
        self,
        item: Item,
        outputs: Sequence[torch.Tensor],
        seeds: Sequence[torch.Tensor],
        params: Sequence[torch.nn.Parameter],
        g: Sequence[torch.Tensor | None],
    ) -> None:
        """Each sample of `item`: a backward from its row of `seeds` alone into `params`, dotted with `g`."""
        for j, s in enumerate(item.mb.rows):
            rows = [_row(seed, j) for seed in seeds]
            grads = torch.autograd.grad(list(outputs), list(params), rows, retain_graph=True, allow_unused=True)
            self.dots[item.rank][s] += _dot(grads, g)

    def _head(self, params: list[torch.nn.Parameter], g: Sequence[torch.Tensor | None]) -> None:
        program, last, cfg = self.weights.program, self.weights.n_layers, self.cfg
        for k, item in enumerate(self.items):
            bounds = [self.store.get(("x", layer, k)) for layer in range(last)]
            with torch.enable_grad():
                hidden = _leaf(self.store.get(("h", last, k))[0])
                extras = [tuple(_leaf(t) for t in b[:-1]) for b in bounds]
                out = program.head(hidden, item.batch, extras, [b[-1] for b in bounds], cfg.needs_entropy)
                batch = loss_batch(self.inputs.batches[item.rank], item.rank, cfg, out.logprobs, item.mb)
                result = config_loss(out, batch, cfg, item.rank, self.counts, cfg.needs_entropy)
                scale = item.mb.scale
                self.logprobs.setdefault(item.rank, []).append(out.logprobs.detach())
                self.results.setdefault(item.rank, []).append(_detached(result))
                if not self.kept[k]:  # a rank the config leaves out adds nothing: its samples' dots stay 0
                    continue
                loss = result.loss * scale if scale != 1.0 else result.loss
                outputs = [out.logprobs] + ([out.entropy] if out.entropy is not None else [])
                got = torch.autograd.grad(loss, outputs, retain_graph=True, allow_unused=True)
                seeds = [s if s is not None else torch.zeros_like(o) for s, o in zip(got, outputs, strict=True)]
                (policy,) = torch.autograd.grad(outputs, [hidden], seeds, retain_graph=True, allow_unused=True)
                self.store.put(("ap", k), (policy if policy is not None else torch.zeros_like(hidden),))
                router = router_loss(cfg, out, item.rank)
                if router is not None:
                    router = router * scale if scale != 1.0 else router
                    flat = [t for layer in extras for t in layer]
                    got = torch.autograd.grad(router, [*params, hidden, *flat], retain_graph=True, allow_unused=True)
                    self.router[-1].append(_dot(got[: len(params)], g))
                    rest = got[len(params) :]
                    self.store.put(("ar", k), (rest[0] if rest[0] is not None else torch.zeros_like(hidden),))
                    at = 1
                    for layer, layer_extras in enumerate(extras):
                        if layer_extras:
                            self.store.put(("arx", layer, k), tuple(rest[at : at + len(layer_extras)]))
                            at += len(layer_extras)
                self._samples(item, outputs, seeds, params, g)
                del out, loss, outputs, seeds

    def _layer(self, layer: int, params: list[torch.nn.Parameter], g: Sequence[torch.Tensor | None]) -> None:
        program = self.weights.program
        for k, item in enumerate(self.items):
            if not self.kept[k]:
                continue
            saved = self.store.get(("x", layer, k))
            policy = self.store.get(("ap", k))[0]
            assert policy is not None
            with torch.enable_grad():
                hidden = _leaf(self.store.get(("h", layer, k))[0])
                out = program.run_layer(layer, hidden, item.batch, item.routing, saved[-1])
                self._samples(item, [out.hidden], [policy], params, g)
                (back,) = torch.autograd.grad([out.hidden], [hidden], [policy], retain_graph=True, allow_unused=True)
                self.store.put(("ap", k), (back if back is not None else torch.zeros_like(hidden),))
                if ("ar", k) in self.store:
                    outputs, seeds = [out.hidden], [self.store.get(("ar", k))[0]]
                    extra_seeds = self.store.get(("arx", layer, k)) if ("arx", layer, k) in self.store else ()
                    for value, seed in zip(out.extras, extra_seeds, strict=False):
                        if seed is not None:
                            outputs.append(value)
                            seeds.append(seed)
                    got = torch.autograd.grad(outputs, [*params, hidden], seeds, allow_unused=True)
                    self.router[-1].append(_dot(got[:-1], g))
                    self.store.put(("ar", k), (got[-1] if got[-1] is not None else torch.zeros_like(hidden),))
                    self.store.drop(("arx", layer, k))
            del out

    def _embedding(self, params: list[torch.nn.Parameter], g: Sequence[torch.Tensor | None]) -> None:
        program = self.weights.program
        for k, item in enumerate(self.items):
            if not self.kept[k]:
                continue
            policy = self.store.get(("ap", k))[0]
            assert policy is not None
            with torch.enable_grad():
                hidden = program.embed(item.batch)
                self._samples(item, [hidden], [policy], params, g)
                if ("ar", k) in self.store:
                    seed = self.store.get(("ar", k))[0]
                    got = torch.autograd.grad([hidden], params, [seed], retain_graph=True, allow_unused=True)
                    self.router[-1].append(_dot(got, g))
            self.store.drop(("ap", k))
            self.store.drop(("ar", k))

    def signals(self) -> dict[int, list[dict[str, Any]]]:
        """Per saved rank, what the attribution reports of each sample beside its contribution (`rank_signals`)."""
        out = {}
        for rank, parts in self.logprobs.items():
            saved, plan = self.inputs.batches[rank], self.inputs.plan(rank)
            size, width = int(saved["tokens"].shape[0]), int(saved["tokens"].shape[1])
            whole = len(plan) == 1 and plan[0].rows == tuple(range(size)) and plan[0].width == width
            logprobs = parts[0] if whole else stitch(parts, plan, size, width)
            mask = joined_loss(self.results[rank], plan, size, width).mask
            batch = loss_batch(saved, rank, self.cfg, logprobs)
            out[rank] = rank_signals(rank, batch, logprobs, mask, base_name(self.cfg))
        return out


def router_sum(parts: Sequence[Sequence[Sequence[float]]]) -> float:
    """The router losses' <., g> over every process's per-piece parts (in process order), added piece by piece in
    the micro-batches' order: the one process's sum, bit for bit."""
    total = 0.0
    for piece in range(len(parts[0]) if parts else 0):
        for part in parts:
            for value in part[piece]:
                total += value
    return total


def streamed_dots(
    inputs: ReplayInputs,
    cfg: AppliedConfig,
    device: str,
    cancel: threading.Event | None = None,
    settings: StreamSettings | None = None,
) -> tuple[float, float, dict[int, list[float]], dict[int, list[dict[str, Any]]], dict[str, float]]:
    """(grad norm, the router losses' <., g>, each sample's <g_s, g> per saved rank, their signals, timings) of the
    step under `cfg`, streamed (see the module docstring); the dots divided by the saved world size, as whole.
    Computed on one intra-op thread, as the whole attribution and every process of a split one compute."""
    job = AttributionJob(inputs.replay_dir, inputs.model, cfg, inputs.world_size, (tuple(range(inputs.world_size)),))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        figures = _share(job, 0, None, cancel, settings)
    finally:
        torch.set_num_threads(threads)
    return figures.grad_norm, figures.router, figures.dots, figures.signals, figures.timings


def streamed_split_dots(
    job: AttributionJob, timeout_s: float = RUN_TIMEOUT_S, cancel: threading.Event | None = None
) -> ShardedFigures:
    """`streamed_dots` with the saved ranks split over `len(job.assignment)` spawned processes (contiguous blocks,
    in order), each streaming its block, the pieces' sums chained and each reduced piece spread back
    (`rank_chain`): every sample's dot with g, the router term and the grad norm are the one process's."""
    return ShardedFigures(**run_share_processes(_split_figures, job, "streamed attribution", timeout_s, cancel))


def _split_figures(job: AttributionJob, process: int) -> dict[str, Any]:
    chain = RankChain(process, len(job.assignment), job.device, everywhere=True)
    return asdict(_share(job, process, chain))


def _share(
    job: AttributionJob,
    process: int,
    chain: RankChain | None,
    cancel: threading.Event | None = None,
    settings: StreamSettings | None = None,
) -> ShardedFigures:
    """Process `process`'s block of the saved ranks streamed; with a chain, every process's figures gathered (each
    process returns the same)."""
    settings = settings or StreamSettings()
    world, cfg, device = job.world_size, job.cfg, job.device
    start = time.perf_counter()
    weights = StreamedWeights(job.model, cfg.weights or job.replay_dir, device, None)
    try:
        weights.check()
        weights.load_ends()
        ranks = RankInputs(job.replay_dir, job.assignment[process], device, routing_shape(job.model))
        counts = step_counts(ranks, cfg, cfg.loss, None, world)  # every saved rank: recounted, as whole
        items = stream_items(ranks, [cfg])
        with boundary_store(settings.host_budget_bytes, settings.spill_dir, device) as store:
            t0 = time.perf_counter()
            forward_layers(weights, items, store, cancel)
            t1 = time.perf_counter()
            hook = SampleDots(weights, items, store, ranks, cfg, counts, cancel)
            steps = backward_steps(
                weights, items, store, ranks, cfg, counts, world, need_entropy=cfg.needs_entropy, keep_own=False,
                on_piece=hook, cancel=cancel, chain=chain,
            )  # fmt: skip
            (done,) = together([steps])
            t2 = time.perf_counter()
        order = [name for name, _ in weights.policy.named_parameters()]
        grad_norm = done.figures.grad_norm(order)
        dots = {rank: (values / world).tolist() for rank, values in hook.dots.items()}
        timings = {"load": t0 - start, "forward": t1 - t0, "attribution": t2 - t1}
        own = (hook.router, dots, hook.signals())
        parts = [own] if chain is None else gather_objects(own)
        return ShardedFigures(
            grad_norm=grad_norm if chain is None else chain.share(grad_norm),
            router=router_sum([part[0] for part in parts]) / world,
            dots={rank: values for part in parts for rank, values in part[1].items()},
            signals={rank: rows for part in parts for rank, rows in part[2].items()},
            timings=timings,
        )
    finally:
        weights.close()
