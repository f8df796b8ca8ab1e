"""The clean gradient and cosine to clean, streamed: the whole replay's definition
(`replay.compute.clean_gradient`), each gradient held a piece at a time.

The search is the whole replay's (`clean_probe.clean_gradient`): the baseline's backward keeps every micro-batch's
dLoss/dlogprobs (the pull), the on-policy reference is probed first, then the loss tokens left out by galloping and
bisection, each probe one streamed backward on the baseline's forward (its grad norm only: nothing of the gradient
is kept). The clean gradient found is then not held either: it is a config (the reference with its tokens left
out) and its counts, on the baseline's forward, recomputed beside the gradients it is compared with. The mitigated
configs' backwards and one clean one are taken a piece at a time in turn (`piece_dots.together`): per piece each
one's float64 dot product with the clean piece, summed, and the cosine from it and their sums of squares. As many
configs go beside one clean backward as the host memory the store has left holds the gradient boundaries of
(`configs_beside`: each backward keeps its own set until it ends), at least one. The baseline's cosine to clean is
one more such pair. Backwards taken together on the same weights read each layer once for all of them
(`StreamedWeights.shared_by`).

Split over processes (`rank_chain`), every process takes every backward (each sums its saved ranks' passes into
the chain), and takes the search's decisions alike: each grad norm compared with the bar is the last process's
(`Step.shared`), and the loss tokens are ordered from every process's pulls and masks, gathered. The dot products
and the figures are the last process's: it holds every piece's sum. With each layer's experts split over processes
(`expert_share`) every process holds the figures, put together, and each process's dots count its own split
parameters and, in process 0, the rest: summed over processes.

Cost in backwards over the baseline's forward: the probes (`passes`, as the whole replay counts them, each reading
every decoder layer once), one pair for the baseline's cosine when the clean gradient is not the baseline's own,
and one more backward (the clean one) per group of mitigated configs taken beside it (each pair or group reading
every layer once). The baseline's forward boundaries and its weights
(embedding and head) stay held until the job ends, so configs of other forward groups (other routing or weights)
are compared with it too.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.compute.clean_gradient import SpikeBar, not_reached_reason, smallest_count, token_order
from axrl_spike_replay.replay.compute.clean_probe import on_policy, own_baseline_figures
from axrl_spike_replay.replay.compute.process_inputs import RankInputs
from axrl_spike_replay.replay.compute.rank_passes import gather_objects
from axrl_spike_replay.replay.streamed.boundaries import BoundaryStore
from axrl_spike_replay.replay.streamed.layer_passes import ConfigPass, Item, PieceHook, backward_steps
from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights
from axrl_spike_replay.replay.streamed.piece_dots import PieceDots, Steps, cosine_of, together
from axrl_spike_replay.replay.streamed.rank_chain import RankChain
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.micro_batches import stitch
from axrl_spike_replay.training.sample_masks import SampleFilter, TokenDrop

Counts = Callable[[AppliedConfig], GlobalCounts | None]


@dataclass
class Forward:
    """A forward group's streamed forward, what its configs' backwards run on: weights, micro-batches, boundaries."""

    weights: StreamedWeights
    items: list[Item]
    store: BoundaryStore
    need_entropy: bool


@dataclass
class Step:
    """What every backward of a job shares: its ranks' inputs, the saved world size, the reduce dtype, the stop, and
    the chain when the saved ranks are split over processes (`rank_chain`)."""

    inputs: RankInputs
    world_size: int
    reduce_dtype: torch.dtype | None
    cancel: threading.Event | None
    chain: RankChain | None = None

    def steps(
        self,
        forward: Forward,
        cfg: AppliedConfig,
        counts: GlobalCounts | None,
        *,
        keep_own: bool = False,
        on_piece: PieceHook | None = None,
        pulls: dict[int, list[torch.Tensor]] | None = None,
        tag: str = "",
    ) -> Steps:
        """`cfg`'s backward on `forward`, a piece at a time."""
        return backward_steps(
            forward.weights, forward.items, forward.store, self.inputs, cfg, counts, self.world_size,
            need_entropy=forward.need_entropy, keep_own=keep_own, reduce_dtype=self.reduce_dtype,
            on_piece=on_piece, cancel=self.cancel, pulls=pulls, tag=tag, chain=self.chain,
        )  # fmt: skip

    def norm(self, forward: Forward, cfg: AppliedConfig, counts: GlobalCounts | None) -> float:
        """`cfg`'s grad norm on `forward` (one backward; nothing of the gradient kept), in every process."""
        (done,) = together([self.steps(forward, cfg, counts)])
        return self.shared(done.figures.grad_norm(_order(forward)))

    def shared(self, value: float) -> float:
        """The last process's `value` in every process of a chain (`value` itself in one process)."""
        return value if self.chain is None else self.chain.share(value)


