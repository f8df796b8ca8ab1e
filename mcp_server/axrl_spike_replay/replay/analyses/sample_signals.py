"""What an attribution reports of each sample beside its contribution, and the parts of the loss it attributes
separately: shared by the whole (`replay.analyses.attribution`) and the sharded
(`replay.analyses.sharded_attribution`) attribution."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.replay.analyses.rank_micro_batches import joined_loss, micro_forwards, micro_loss
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, config_loss, loss_batch
from axrl_spike_replay.training.micro_batches import MicroBatch, stitch
from axrl_spike_replay.training.policy_loss import LossOutput, expand_advantages


def rank_signals(
    rank: int, batch: dict[str, torch.Tensor], logprobs: torch.Tensor, mask: torch.Tensor, base: str
) -> list[dict[str, Any]]:
    """Per sample of a rank batch: what the attribution reports beside its contribution (advantage, reward, the
    largest |log-prob - base log-prob| on its loss tokens, loss tokens, group). A batch without its base log-probs
    (TRL's, when it kept no old ones: its ratio is against the current log-probs) shows 0."""
    adv = expand_advantages(batch["advantages"], logprobs.shape)
    tokens = mask.sum(dim=-1)
    stored = batch.get(f"{base}_logprobs")
    base_logprobs = logprobs if stored is None else stored.float()
    log_ratio = ((logprobs - base_logprobs).abs() * (mask > 0)).amax(dim=-1)
    rewards = batch.get("rewards")
    groups = batch.get("group_index")
    return [
        {
            "rank": rank,
            "sample": s,
            "advantage": float((adv[s] * mask[s]).sum() / tokens[s]) if tokens[s] > 0 else float(adv[s].mean()),
            "reward": float(rewards[s]) if rewards is not None else None,
            "max_abs_log_ratio_current_vs_base": float(log_ratio[s]),
            "loss_tokens": int(tokens[s]),
            "group": int(groups[s]) if groups is not None else None,
        }
        for s in range(logprobs.shape[0])
    ]


def base_name(cfg: AppliedConfig) -> str:
    """The stored log-probs the per-sample log-ratio is taken against under `cfg`."""
    return "old" if cfg.loss.mismatch_token_clip_max is not None else cfg.loss.is_base_logprobs


def router_loss(cfg: AppliedConfig, out: Any, rank: int) -> torch.Tensor | None:
    """Saved rank `rank`'s batch-level router losses as its loss adds them (its own coefficients and scale under a
    hypothesis); None when no loss of the config has any, so every rank (and process) agrees on whether there is one.
    On a rank the config leaves out it is still returned: the caller adds nothing of it (`MicroStep.kept`)."""
    if not any(loss.aux_loss_coef or loss.z_loss_coef for loss in cfg.losses()):
        return None
    own = cfg.loss_of(rank)
    loss = own.aux_loss_coef * out.aux_loss + own.z_loss_coef * out.z_loss
    if own.loss_scale is not None:
        loss = loss * own.loss_scale
    return loss if loss.requires_grad else None


@dataclass
class MicroStep:
    """One micro-batch of a saved rank as an attribution takes it: its forward, loss and router losses."""

    mb: MicroBatch
    out: Any  # the micro-batch's forward; its log-probs (and entropy) keep their gradients after a backward
    result: LossOutput  # its loss, unscaled
    loss: torch.Tensor  # its loss as the trainer backpropagated it (times `mb.scale`)
    router: torch.Tensor | None  # its batch-level router losses (`router_loss`), scaled the same
    kept: bool = True  # False: the config leaves this rank out, and nothing of it (router terms included) counts


def micro_steps(
    model: torch.nn.Module, inputs: RankInputs, cfg: AppliedConfig, rank: int, counts: Any
) -> Iterator[MicroStep]:
    """Saved rank `rank`'s micro-batches one at a time (`rank_micro_batches.micro_forwards`: the saved batch, the
    config's routing, the trainer's split), each with the config's loss on its filtered rows as in a replay
    (`process_inputs.config_loss`), its log-probs (and entropy) keeping their gradients. The caller takes the backwards
    and drops the step before the next: one micro-batch's graph at a time."""
    saved = inputs.batches[rank]
    kept = cfg.samples.keeps_rank(rank)
    for mb, part in micro_forwards(model, inputs, cfg, rank, cfg.needs_entropy):
        part.logprobs.retain_grad()
        if part.entropy is not None:
            part.entropy.retain_grad()
        result = micro_loss(part, saved, rank, cfg, mb, lambda view, b: config_loss(view, b, cfg, rank, counts))
        router = router_loss(cfg, part, rank)
        scale = mb.scale
        yield MicroStep(
            mb,
            part,
            result,
            result.loss * scale if scale != 1.0 else result.loss,
            router * scale if router is not None and scale != 1.0 else router,
            kept,
        )


class RankGather:
    """A saved rank's figures gathered over its micro-batches after each one's backward (detached): dLoss/dlogprobs,
    dLoss/dentropy and the routes at the rank's rows, and its samples' signals."""

    def __init__(self, rank: int, saved: dict[str, torch.Tensor], plan: Sequence[MicroBatch]) -> None:
        self.rank, self.saved, self.plan = rank, saved, list(plan)
        self.size, self.width = int(saved["tokens"].shape[0]), int(saved["tokens"].shape[1])
        self.grad_logprobs: list[torch.Tensor] = []
        self.grad_entropy: list[torch.Tensor] = []
        self.routes: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []
        self.results: list[LossOutput] = []

    def add(self, step: MicroStep) -> None:
        """Keep a micro-batch's figures (after its backward)."""
        out = step.out
        self.grad_logprobs.append(grad_or_zeros(out.logprobs))
        if out.entropy is not None:
            self.grad_entropy.append(grad_or_zeros(out.entropy))
        self.routes.append(out.routes.detach())
        self.logprobs.append(out.logprobs.detach())
        r = step.result
        self.results.append(
            LossOutput(r.loss.detach(), r.policy_loss.detach(), r.per_token.detach(), r.mask.detach(), r.metrics)
        )

    def _at_rows(self, parts: list[torch.Tensor], fill: float = 0) -> torch.Tensor:
        if len(self.plan) == 1 and self.plan[0].rows == tuple(range(self.size)) and self.plan[0].width == self.width:
            return parts[0]
        return stitch(parts, self.plan, self.size, self.width, fill)

    @property
    def grad_logprobs_rows(self) -> torch.Tensor:
        return self._at_rows(self.grad_logprobs)

    @property
    def grad_entropy_rows(self) -> torch.Tensor | None:
        return self._at_rows(self.grad_entropy) if len(self.grad_entropy) == len(self.plan) else None

    @property
    def routes_rows(self) -> torch.Tensor:
        return self._at_rows(self.routes, fill=-1)

    def signals(self, cfg: AppliedConfig) -> list[dict[str, Any]]:
        """Per sample, what the attribution reports beside its contribution (`rank_signals`)."""
        logprobs = self._at_rows(self.logprobs)
        mask = joined_loss(self.results, self.plan, self.size, self.width).mask
        batch = loss_batch(self.saved, self.rank, cfg, logprobs)
        return rank_signals(self.rank, batch, logprobs, mask, base_name(cfg))


def cut_rows(value: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """A rank's [B, T, ...] tensor cut to micro-batch `mb`'s rows and width."""
    if mb.rows == tuple(range(int(value.shape[0]))) and mb.width == int(value.shape[1]):
        return value
    return value.index_select(0, torch.tensor(mb.rows, dtype=torch.long, device=value.device))[:, : mb.width]


def grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    """`t`'s gradient after a backward, zeros where none reached it."""
    return t.grad.detach() if t.grad is not None else torch.zeros_like(t).detach()
