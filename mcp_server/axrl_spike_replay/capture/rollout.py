"""Rollouts from a bf16 copy of the policy, the way an inference engine produces them.

Tokens are sampled one at a time from the bf16 engine; then one bf16 forward over the full
sequences gives the rollout logprobs and the routes (`routed_experts`) the engine used. Both
genuinely differ from the trainer's fp32 forward, as they do between an inference engine and a
trainer. Fault knobs reproduce known engine bugs for the presets.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from axrl_spike_replay.capture.presets import EngineFaults
from axrl_spike_replay.models.tiny_moe import TinyMoEPolicy, token_logprobs


@dataclass
class Rollout:
    tokens: torch.Tensor  # [B, T] int64, prompt then response
    loss_mask: torch.Tensor  # [B, T] float32, 1 on response tokens
    rollout_logprobs: torch.Tensor  # [B, T] float32, as the engine reported them
    routed_experts: torch.Tensor  # [B, T, L_moe, K] int32, as the engine recorded them


def rollout_engine(policy: TinyMoEPolicy) -> TinyMoEPolicy:
    """A bf16 inference copy of the current policy (no gradients)."""
    engine = copy.deepcopy(policy)
    for p in engine.parameters():
        p.grad = None
    engine.to(torch.bfloat16).eval()
    engine.requires_grad_(False)
    return engine


@torch.no_grad()
def generate(
    engine: TinyMoEPolicy,
    prompts: torch.Tensor,
    response_len: int,
    generator: torch.Generator,
    *,
    temperature: float = 1.0,
    faults: EngineFaults | None = None,
) -> Rollout:
    """Sample `response_len` tokens per prompt, then record the engine's logprobs and routes."""
    faults = faults or EngineFaults()
    tokens = prompts.clone()
    for _ in range(response_len):
        logits = engine(tokens).logits[:, -1].float() / temperature
        nxt = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)

    out = engine(tokens)
    logits = out.logits.float()
    lp_temperature = faults.logprob_temperature if faults.logprob_temperature is not None else temperature
    rollout_logprobs = token_logprobs(logits / lp_temperature, tokens)
    routes = out.routes.to(torch.int32)
    if faults.stale_route_layer is not None:
        n_experts = engine.cfg.n_experts
        layer = faults.stale_route_layer
        routes[:, :, layer] = (routes[:, :, layer] + 1) % n_experts  # expert ids from a stale table
    loss_mask = torch.zeros(tokens.shape, dtype=torch.float32)
    loss_mask[:, prompts.shape[1] :] = 1.0
    return Rollout(tokens=tokens, loss_mask=loss_mask, rollout_logprobs=rollout_logprobs, routed_experts=routes)
