"""Activation checkpointing per decoder layer replays the step as the plain forward does (float32, CPU, 1e-6), with
recorded routes forced on the recompute as in the first forward and the router losses counted once."""

from __future__ import annotations

import pytest
import torch

from axrl_spike_replay.models.layer_checkpoint import checkpoint_layers, is_checkpointed
from axrl_spike_replay.models.policy import build_policy, parse_model_config, policy_forward
from axrl_spike_replay.models.tiny_moe import RoutingControl, TinyMoEConfig
from axrl_spike_replay.testing.hf_snapshot import model_section

SEQ = 24


def _spec(kind: str):
    if kind == "tiny_moe":
        return TinyMoEConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=4, n_experts=4, top_k=2, max_seq_len=SEQ,
                             moe_layers=(0, 2))  # fmt: skip
    return parse_model_config(dict(model_section(kind), attn_implementation="sdpa"))


def _step(model, batch, routing):
    """One replayed step's loss and gradient: log-probs, entropy bonus and both router losses."""
    model.zero_grad(set_to_none=True)
    out = policy_forward(model, batch, routing, need_entropy=True)
    assert out.entropy is not None
    mask = batch["loss_mask"]
    loss = -(out.logprobs * mask).sum() / mask.sum() - 1e-2 * out.entropy.mean()
    loss = loss + 1e-2 * out.aux_loss + 1e-3 * out.z_loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), float(out.aux_loss), float(out.z_loss), out.routes, grads


def _routes(model, spec, batch) -> torch.Tensor:
    """Recorded routes that differ from the current router's: every token's top-k, shifted by one expert, with a
    quarter of them left to the current router (-1)."""
    with torch.no_grad():
        own = policy_forward(model, batch, RoutingControl(), need_entropy=False).routes
    experts = spec.n_experts
    shifted = (own + 1) % experts
    g = torch.Generator().manual_seed(5)
    keep_current = torch.rand(shifted.shape[:3], generator=g) < 0.25
    return torch.where(keep_current[..., None], torch.full_like(shifted, -1), shifted)


@pytest.mark.parametrize("kind", ["tiny_moe", "qwen3_moe", "deepseek_v3"])
def test_a_checkpointed_replay_equals_the_plain_one(kind):
    spec = _spec(kind)
    torch.manual_seed(0)
    plain = build_policy(spec)
    torch.manual_seed(0)
    ckpt = build_policy(spec)
    ckpt.load_state_dict(plain.state_dict())
    assert checkpoint_layers(ckpt) >= 2
    vocab = 50 if kind == "tiny_moe" else 1000
    tokens = torch.randint(3, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, SEQ)
    mask[:, SEQ // 2 :] = 1.0
    batch = {"tokens": tokens, "loss_mask": mask, "attention_mask": torch.ones_like(tokens)}
    routing = RoutingControl(routes=_routes(plain, spec, batch))
    want = _step(plain, batch, routing)
    got = _step(ckpt, batch, routing)
    for a, b in zip(got[:3], want[:3], strict=True):  # loss, aux loss, z-loss: the routers counted once
        assert abs(a - b) <= 1e-6 * max(abs(b), 1.0)
    assert torch.equal(got[3], want[3])  # the routes the forward used
    assert got[4].keys() == want[4].keys()
    for name, g in want[4].items():
        rel = float((got[4][name] - g).norm() / g.norm().clamp_min(1e-30))
        assert rel <= 1e-6, (name, rel)


def test_the_recompute_routes_as_the_first_forward_even_where_the_router_would_not():
    """A router that changes its mind between the forward and the backward (as a kernel that is not deterministic
    may, near a top-k tie) still recomputes with the first forward's routes."""
    spec = _spec("qwen3_moe")
    torch.manual_seed(0)
    model = build_policy(spec)
    checkpoint_layers(model)
    routers = [layer.mlp.gate for layer in model.causal_lm.model.layers]
    calls: dict[int, int] = {}

    def fickle(module, args):  # from its second call on, the router sees its input negated: other experts win
        calls[id(module)] = calls.get(id(module), 0) + 1
        return (-args[0],) if calls[id(module)] > 1 else None

    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_pre_hook(fickle) for r in routers]
    hooks += [r.register_forward_hook(lambda m, a, out: seen.append(out[2].clone())) for r in routers]
    tokens = torch.randint(3, 1000, (1, SEQ), generator=torch.Generator().manual_seed(2))
    batch = {"tokens": tokens, "loss_mask": torch.ones(1, SEQ)}
    out = policy_forward(model, batch, RoutingControl(), need_entropy=False)
    first = list(seen)
    (out.logprobs.sum() + out.z_loss).backward()
    recomputed = seen[len(first) :]
    assert len(first) == len(recomputed) == len(routers)  # each layer ran once more, in the backward
    for a, b in zip(first, reversed(recomputed), strict=True):
        assert torch.equal(a, b)
    for h in hooks:
        h.remove()
    assert model.recorder.recompute == {}  # nothing left forced after the backward


def test_checkpointing_is_idempotent_and_keeps_parameter_names():
    spec = _spec("tiny_moe")
    model = build_policy(spec)
    names = [n for n, _ in model.named_parameters()]
    checkpoint_layers(model)
    checkpoint_layers(model)
    assert all(is_checkpointed(b) for b in model.blocks)
    assert [n for n, _ in model.named_parameters()] == names
    with torch.no_grad():  # no autograd, no checkpoint: the plain forward
        model(torch.zeros(1, 4, dtype=torch.long))


def test_a_replay_placement_checkpoints_the_layers_of_the_model_it_builds():
    """What the worker builds when the plan chose checkpointed layers: the snapshot's model, its layers patched, the
    rank's step the same as the plain build's."""
    from pathlib import Path

    from axrl_spike_replay.replay.compute.model_build import Placement, build_model
    from axrl_spike_replay.replay.reading.inputs import read_run_config
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch

    snapshot = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
    snapshot = snapshot / "checkpoints" / "spike_snapshots" / "iter_0000021"
    spec = parse_model_config(read_run_config(snapshot)["model"])
    plain = build_model(spec, str(snapshot), "cpu")
    ckpt = build_model(spec, str(snapshot), "cpu", Placement(checkpoint_layers=True))
    assert all(is_checkpointed(b) for b in ckpt.blocks) and not any(is_checkpointed(b) for b in plain.blocks)
    batch = load_rank_batch(snapshot, 0)
    want, got = (_step(m, batch, RoutingControl()) for m in (plain, ckpt))
    for name, g in want[4].items():
        assert float((got[4][name] - g).norm() / g.norm().clamp_min(1e-30)) <= 1e-6, name
