"""The trainer's attention kernel is recorded and replayed: sdpa runs here and stays within its documented bound of
eager on the same step; flash_attention_2 is refused on a node that cannot run it, naming sdpa and what changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.attention_kernels import KERNEL_BOUNDS, check_attention_runs, compare_to_eager
from axrl_spike_replay.models.policy import build_policy, parse_model_config
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.replay.compute.model_build import build_model
from axrl_spike_replay.testing.hf_snapshot import model_section


def _batch(seq: int = 40):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 1000, (2, seq), generator=g)
    loss_mask = torch.zeros(2, seq)
    loss_mask[:, seq // 2 :] = 1.0
    return {"tokens": tokens, "loss_mask": loss_mask, "attention_mask": torch.ones_like(tokens)}


def _loss(out):
    # a policy-gradient-like loss, with the router losses so the routers' gradients are compared too
    return -out.logprobs[:, 20:].mean() + 1e-3 * out.z_loss + 1e-2 * out.aux_loss


@pytest.mark.parametrize("architecture", ["qwen3_moe", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sdpa_replays_the_step_within_its_bound_of_eager(architecture, dtype):
    spec = parse_model_config(dict(model_section(architecture), dtype=dtype, attn_implementation="sdpa"))
    torch.manual_seed(0)
    state = build_policy(dataclasses.replace(spec, attn_implementation="eager")).state_dict()
    check = compare_to_eager(spec, state, _batch(), RoutingControl(), _loss)
    assert check.bound == KERNEL_BOUNDS[dtype]
    assert check.within, check
    if dtype == "float32":
        assert check.grad_norm_rel < 1e-6


def test_the_kernel_is_recorded_in_the_run_config():
    spec = parse_model_config(dict(model_section("qwen3_moe"), attn_implementation="sdpa"))
    assert spec.to_dict()["attn_implementation"] == "sdpa"
    assert parse_model_config(spec.to_dict()).attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="attn_implementation"):
        parse_model_config(dict(model_section("qwen3_moe"), attn_implementation="flex_magic"))


def test_sdpa_keeps_no_attention_scores_for_the_backward():
    """Eager saves [B, heads, T, T] float probabilities per layer for the backward; sdpa saves no float [T, T]
    tensor (only O(T) per head, and at most a boolean mask)."""
    seq = 256
    scores: dict[str, int] = {}
    for kernel in ("eager", "sdpa"):
        spec = parse_model_config(dict(model_section("qwen3_moe"), attn_implementation=kernel))
        torch.manual_seed(0)
        model = build_policy(spec)
        sizes: list[int] = []

        def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            if t.dim() >= 2 and tuple(t.shape[-2:]) == (seq, seq) and t.is_floating_point():
                sizes.append(t.numel() * t.element_size())  # [.., T, T] float: attention scores or probabilities
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(3, 1000, (1, seq))).logits.sum().backward()
        scores[kernel] = sum(sizes)
    heads = model_section("qwen3_moe")["config"]["num_attention_heads"]
    layers = model_section("qwen3_moe")["config"]["num_hidden_layers"]
    assert scores["eager"] >= layers * heads * seq * seq * 4  # at least the probabilities of every layer
    assert scores["sdpa"] == 0


def test_flash_attention_is_refused_here_naming_sdpa_before_anything_loads(tmp_path):
    spec = parse_model_config(dict(model_section("qwen3_moe"), attn_implementation="flash_attention_2"))
    assert spec.n_layers == 2  # the config is read (plan works on it) without flash_attn
    with pytest.raises(ConfigError, match="flash_attention_2 cannot run here") as caught:
        build_model(spec, str(tmp_path / "no-weights"), "cpu")
    assert "sdpa" in str(caught.value) and "not a CUDA device" in str(caught.value)
    check_attention_runs("sdpa", "bfloat16", "cpu")  # sdpa runs anywhere
