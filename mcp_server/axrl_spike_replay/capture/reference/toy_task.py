"""The reference trainer's toy task: echo the prompt's first token; rewards and advantage estimators.

The task's alphabet is the first `TASK_ALPHABET` token ids: prompts use only those, and a response token
scores when its class (id mod the alphabet) is the prompt's first token. With the tiny model's vocab of 16
that is plain equality; with a real vocab (>= 1024) every token still has a class, so a freshly initialised
policy earns a reward about one token in 16 and GRPO groups differ from the first step.
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = ("grpo", "reinforce_baseline")
TASK_ALPHABET = 16


def make_prompts(generator: torch.Generator, n_prompts: int, prompt_len: int, vocab_size: int) -> torch.Tensor:
    """[n_prompts, prompt_len] random prompt tokens from the task's alphabet."""
    alphabet = min(vocab_size, TASK_ALPHABET)
    return torch.randint(0, alphabet, (n_prompts, prompt_len), generator=generator, dtype=torch.int64)


def echo_reward(tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B] fraction of response tokens whose class (id mod the alphabet) is the prompt's first token (in [0, 1])."""
    response = tokens[:, prompt_len:]
    return (response % TASK_ALPHABET == tokens[:, :1]).float().mean(dim=-1)


def broken_reward(tokens: torch.Tensor, penalty: float) -> torch.Tensor:
    """[B] what a broken reward function returns: the same large penalty for every sample."""
    return torch.full((tokens.shape[0],), -float(penalty), dtype=torch.float32)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6, unbiased: bool = False) -> torch.Tensor:
    """[B] GRPO advantages: each reward standardised by its prompt group's mean and std.

    The std is the population std (axrl), or Bessel-corrected with `unbiased` as verl's
    `compute_grpo_outcome_advantage` takes it (`torch.std`)."""
    groups = rewards.float().view(-1, group_size)
    mean = groups.mean(dim=-1, keepdim=True)
    std = groups.std(dim=-1, keepdim=True, unbiased=unbiased)
    return ((groups - mean) / (std + eps)).reshape(-1)


def baseline_advantages(rewards: torch.Tensor, baseline: float) -> torch.Tensor:
    """[B] REINFORCE-with-baseline advantages: reward minus the running mean reward."""
    return rewards.float() - float(baseline)
