"""The output head in chunks of tokens: per-token log-probs and entropies, and their gradients, without a [T, V]
float32 tensor for a whole sequence.

RL trainers take a token's log-prob as `log_softmax(logits / temperature)[target]` in float32, over a vocabulary of
~150k entries: 4.6 GiB per 8k-token sequence for the logits alone, and autograd keeps three such copies (the upcast,
the division, the log-softmax). Here the head's matmul, the softmax and the gather run over `chunk` tokens at a time;
only each token's log-sum-exp (and entropy) is kept for the backward, which recomputes a chunk's logits and makes
the gradients of the hidden states and of the head's weight from them. Nothing is approximated: the formulas are
autograd's for the same operations (`tests/models/test_chunked_head.py` holds it to the unchunked head within 1e-6,
float32, gradients included), and the gradient of the weight is summed over chunks in float32 before its cast.

Forward-mode AD (`replay.compute.outcome_figures.jvp_policy`) gets the same chunking through `jvp`.

`ChunkedHead` is a `nn.Linear` whose call also takes targets: the head stays one module call, so a sharded replay's
FSDP2 unit gathers its weight around it as it does around any forward, and its parameter keeps its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

# float32 elements of one chunk's logits: 64M (256 MiB); a chunk is at least MIN_CHUNK tokens
CHUNK_ELEMENTS = 1 << 26
MIN_CHUNK = 16
# float32 [chunk, V] tensors alive at once at the head's peak, in the backward: the logits in the compute dtype and
# float32, the probabilities and the gradient of the logits (`replay.compute.process_memory` counts them)
CHUNK_COPIES = 4


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk for a vocabulary: [chunk, vocab] float32 stays under CHUNK_ELEMENTS."""
    return max(MIN_CHUNK, CHUNK_ELEMENTS // max(vocab, 1))


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """One chunk's logits in the head's dtype, upcast to float32 and divided by the temperature, as trainers take
    them."""
    logits = F.linear(hidden, weight, bias).float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedLogprobs(torch.autograd.Function):
    """(log-probs [N], entropies [N] or an empty tensor) of `targets` [N] under `linear(hidden [N, H], weight)`."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        need_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if need_entropy else 0, dtype=torch.float32)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            z = _scaled_logits(hidden[lo:hi], weight, bias, temperature)
            lse[lo:hi] = torch.logsumexp(z, dim=-1)
            logp[lo:hi] = z.gather(-1, targets[lo:hi, None]).squeeze(-1) - lse[lo:hi]
            if need_entropy:
                p = (z - lse[lo:hi, None]).exp_()
                entropy[lo:hi] = lse[lo:hi] - (p * z).sum(dim=-1)
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.save_for_forward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.need_entropy = temperature, chunk, need_entropy
        ctx.mark_non_differentiable(lse)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]  # two outputs, two gradients
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if want_b and bias is not None else None
        n = hidden.shape[0]
        for lo in range(0, n, ctx.chunk):
            hi = min(lo + ctx.chunk, n)
            z = _scaled_logits(hidden[lo:hi], weight, bias, ctx.temperature)
            p = (z - lse[lo:hi, None]).exp_()
            # d logp / dz = onehot(target) - p;  d entropy / dz = -p (z - lse + entropy)
            grad_z = torch.zeros_like(z)
            if grad_logp is not None:
                g = grad_logp[lo:hi, None]
                grad_z -= p * g
                grad_z.scatter_add_(-1, targets[lo:hi, None], g)
            if ctx.need_entropy and grad_entropy is not None:
                shift = (entropy[lo:hi] - lse[lo:hi])[:, None]
                grad_z -= p * (z + shift) * grad_entropy[lo:hi, None]
            del z, p
            if ctx.temperature != 1.0:
                grad_z /= ctx.temperature
            grad_logits = grad_z.to(weight.dtype)
            if grad_h is not None:
                grad_h[lo:hi] = grad_logits @ weight
            if grad_w is not None:  # summed over chunks in float32, in place: no [V, H] temporary per chunk
                grad_w.addmm_(grad_logits.float().t(), hidden[lo:hi].float())
            if grad_b is not None:
                grad_b += grad_logits.float().sum(dim=0)
            del grad_z, grad_logits  # gone before the next chunk's logits: CHUNK_COPIES at a time, not one more
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(weight.dtype),
            None,
            None,
            None,
            None,
        )

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        d_hidden, d_weight, d_bias = tangents[:3]
        n = hidden.shape[0]
        d_logp = hidden.new_zeros(n, dtype=torch.float32)
        d_entropy = hidden.new_zeros(entropy.shape[0], dtype=torch.float32)
        for lo in range(0, n, ctx.chunk):
            hi = min(lo + ctx.chunk, n)
            z = _scaled_logits(hidden[lo:hi], weight, bias, ctx.temperature)
            dz = torch.zeros_like(z, dtype=hidden.dtype)
            if d_hidden is not None:
                dz = dz + F.linear(d_hidden[lo:hi], weight)
            if d_weight is not None:
                dz = dz + F.linear(hidden[lo:hi], d_weight)
            if d_bias is not None:
                dz = dz + d_bias
            dz = dz.float()
            if ctx.temperature != 1.0:
                dz /= ctx.temperature
            p = (z - lse[lo:hi, None]).exp_()
            mean_dz = (p * dz).sum(dim=-1)
            d_logp[lo:hi] = dz.gather(-1, targets[lo:hi, None]).squeeze(-1) - mean_dz
            if ctx.need_entropy:
                shift = (entropy[lo:hi] - lse[lo:hi])[:, None]
                d_entropy[lo:hi] = -(p * (z + shift) * dz).sum(dim=-1)
        return d_logp, d_entropy


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    need_entropy: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token (log-probs, entropies or None), float32, of `targets` [..., ] under `linear(hidden [..., H],
    weight [V, H], bias) / temperature`, computed `chunk` tokens at a time (default: `chunk_tokens(V)`); exact
    gradients to `hidden`, `weight` and `bias`."""
    lead = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).long()
    if flat_h.shape[0] != flat_t.shape[0]:
        raise ValueError(f"hidden has {flat_h.shape[0]} tokens, targets {flat_t.shape[0]}")
    size = chunk or chunk_tokens(weight.shape[0])
    logp, entropy = _ChunkedLogprobs.apply(flat_h, weight, bias, flat_t, float(temperature), size, need_entropy)
    return logp.reshape(lead), (entropy.reshape(lead) if need_entropy else None)


