"""Rollouts from a bf16 copy of the policy, the way an inference engine produces them.

Tokens are sampled one at a time from the bf16 engine; then one bf16 forward over the full
sequences gives the rollout logprobs and the routes (`routed_experts`) the engine used. Both
genuinely differ from the trainer's fp32 forward, as they do between an inference engine and a
trainer. Fault knobs reproduce known engine bugs for the presets.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from axrl_spike_replay.capture.reference.presets import EngineFaults
from axrl_spike_replay.models.tiny_moe import TinyMoEPolicy, token_logprobs


@dataclass
class Rollout:
    tokens: torch.Tensor  # [B, T] int64, prompt then response
    loss_mask: torch.Tensor  # [B, T] float32, 1 on response tokens
    rollout_logprobs: torch.Tensor  # [B, T] float32, as the engine reported them
    routed_experts: torch.Tensor  # [B, T, L_moe, K] int32, as the engine recorded them


def rollout_engine(policy: nn.Module) -> nn.Module:
    """A bf16 inference copy of the current policy (no gradients).

    A transformers policy is rebuilt in bf16 from its spec and given the weights (a deep copy would
    share the original's routing hooks)."""
    if not isinstance(policy, TinyMoEPolicy):
        from axrl_spike_replay.models.hf_policy import HFPolicy
        from axrl_spike_replay.models.policy import build_policy

        assert isinstance(policy, HFPolicy)
        hf_engine = build_policy(dataclasses.replace(policy.spec, dtype="bfloat16"))
        hf_engine.load_state_dict(policy.state_dict())
        hf_engine.eval().requires_grad_(False)
        return hf_engine
    engine = copy.deepcopy(policy)
    for p in engine.parameters():
        p.grad = None
    engine.to(torch.bfloat16).eval()
    engine.requires_grad_(False)
    return engine


@torch.no_grad()
def generate(
    engine: nn.Module,
    prompts: torch.Tensor,
    response_len: int,
    generator: torch.Generator,
    *,
    temperature: float = 1.0,
    faults: EngineFaults | None = None,
) -> Rollout:
    """Sample `response_len` tokens per prompt, then record the engine's logprobs and routes."""
    faults = faults or EngineFaults()
    if isinstance(engine, TinyMoEPolicy):
        tokens = prompts.clone()
        for _ in range(response_len):
            logits = engine(tokens).logits[:, -1].float() / temperature
            nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
    else:
        tokens = _sample_with_cache(engine, prompts, response_len, generator, temperature)

    out = engine(tokens)
    logits = out.logits.float()
    lp_temperature = faults.logprob_temperature if faults.logprob_temperature is not None else temperature
    rollout_logprobs = token_logprobs(logits / lp_temperature, tokens)
    routes = out.routes.to(torch.int32)
    if faults.stale_route_layer is not None:
        n_experts: int = engine.cfg.n_experts if isinstance(engine, TinyMoEPolicy) else getattr(engine, "n_experts")  # noqa: B009
        layer = faults.stale_route_layer
        routes[:, :, layer] = (routes[:, :, layer] + 1) % n_experts  # expert ids from a stale table
    if faults.route_shift:
        routes = shifted_routes(routes, faults.route_shift)
    loss_mask = torch.zeros(tokens.shape, dtype=torch.float32)
    loss_mask[:, prompts.shape[1] :] = 1.0
    return Rollout(tokens=tokens, loss_mask=loss_mask, rollout_logprobs=rollout_logprobs, routed_experts=routes)


def _sample_with_cache(
    engine: nn.Module, prompts: torch.Tensor, response_len: int, generator: torch.Generator, temperature: float
) -> torch.Tensor:
    """Sample from a transformers engine with its KV cache, as inference engines decode (one new token a step)."""
    causal_lm: Any = engine.causal_lm
    tokens = prompts.clone()
    out = causal_lm(input_ids=tokens, use_cache=True, logits_to_keep=1)
    for step in range(response_len):
        logits = out.logits[:, -1].float() / temperature
        nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
        if step + 1 < response_len:
            out = causal_lm(input_ids=nxt, cache=out.cache, use_cache=True, logits_to_keep=1)
    return tokens


def shifted_routes(routes: torch.Tensor, shift: int) -> torch.Tensor:
    """[B, T, L, K] routes moved `shift` tokens later along the sequence (the first positions repeat the
    first token's): the routing payload off by `shift` tokens from the tokens, as when an engine counts a
    BOS or a chat-template token the trainer's sequence does not have."""
    if shift <= 0 or shift >= routes.shape[1]:
        return routes
    head = routes[:, :1].expand(-1, shift, -1, -1)
    return torch.cat([head, routes[:, :-shift]], dim=1).contiguous()
