"""A ninth set of held-out trainer bugs: kinds no preset and no `held_out`, `unseen`, `held_out_ii`, `held_out_iii`,
`held_out_iv`, `held_out_v`, `held_out_vi`, `held_out_vii` or `held_out_viii` case uses, written and committed before
any diagnosis was run on them.

Each is a bug real RL stacks have had, planted on chosen ranks during the burst, with nothing of it in the run
config or the log (`capture_reference_run(hide_fault=True)`). Three are in the data the rank's step consumes (the
snapshot stores it as consumed), three in what the trainer does with it (`gradients` stage: the snapshot stores the
batch and weights the step should have used):

- `tokens_double_bos`: the rank's batch is tokenized with the BOS added twice (a chat template that writes one and
  a tokenizer that adds another): its token rows are one position on (the first token repeated, the last dropped),
  while the log-probs and masks it carries were taken on the rollout's tokens;
- `reward_length_penalty_per_token`: a length penalty whose coefficient is per thousand response tokens applied per
  token: each reward loses `coef` times its response length, far below the verifier's [0, 1] range;
- `rollout_logprobs_sample_major`: the engine client sends a group's samples as separate requests over all the
  prompts (one request per sample index) and reads the outputs back sample-major into a batch laid out prompt-major:
  each row gets the engine log-probs of another row (another prompt's, or another sample's of its own prompt);
- `loss_scale_not_removed`: one rank's fp16 loss scaler never unscales its gradients before they are reduced: every
  gradient of the rank is `scale` (default 2^16, a dynamic scaler's initial scale) times what its loss gives;
- `grad_accumulation_off_by_one`: one rank divides its summed micro-batch losses by the micro-batch count less one
  (a 0-based counter): with one micro-batch a division by zero, its gradients infinite (NaN where 0);
- `train_forward_double_bos`: one rank's training collator adds a second BOS the rollout never saw: its training
  forward scores the tokens one position on, while its snapshot stores the batch as the rollout made it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from axrl_spike_replay.capture.fault_injection.fault_base import BuiltinFault, StepParts
from axrl_spike_replay.capture.fault_injection.fault_params import MAX_SCALE, ParamRule, number, whole


def double_bos(tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] token rows with their first token (the BOS) written twice: one position on, the last token dropped."""
    return torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)


class TokensDoubleBos(BuiltinFault):
    """A batch whose tokens carry the BOS twice (`double_bos`) while its log-probs and masks are the rollout's."""

    stage = "batch"
    part = "tokens"

    def corrupt(self, parts: StepParts) -> None:
        self.replace_rows(parts, "tokens", double_bos(parts.batch["tokens"]))


def response_lengths(parts: StepParts) -> torch.Tensor:
    """[B] float: each sample's response length in tokens (its loss-mask tokens after the prompt; without a mask,
    every position after the prompt)."""
    mask = parts.batch.get("loss_mask")
    if mask is None:
        return torch.full((parts.batch["tokens"].shape[0],), float(parts.batch["tokens"].shape[1] - parts.prompt_len))
    return (mask[:, parts.prompt_len :] > 0).float().sum(dim=-1)


class RewardLengthPenaltyPerToken(BuiltinFault):
    """Rewards less `coef` (default 0.5, meant per thousand tokens) times the response length counted in tokens."""

    stage = "rewards"
    part = "rewards"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"coef": number(1e-6, MAX_SCALE)}

    def corrupt(self, parts: StepParts) -> None:
        rewards = parts.batch["rewards"]
        penalised = rewards.float() - float(self.param("coef", 0.5)) * response_lengths(parts)
        self.replace_rows(parts, "rewards", penalised)


def sample_major(rows: int, group_size: int) -> torch.Tensor:
    """[rows] index: the row a prompt-major batch (each prompt's `group_size` samples together) reads at each
    position when the outputs come back sample-major (every prompt's first sample, then every second, ...)."""
    return torch.arange(rows).view(rows // group_size, group_size).t().reshape(-1)


class RolloutLogprobsSampleMajor(BuiltinFault):
    """Engine log-probs read back sample-major into a prompt-major batch (`sample_major`)."""

    stage = "rollout"
    part = "rollout_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        values = parts.batch["rollout_logprobs"]
        order = sample_major(values.shape[0], int(parts.trainer.train.group_size))
        self.replace_rows(parts, "rollout_logprobs", torch.where(parts.response(), values[order], values))


class LossScaleNotRemoved(BuiltinFault):
    """A rank whose fp16 loss scaler never unscales its gradients: every gradient is `scale` (default 65536) times
    its loss's."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"scale": number(1.0, MAX_SCALE)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        scale = float(self.param("scale", 65536.0))
        with torch.no_grad():
            for p in parts.trainer.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)


class GradAccumulationOffByOne(BuiltinFault):
    """A rank that divides its summed micro-batch losses by the micro-batch count less one (a counter read as
    0-based): its gradients are `micro_batches / (micro_batches - 1)` times its loss's; with one micro-batch (the
    default), a division by zero: every gradient of the rank infinite, or NaN where it was 0."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"micro_batches": whole(1, 4096)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        count = float(self.param("micro_batches", 1))
        with torch.no_grad():
            for p in parts.trainer.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(count).div_(count - 1.0)


class TrainForwardDoubleBos(BuiltinFault):
    """A rank whose training collator writes the BOS twice: its gradients are those of its loss on the tokens one
    position on (`double_bos`) against the rollout's log-probs and masks; its snapshot stores the batch as made."""

    stage = "gradients"
    part = "gradients"

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.training.rank_step import rank_forward_backward

        assert parts.trainer is not None and parts.loss is not None
        batch = dict(parts.batch)
        tokens = batch["tokens"]
        rows = self.rows(tokens.shape[0])
        shifted = tokens.clone()
        shifted[rows] = double_bos(tokens)[rows]
        batch["tokens"] = shifted
        model = parts.trainer.model
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            rank_forward_backward(model, batch, parts.loss, parts.routing())


HELD_OUT_IX_KINDS: dict[str, type[BuiltinFault]] = {
    "tokens_double_bos": TokensDoubleBos,
    "reward_length_penalty_per_token": RewardLengthPenaltyPerToken,
    "rollout_logprobs_sample_major": RolloutLogprobsSampleMajor,
    "loss_scale_not_removed": LossScaleNotRemoved,
    "train_forward_double_bos": TrainForwardDoubleBos,
    "grad_accumulation_off_by_one": GradAccumulationOffByOne,
}
