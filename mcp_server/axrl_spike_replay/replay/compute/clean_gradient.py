"""The clean gradient: the on-policy gradient at the snapshot's weights, with the loss tokens that carry the spike
left out of the loss.

On-policy first. The baseline's stored old and rollout log-probs are recomputed as the forward's own (the
`recompute` mitigation's `old_logprobs,rollout_logprobs`): at the step's first update a sound trainer's old
log-probs are exactly that, so every ratio and IS weight is 1 and no stored log-prob signal is left in the
reference. Leaving tokens out alone could not do this: a stale or wrong stored signal on one rank also takes
gradient away (its positive-advantage tokens clipped to no pull), so a reference made by leaving tokens out
still holds the contaminated rank, and scored a full fix (recomputing the signal) below a partial one (a
log-ratio clip that leaves out the same tokens the reference does). When the on-policy gradient is under the
spike bar it is the clean gradient (nothing left out); otherwise the tokens are left out of it as below
(an outlier advantage, a wrong reference's KL term, routes: what recomputing the log-probs does not touch).
Under normalization global with rejection sampling the counts need the log-probs before the forward, so there
the baseline's own loss is the reference, as before (`recomputed` empty).

Definition of the tokens left out. Every loss token t of the baseline (its loss mask, after any rejection the
saved loss applies) is weighed by its pull w_t = |dL_r/dlogp_t|: how hard rank r's loss pulls on the token's
log-prob, with everything the loss does to that token in it (advantage, importance ratio and its clip, IS
weight, KL penalty, aggregation denominator; an entropy term's pull is not counted). Token t adds
(dL_r/dlogp_t) grad(logp_t) / W to the DP-mean gradient, and in a spike the pull is what goes wrong by orders
of magnitude (a ratio of 1e3, an advantage scaled 200x, a KL term exp(ref - logp) with ref - logp tens of
nats), so the tokens are ranked by w_t, largest first, over every saved rank (tokens with no pull,
e.g. clipped ones, are never left out). The clean gradient leaves the first k tokens
of that order out of the loss, masked exactly as the loss masks a token (out of the sum and out of its
token/sequence denominators; under `normalization: global` the step's counts are recounted), with k the
smallest count whose reduced global gradient is under the verdict's spike bar: grad norm / median norm <
threshold, the rule and threshold that make a mitigation `cleared`.

Why the pull and not the attribution c_t = <g_t, g>: ranking by c_t, largest positive first, leaves in the
spike tokens whose gradients point away from g, and once the aligned ones are out those become the spike (on
the reference trainer's ratio_outliers and stale_routes captures the norm stalls, or climbs, far above the
bar however many tokens leave). Ranking by |c_t| does get under the bar, but with more tokens than the pull
and at the price of a forward-mode pass, where the pull comes with the baseline's backward.

Search. k is found by galloping, then bisection: probes 1, 2, 4, ... tokens (the cap last) until one is
under the bar, then bisection between it and the probe before; each probe is one forward + backward of
every rank batch, so about 2 log2(k) + 1 passes. The result is under the bar with k tokens left out and
not with k - 1 (the norm need not fall monotonically along the order: a smaller set is not excluded).

Cap. At most MAX_LEFT_OUT_FRACTION (half) of the baseline's loss tokens (and only tokens with a pull). When
even the cap does not get under the bar, `reached` is false with the reason and the clean gradient is the
cap's: the spike is not carried by a minority of tokens (a coherent batch, such as every advantage strongly
negative, or the router losses), and cosines against it are a rough reference. A baseline already under
the bar is its own clean gradient (nothing left out, no pass). Without a usable median norm there is no
bar and no clean gradient.

A spike carried by a few whole samples (an outlier advantage) puts their tokens first, so the token set
covers those samples: `left_out` names every sample with a token left out (largest pull first) and
`wholly_left_out` those whose every loss token is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.experiment.verdict import is_spike

MAX_LEFT_OUT_FRACTION = 0.5  # of the baseline's loss tokens
CLEAN_DEFINITION = (
    "clean gradient: the on-policy gradient (the baseline's stored old and rollout log-probs recomputed at the "
    "snapshot's weights, every ratio 1; `recomputed` names them), and when that is still a spike, with its "
    "highest-pull loss tokens left out of the loss (masked as the "
    "loss masks a token, denominators and global counts included); pull: |dL/dlogp_t| of the baseline's loss; "
    "left out: the smallest count, largest pull first, whose gradient is under the spike bar (grad norm / median "
    "< the verdict threshold), found by galloping then bisection (one forward + backward per probe) and capped at "
    f"{MAX_LEFT_OUT_FRACTION:.0%} of the loss tokens (`reached` false when the cap does not get under the bar)"
)


@dataclass(frozen=True)
class SpikeBar:
    """The verdict's spike bar: a gradient is under it when grad norm / median norm < threshold."""

    median_norm: float
    threshold: float

    @property
    def value(self) -> float:
        return self.median_norm * self.threshold

    def is_spike(self, grad_norm: float) -> bool:
        return is_spike(grad_norm, self.median_norm, self.threshold)


def spike_bar(median_norm: float | None, threshold: float) -> SpikeBar | None:
    """The bar, or None when the median norm is not a finite number > 0 (every gradient would be a spike)."""
    if median_norm is None or not math.isfinite(median_norm) or median_norm <= 0:
        return None
    return SpikeBar(float(median_norm), float(threshold))


