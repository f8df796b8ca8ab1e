"""The head in chunks gives the log-probs, entropies and gradients the full-vocabulary head gives (float32, 1e-6),
for every chunk size, with a temperature, a bias and forward-mode AD, while never holding a [T, V] float32 tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwad
import torch.nn.functional as F

from axrl_spike_replay.models.chunked_head import ChunkedHead, as_chunked_head, chunk_tokens, chunked_logprobs


def _full_head(hidden, weight, bias, targets, temperature):
    """The unchunked head, as trainers write it: logits, float32, / temperature, log-softmax, gather, entropy."""
    logits = F.linear(hidden, weight, bias).float() / temperature
    logp_all = logits.log_softmax(dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy


def _case(seed=0, tokens=37, hidden=24, vocab=301, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=g)
    # the loss weights both outputs, as an entropy bonus does
    gl, ge = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    return h, w, b, t, gl, ge


def _rel(a: Any, b: Any) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30))


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_the_full_head_with_gradients(chunk, temperature):
    h, w, b, t, gl, ge = _case()
    want_logp, want_ent = _full_head(h, w, b, t, temperature)
    ((want_logp * gl).sum() + (want_ent * ge).sum()).backward()
    want = [x.grad.clone() for x in (h, w, b)]
    for x in (h, w, b):
        x.grad = None
    logp, ent = chunked_logprobs(h, w, t, bias=b, temperature=temperature, need_entropy=True, chunk=chunk)
    assert ent is not None
    ((logp * gl).sum() + (ent * ge).sum()).backward()
    assert _rel(logp, want_logp) < 1e-6 and _rel(ent, want_ent) < 1e-6
    for x, expected in zip((h, w, b), want, strict=True):
        assert _rel(x.grad, expected) < 1e-6


def test_log_probs_alone_need_no_entropy_and_keep_their_gradient():
    h, w, _, t, gl, _ = _case(seed=1, bias=False)
    want_logp, _ = _full_head(h, w, None, t, 1.0)
    (want_logp * gl).sum().backward()
    want_h, want_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logp, ent = chunked_logprobs(h, w, t, chunk=8)
    assert ent is None
    (logp * gl).sum().backward()
    assert _rel(h.grad, want_h) < 1e-6 and _rel(w.grad, want_w) < 1e-6


def test_forward_mode_gives_the_full_heads_tangents():
    h, w, b, t, *_ = _case(seed=2)
    dh, dw = torch.randn_like(h), torch.randn_like(w)
    with torch.no_grad(), fwad.dual_level():
        hd, wd = fwad.make_dual(h.detach(), dh), fwad.make_dual(w.detach(), dw)
        want = [fwad.unpack_dual(x).tangent for x in _full_head(hd, wd, b.detach(), t, 0.9)]
        got = chunked_logprobs(hd, wd, t, bias=b.detach(), temperature=0.9, need_entropy=True, chunk=7)
        got = [fwad.unpack_dual(x).tangent for x in got if x is not None]
    for a, e in zip(got, want, strict=True):
        assert _rel(a, e) < 1e-6


def test_bfloat16_head_stays_within_bfloat16s_own_rounding():
    h, w, _, t, gl, _ = _case(seed=3, tokens=64, vocab=512, bias=False)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    want, _ = _full_head(hb, wb, None, t, 1.0)
    (want * gl).sum().backward()
    want_w = wb.grad.float().clone()
    wb.grad = None
    got, _ = chunked_logprobs(hb, wb, t, chunk=10)
    (got * gl).sum().backward()
    assert _rel(got, want) < 1e-6  # the forward's arithmetic is float32 after the same bfloat16 matmul
    assert _rel(wb.grad.float(), want_w) < 2e-2  # bfloat16 gradients: the sum's order differs, ~8 bits kept


def test_the_head_module_keeps_its_name_and_still_gives_logits():
    head = torch.nn.Linear(8, 50, bias=False)
    model = torch.nn.Sequential(head)
    names = [n for n, _ in model.named_parameters()]
    chunked = as_chunked_head(head)
    assert isinstance(chunked, ChunkedHead) and [n for n, _ in model.named_parameters()] == names
    x = torch.randn(3, 8)
    assert torch.equal(chunked(x), x @ head.weight.t())
    logp, _ = chunked(x, torch.tensor([1, 2, 3]))
    assert logp.shape == (3,)
    with pytest.raises(TypeError, match=r"not an nn\.Linear"):
        as_chunked_head(torch.nn.Embedding(3, 4))


def test_a_chunk_of_a_real_vocabulary_stays_a_few_hundred_mib():
    tokens = chunk_tokens(151_936)  # Qwen3's vocabulary
    assert 16 <= tokens <= 1024 and tokens * 151_936 * 4 <= 256 << 20
