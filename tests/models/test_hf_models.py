"""The six transformers MoE architectures as replay policies: built from configs, routes forced on their real
routers, weights loaded from either expert layout or an HF directory, log-probs as RL trainers take them.

Checked against the peers: transformers' own forward (no hook effect without replay), transformers' own
`load_balancing_loss_func`, `revert_weight_conversion` and `save_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from axrl_spike_replay.models.architectures import ARCHITECTURES
from axrl_spike_replay.models.hf_policy import HFPolicy, hf_logprobs
from axrl_spike_replay.models.hf_weights import load_hf_weights, to_model_layout, to_per_expert_layout
from axrl_spike_replay.models.policy import build_policy, check_policy_weights
from axrl_spike_replay.models.tiny_moe import RoutingControl, token_logprobs
from axrl_spike_replay.testing.hf_snapshot import save_dcp, seeded_policy

# qwen3_moe runs by default; the rest of the matrix is marked `matrix` (left out of the default run) and slow.
EACH = [
    pytest.param(a, marks=() if a == "qwen3_moe" else (pytest.mark.slow, pytest.mark.matrix)) for a in ARCHITECTURES
]


def _tokens(vocab: int = 1024, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(5))


def _policy(architecture: str) -> HFPolicy:
    _, model = seeded_policy(architecture)
    assert isinstance(model, HFPolicy)
    return model


@pytest.mark.parametrize("architecture", EACH)
def test_forcing_the_models_own_routes_reproduces_its_logits_bitwise(architecture: str) -> None:
    model = _policy(architecture)
    tokens = _tokens()
    with torch.no_grad():
        plain = model.causal_lm(input_ids=tokens).logits  # transformers' own forward
        own = model(tokens)
        forced = model(tokens, RoutingControl(routes=own.routes))
        shifted = model(tokens, RoutingControl(routes=(own.routes + 1) % model.n_experts))
    assert torch.equal(own.logits, plain)
    assert torch.equal(forced.logits, own.logits)
    assert not torch.equal(shifted.logits, own.logits)
    assert torch.equal(shifted.routes, (own.routes + 1) % model.n_experts)  # the routes used are the forced ones


@pytest.mark.parametrize("architecture", EACH)
def test_aux_loss_matches_transformers_and_follows_the_forced_routes(architecture: str) -> None:
    model = _policy(architecture)
    tokens = _tokens()
    with torch.no_grad():
        peer = model.causal_lm(input_ids=tokens, output_router_logits=True).aux_loss
        own = model(tokens)
        shifted = model(tokens, RoutingControl(routes=(own.routes + 3) % model.n_experts))
    if architecture == "deepseek_v3":
        assert peer is None  # transformers computes none (bias-balanced routing)
    else:
        assert torch.allclose(own.aux_loss, peer.float(), rtol=1e-6, atol=0)
    assert not torch.equal(shifted.aux_loss, own.aux_loss)


@pytest.mark.parametrize("architecture", EACH)
def test_current_layers_and_loss_token_replay_limit_what_is_forced(architecture: str) -> None:
    model = _policy(architecture)
    tokens = _tokens()
    with torch.no_grad():
        own = model(tokens)
        wrong = (own.routes + 1) % model.n_experts
        every = model(tokens, RoutingControl(routes=wrong))
        first = model.moe_layer_ids[0]
        current_first = model(tokens, RoutingControl(routes=wrong, current_layers=frozenset({first})))
        replay_tokens = torch.zeros(tokens.shape, dtype=torch.bool)
        replay_tokens[:, 16:] = True
        loss_only = model(tokens, RoutingControl(routes=wrong, replay_tokens=replay_tokens))
    assert torch.equal(current_first.routes[:, :, 0], own.routes[:, :, 0])  # first MoE layer routes on its own
    assert torch.equal(current_first.routes[:, :, 1:], wrong[:, :, 1:])
    assert torch.equal(loss_only.routes[:, 16:], wrong[:, 16:])
    assert not torch.equal(loss_only.logits, every.logits)  # prompt tokens route on current scores
    # causal: positions before 16 see only their own (current) routes in every layer; the experts' batched
    # matmuls see other token sets than in `own`, so the kernels may sum in another order (last-bit differences)
    torch.testing.assert_close(loss_only.logits[:, :16], own.logits[:, :16], rtol=0, atol=1e-5)


def test_payload_indexed_by_absolute_layer_skips_dense_layers() -> None:
    model = _policy("deepseek_v3")  # layer 0 dense (first_k_dense_replace=1)
    assert model.moe_layer_ids == (1, 2)
    tokens = _tokens()
    with torch.no_grad():
        own = model(tokens)
        per_layer = torch.full((*own.routes.shape[:2], model.n_layers, own.routes.shape[3]), -1)
        per_layer[:, :, 1:] = (own.routes + 1) % model.n_experts
        absolute = model(tokens, RoutingControl(routes=per_layer))
        compact = model(tokens, RoutingControl(routes=(own.routes + 1) % model.n_experts))
    assert torch.equal(absolute.logits, compact.logits)


@pytest.mark.parametrize("architecture", EACH)
def test_logprobs_of_the_chunked_head_equal_the_full_logits_ones(architecture: str) -> None:
    model = _policy(architecture)
    tokens = _tokens()
    loss_mask = torch.zeros(tokens.shape)
    loss_mask[:, 10:] = 1.0
    with torch.no_grad():
        full = token_logprobs(model(tokens).logits, tokens)
        kept, _, out = hf_logprobs(model, {"tokens": tokens, "loss_mask": loss_mask}, RoutingControl(), False)
    assert out.logits.shape[1] == 0  # no logits held: the head ran in chunks over the response positions
    assert torch.allclose(kept[:, 10:], full[:, 10:], rtol=0, atol=1e-6)
    assert torch.equal(kept[:, :10], torch.zeros(2, 10))


def test_left_padded_prompts_get_positions_from_the_attention_mask() -> None:
    model = _policy("qwen3_moe")
    tokens = _tokens(seq=12)
    mask = torch.ones_like(tokens)
    mask[0, :4] = 0
    with torch.no_grad():
        ours = model(tokens, attention_mask=mask).logits
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        peer = model.causal_lm(input_ids=tokens, attention_mask=mask, position_ids=positions).logits
    assert torch.equal(ours, peer)
    # a sample's real tokens do not depend on how much padding precedes them
    with torch.no_grad():
        alone = model(tokens[:1, 4:]).logits
    assert torch.allclose(ours[0, 4:], alone[0], atol=1e-5)


def test_temperature_divides_the_logits_before_the_log_softmax() -> None:
    import dataclasses

    model = _policy("qwen3_moe")
    hot = build_policy(dataclasses.replace(model.spec, temperature=2.0))
    hot.load_state_dict(model.state_dict())
    assert isinstance(hot, HFPolicy)
    tokens = _tokens()
    loss_mask = torch.ones(tokens.shape)
    batch = {"tokens": tokens, "loss_mask": loss_mask}
    with torch.no_grad():
        logp, _, _ = hf_logprobs(hot, batch, RoutingControl(), False)
        expected = (model(tokens).logits[:, :-1].float() / 2.0).log_softmax(-1)
    expected = expected.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert torch.allclose(logp[:, 1:], expected, atol=1e-6)


@pytest.mark.parametrize("architecture", EACH)
def test_both_expert_layouts_load_to_identical_weights(architecture: str, tmp_path: Path) -> None:
    model = _policy(architecture)
    fused = {k: v.detach().clone() for k, v in model.state_dict().items()}
    per_expert = to_per_expert_layout(model.causal_lm, fused)  # transformers' own reverse conversion
    if architecture != "gpt_oss":  # gpt_oss checkpoints are fused: transformers has no per-expert layout for it
        assert any(".experts.0." in k for k in per_expert) and not any("gate_up_proj" in k for k in per_expert)
    merged = to_model_layout(model.causal_lm, per_expert)
    assert merged.keys() == fused.keys()
    assert all(torch.equal(merged[k], fused[k]) for k in fused)
    for name, state in (("fused", fused), ("per_expert", per_expert)):
        save_dcp(tmp_path / name, state)
        check_policy_weights(tmp_path / name, model.spec, name)
        fresh = build_policy(model.spec)
        load_hf_weights(fresh, tmp_path / name)
        loaded = fresh.state_dict()
        assert all(torch.equal(loaded[k], fused[k]) for k in fused), name


@pytest.mark.parametrize("architecture", EACH)
def test_an_hf_directory_written_by_save_pretrained_loads(architecture: str, tmp_path: Path) -> None:
    from axrl_spike_replay.models.policy import parse_model_config

    model = _policy(architecture)
    model.causal_lm.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert not list((tmp_path / "hf").glob("*.bin"))
    spec = parse_model_config({"kind": "hf", "architecture": architecture, "path": str(tmp_path / "hf")})
    check_policy_weights(tmp_path / "hf", spec, "the HF directory")
    fresh = build_policy(spec)
    load_hf_weights(fresh, tmp_path / "hf")
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(fresh(tokens).logits, model(tokens).logits)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 10**6}, "num_hidden_layers"),
        ({"num_experts": 10**5}, "num_experts"),
        ({"vocab_size": 1 << 30}, "vocab_size"),
        ({"hidden_size": 1 << 20}, "hidden_size"),
        ({"auto_map": {"AutoModelForCausalLM": "evil.Model"}}, "remote code"),
        ({"model_type": "mixtral"}, "model_type"),
    ],
)
def test_a_hostile_hf_config_is_refused_before_anything_is_built(change: dict, message: str) -> None:
    from axrl_spike_replay.errors import ConfigError
    from axrl_spike_replay.models.policy import parse_model_config
    from axrl_spike_replay.testing.hf_snapshot import model_section

    doc = model_section("qwen3_moe")
    doc["config"] = {**doc["config"], **change}
    with pytest.raises(ConfigError, match=message):
        parse_model_config(doc)


@pytest.mark.parametrize(
    ("key", "value"),
    [("architecture", "jamba"), ("experts_implementation", "deepgemm"), ("attn_implementation", "flex_attention")],
)
def test_what_the_engine_cannot_build_points_to_the_command_backend(key: str, value: str) -> None:
    from axrl_spike_replay.errors import ConfigError
    from axrl_spike_replay.models.policy import parse_model_config
    from axrl_spike_replay.testing.hf_snapshot import model_section

    with pytest.raises(ConfigError, match="--backend command"):
        parse_model_config({**model_section("qwen3_moe"), key: value})