@dataclass
class CleanReference:
    """The clean gradient as a config on the baseline's forward (None: no spike bar, no clean gradient), its
    counts, and how it was made (`info`: the whole replay's figures) in `seconds`."""

    forward: Forward | None
    cfg: AppliedConfig | None
    counts: GlobalCounts | None
    info: dict[str, Any]
    seconds: float = 0.0

    def beside(
        self, step: Step, forward: Forward, cfg: AppliedConfig, counts: GlobalCounts | None
    ) -> tuple[ConfigPass, float | None]:
        """`cfg`'s backward on `forward` taken beside the clean one: (its pass, its cosine to clean)."""
        return self.beside_all(step, forward, [(cfg, counts)])[0]

    def beside_all(
        self, step: Step, forward: Forward, configs: Sequence[tuple[AppliedConfig, GlobalCounts | None]]
    ) -> list[tuple[ConfigPass, float | None]]:
        """Each of `configs`' backwards on `forward`, all taken beside one clean backward, a piece at a time in
        turn: (its pass, its cosine to clean) each. Backwards on the same weights read each layer once for all."""
        weights, share = forward.weights, forward.weights.share
        dots = PieceDots(len(configs), None if share is None else partial(share.counts, split=weights.split))
        clean_too = self.forward is not None and self.cfg is not None
        mine = [
            step.steps(forward, cfg, counts, on_piece=dots.other(i) if clean_too else None, tag=f"other{i}")
            for i, (cfg, counts) in enumerate(configs)
        ]
        if self.forward is None or self.cfg is None:
            with forward.weights.shared_by(len(mine)):
                return [(done, None) for done in together(mine)]
        clean = step.steps(self.forward, self.cfg, self.counts, on_piece=dots.reference, tag="clean")
        same = forward.weights is self.forward.weights
        with forward.weights.shared_by(len(mine) + same):
            clean_pass, *done = together([clean, *mine])
        if share is not None:  # each split parameter's dot in its owner, the rest in process 0: summed
            dots.dots = share.summed(dots.dots)
        return [(d, cosine_of(dots.dots[i], d.figures, clean_pass.figures)) for i, d in enumerate(done)]