@dataclass(frozen=True)
class TokenOrder:
    """The loss tokens with a pull over every saved rank, largest pull first."""

    values: torch.Tensor  # [N] float64 pulls, descending
    ranks: torch.Tensor  # [N] int64: the saved rank of each token
    flat: torch.Tensor  # [N] int64: the token's index in its rank batch's flattened [B, T]
    widths: dict[int, int]  # T per saved rank
    sample_tokens: dict[int, torch.Tensor]  # [B] loss tokens per sample, per saved rank
    total: float  # the pull of every loss token

    @property
    def loss_tokens(self) -> int:
        return int(sum(int(t.sum()) for t in self.sample_tokens.values()))

    @property
    def half(self) -> int:
        return math.floor(MAX_LEFT_OUT_FRACTION * self.loss_tokens)

    @property
    def cap(self) -> int:
        return min(self.half, int(self.values.numel()))

    def masks(
        self, count: int, shapes: Mapping[int, torch.Size], device: str | torch.device
    ) -> dict[int, torch.Tensor]:
        """[B, T] bool per saved rank in `shapes`: True for the tokens among the first `count` of the order."""
        out = {}
        for rank, shape in shapes.items():
            mask = torch.zeros(math.prod(shape), dtype=torch.bool)
            mask[self.flat[:count][self.ranks[:count] == rank]] = True
            out[rank] = mask.reshape(shape).to(device)
        return out

    def summary(self, count: int) -> dict[str, Any]:
        """What leaving the first `count` tokens out leaves out: tokens, samples, their share of the pull."""
        pull: dict[tuple[int, int], float] = {}
        tokens: dict[tuple[int, int], int] = {}
        for value, rank, flat in zip(
            self.values[:count].tolist(), self.ranks[:count].tolist(), self.flat[:count].tolist(), strict=True
        ):
            key = (rank, flat // self.widths[rank])
            pull[key] = pull.get(key, 0.0) + value
            tokens[key] = tokens.get(key, 0) + 1
        samples = sorted(pull, key=lambda key: (-pull[key], key))
        loss_tokens = self.loss_tokens
        left = float(self.values[:count].sum()) if count else 0.0
        return {
            "left_out": [f"{r}:{s}" for r, s in samples],
            "wholly_left_out": [f"{r}:{s}" for r, s in samples if tokens[(r, s)] >= int(self.sample_tokens[r][s])],
            "tokens_left_out": count,
            "loss_tokens": loss_tokens,
            "token_share_left_out": count / loss_tokens if loss_tokens else 0.0,
            "share_left_out": left / self.total if self.total > 0 else 0.0,  # of the loss's pull on the log-probs
        }


def token_order(pulls: Mapping[int, torch.Tensor], loss_masks: Mapping[int, torch.Tensor]) -> TokenOrder:
    """The order of the loss tokens from every saved rank's pulls [B, T] (only tokens on the loss mask count).

    Ties keep (rank, sample, position) order, so every process derives the same order from the same figures."""
    values, ranks, flat = [], [], []
    for rank in sorted(pulls):
        w = pulls[rank].detach().double().cpu().abs().reshape(-1)
        w = torch.where(loss_masks[rank].cpu().reshape(-1) > 0, w, torch.zeros_like(w))
        index = (w > 0).nonzero().reshape(-1)  # NaN is not > 0: a token without a finite pull is not ranked
        values.append(w[index])
        ranks.append(torch.full_like(index, rank))
        flat.append(index)
    empty = torch.zeros(0, dtype=torch.int64)
    all_values = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    order = torch.sort(all_values, descending=True, stable=True).indices
    return TokenOrder(
        values=all_values[order],
        ranks=(torch.cat(ranks) if ranks else empty)[order],
        flat=(torch.cat(flat) if flat else empty)[order],
        widths={r: int(m.shape[-1]) for r, m in loss_masks.items()},
        sample_tokens={r: (m.cpu() > 0).sum(dim=-1) for r, m in loss_masks.items()},
        total=float(all_values.sum()),
    )


def smallest_count(under: Callable[[int], bool], cap: int) -> tuple[int, bool]:
    """(count, reached): a count in [1, cap] with under(count) and not under(count - 1) (count 0 taken as not
    under), or (cap, False) when no probe is under. Galloping, then bisection: probes 1, 2, 4, ... (cap last)
    until one is under, then bisects between it and the probe before, so small counts are tried first and a norm
    that rises again further down the order cannot hide them; about 2 log2(count) + 1 calls of `under`."""
    low, high = 0, min(1, cap)
    while high >= 1 and not under(high):
        if high == cap:
            return cap, False
        low, high = high, min(2 * high, cap)
    if high < 1:
        return cap, False
    while high - low > 1:  # not under at low, under at high
        middle = (low + high) // 2
        if under(middle):
            high = middle
        else:
            low = middle
    return high, True


def not_reached_reason(order: TokenOrder, norm: float, bar: SpikeBar) -> str:
    """Why leaving the cap's tokens out did not get under the bar."""
    cap = order.cap
    limit = f"half of the {order.loss_tokens} loss tokens" if cap == order.half else "every token with a pull"
    return (
        f"with {cap} tokens left out ({limit}) the grad norm {norm:.6g} is still at or above the spike bar "
        f"{bar.value:.6g} ({bar.threshold:g} x median {bar.median_norm:.6g}): the spike is not carried by a "
        "minority of loss tokens, so the clean gradient is only a rough reference"
    )