class ChunkedHead(nn.Linear):
    """An output head (`nn.Linear`) whose call with `targets` gives their log-probs and entropies in chunks
    (`chunked_logprobs`); without targets, the logits, as `nn.Linear`."""

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        need_entropy: bool = False,
        chunk: int | None = None,
    ) -> Any:
        if targets is None:
            return super().forward(hidden)
        return chunked_logprobs(
            hidden,
            self.weight,
            targets,
            bias=self.bias,
            temperature=temperature,
            need_entropy=need_entropy,
            chunk=chunk,
        )


def as_chunked_head(head: nn.Module) -> ChunkedHead:
    """`head` (an `nn.Linear`, its parameters and their names unchanged) made a `ChunkedHead`."""
    if type(head) is not nn.Linear and not isinstance(head, ChunkedHead):
        raise TypeError(f"the output head is a {type(head).__name__}, not an nn.Linear: it cannot be chunked")
    head.__class__ = ChunkedHead
    return cast(ChunkedHead, head)


@dataclass(frozen=True)
class HeadRequest:
    """A forward that ends in the chunked head: log-probs (and entropies) of the tokens from position `start` on,
    each predicted by the position before it, logits divided by `temperature`."""

    start: int = 1
    temperature: float = 1.0
    need_entropy: bool = False


def sequence_logprobs(
    head: ChunkedHead, hidden: torch.Tensor, tokens: torch.Tensor, request: HeadRequest
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] log-probs (and entropies) of `tokens` [B, T] from `hidden` [B, T, H] (the final norm's output), 0
    before `request.start`: position t's token is predicted by position t - 1."""
    start = max(1, request.start)
    logp, entropy = head(hidden[:, start - 1 : -1], tokens[:, start:], request.temperature, request.need_entropy)
    return F.pad(logp, (start, 0)), (None if entropy is None else F.pad(entropy, (start, 0)))