def configs_beside(step: Step, forward: Forward, wanted: int) -> int:
    """How many of `wanted` configs' backwards go beside one clean backward (`CleanReference.beside_all`): as many as
    the host memory the store has left holds the gradient boundaries of (each backward keeps its own set, the clean
    one's too: about the last layer's input and every layer's router outputs, per micro-batch), at least one;
    alike in every process of a chain (the fewest any process holds)."""
    store, items, last = forward.store, forward.items, forward.weights.n_layers
    per = sum(store.nbytes(("h", last, k)) for k in range(len(items)))
    per += sum(store.nbytes(("x", layer, k)) for layer in range(last) for k in range(len(items)))
    room = store.budget - store.memory_bytes
    count = min(wanted, max(room // per - 1, 1)) if per > 0 else wanted
    if step.chain is not None or forward.weights.share is not None:
        count = min(gather_objects(count))
    return max(count, 1)


def _order(forward: Forward) -> list[str]:
    return [name for name, _ in forward.weights.policy.named_parameters()]


def _pulls(step: Step, parts: dict[int, list[torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Each saved rank's dLoss/dlogprobs [B, T], its micro-batches' put back at their rows."""
    out = {}
    for rank, pieces in parts.items():
        plan = step.inputs.plan(rank)
        size, width = sum(len(mb.rows) for mb in plan), max(mb.width for mb in plan)
        out[rank] = stitch(pieces, plan, size, width)
    return out


def _self_cosine(grad_norm: float) -> float | None:
    return 1.0 if grad_norm > 0 and grad_norm != float("inf") else None


def clean_reference(
    step: Step,
    forward: Forward,
    baseline: AppliedConfig,
    counts_of: Counts,
    done: ConfigPass,
    pulls: dict[int, list[torch.Tensor]],
    bar: SpikeBar | None,
) -> CleanReference:
    """The clean gradient of the baseline whose backward on `forward` gave `done` and `pulls` (see the module
    docstring)."""
    start = time.perf_counter()
    grad_norm = step.shared(done.figures.grad_norm(_order(forward)))
    base_counts = counts_of(baseline)
    if bar is None or not bar.is_spike(grad_norm):
        info = own_baseline_figures(grad_norm, bar, _self_cosine(grad_norm))
        kept = forward if bar is not None else None
        return CleanReference(kept, baseline, base_counts, info, time.perf_counter() - start)
    reference, recomputed = on_policy(baseline)
    if recomputed:  # first the on-policy gradient: no stored log-prob signal left in it
        check_cancel(step.cancel, "replay")
        cfg0 = dataclasses.replace(reference, config_id="clean")
        counts0 = counts_of(cfg0)
        norm0 = step.norm(forward, cfg0, counts0)
        if not bar.is_spike(norm0):
            info = {**own_baseline_figures(norm0, bar, None), "recomputed": list(recomputed)}
            found = CleanReference(forward, cfg0, counts0, info)
            found.info["baseline_cosine"] = found.beside(step, forward, baseline, base_counts)[1]
            found.info["passes"] = 1
            found.seconds = time.perf_counter() - start
            return found
    own_pulls = {rank: pull.cpu() for rank, pull in _pulls(step, pulls).items()}
    own_masks = {rank: trace.mask.cpu() for rank, trace in done.traces.items()}
    parts = gather_objects((own_pulls, own_masks)) if step.chain is not None else [(own_pulls, own_masks)]
    all_pulls = {rank: pull for part in parts for rank, pull in part[0].items()}
    order = token_order(all_pulls, {rank: mask for part in parts for rank, mask in part[1].items()})
    shapes = {rank: batch["loss_mask"].shape for rank, batch in step.inputs.batches.items()}
    norms: dict[int, float] = {}
    probes: dict[int, tuple[AppliedConfig, GlobalCounts | None]] = {}

    def probe(count: int) -> AppliedConfig:
        samples = SampleFilter(tokens=TokenDrop(order.masks(count, shapes, step.inputs.device)))
        return dataclasses.replace(reference, config_id="clean", samples=samples)

    def under(count: int) -> bool:
        check_cancel(step.cancel, "replay")
        cfg = probe(count)
        counts = counts_of(cfg)
        norms[count] = step.norm(forward, cfg, counts)
        below = not bar.is_spike(norms[count])
        if below or count == order.cap:  # the search only moves down from a probe under the bar: keep the last
            probes.clear()
            probes[count] = (cfg, counts)
        return below

    count, reached = smallest_count(under, order.cap)
    clean_cfg, clean_counts = probes.get(count, (baseline, base_counts))
    clean_norm = norms.get(count, grad_norm) if count in probes else grad_norm
    found = CleanReference(forward, clean_cfg, clean_counts, {})
    cosine = _self_cosine(grad_norm) if clean_cfg is baseline else found.beside(step, forward, baseline, base_counts)[1]
    found.info = {
        **order.summary(count),
        "reached": reached,
        "reason": None if reached else not_reached_reason(order, clean_norm, bar),
        "bar": bar.value,
        "grad_norm": clean_norm,
        "ratio_to_median": clean_norm / bar.median_norm,
        "baseline_cosine": cosine,
        "passes": len(norms) + bool(recomputed),
        "probe_norms": {str(k): v for k, v in sorted(norms.items())},  # tokens left out -> grad norm
        "recomputed": list(recomputed),
    }
    found.seconds = time.perf_counter() - start
    return found
