"""An eighth set of held-out trainer bugs: kinds no preset and no `held_out`, `unseen`, `held_out_ii`, `held_out_iii`,
`held_out_iv`, `held_out_v`, `held_out_vi` or `held_out_vii` case uses, written and committed before any diagnosis
was run on them.

Each is a bug real RL stacks have had, planted on chosen ranks during the burst, with nothing of it in the run
config or the log (`capture_reference_run(hide_fault=True)`). Six are in the data the rank's step consumes (the
snapshot stores it as consumed), two in what the trainer does with it (`gradients` stage: the snapshot stores the
batch and weights the step should have used):

- `old_logprobs_packed_across_sequences`: the old-log-prob pass packs `pack` of the rank's sequences into one row
  and runs a plain causal forward over it (no per-sequence attention mask, positions counted from the pack's
  start), as a packed forward without its sequence boundaries does: each sequence after the first of its pack is
  scored with the sequences before it in its context;
- `old_logprobs_from_neighbour_rank`: the old log-probs are all-gathered over the data-parallel ranks and read back
  one rank on (an index counted from 1): the hit rank's old log-probs are the next rank's, of other sequences;
- `rollout_logprobs_cumulative`: the engine client reads the running log-prob of the sequence after each token (a
  cumulative log-prob, as engines report one per step) as the token's own log-prob;
- `routes_from_neighbour_rank`: the routing payload's all-gather over the data-parallel ranks is read one rank on:
  the hit rank replays the next rank's payload, the routes of other tokens;
- `loss_mask_attention_plus_response`: one rank builds its loss mask as the attention mask plus the response mask
  (`+` where a product was meant): 2 on each response token, 1 on the prompt's (a mask that fails a 0/1 check);
- `advantage_groups_split_at_rank_boundary`: the rank normalises GRPO groups as its shard holds them after a
  dispatch that does not keep groups whole (its first sample the tail of a group, its last group short), with
  `torch.std`'s default (Bessel's) correction: a group of one sample has the std NaN;
- `loss_old_logprobs_next_micro_batch`: one rank's loss reads the old log-probs through a buffer offset that is not
  reset per micro-batch: each sequence's ratio is taken against the old log-probs of a sequence one micro-batch on,
  while its snapshot stores the batch in order;
- `replay_gates_uniform`: one rank's routing replay forwards the recorded expert ids but not the router's weights:
  the replayed experts are mixed with equal gates (the router scores taken as equal) in its training forward.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from axrl_spike_replay.capture.fault_injection.fault_base import BuiltinFault, StepParts
from axrl_spike_replay.capture.fault_injection.fault_params import ParamRule, whole


def _aligned_logprobs(
    parts: StepParts, model: torch.nn.Module, batch: dict[str, torch.Tensor], routes: torch.Tensor
) -> torch.Tensor:
    """[B, T] fp32 log-probs of `batch["tokens"]` under `model` (no gradients), routed as the rank's trainer routes
    with the payload `routes` (position 0, which nothing predicts: 0)."""
    from axrl_spike_replay.models.hf_policy import HFPolicy
    from axrl_spike_replay.training.routing_replay import routing_control

    assert parts.trainer is not None
    tokens = batch["tokens"]
    routing = routing_control(parts.trainer.spec.routing, batch, routes)
    with torch.no_grad():
        out = model(tokens, routing, attention_mask=None) if isinstance(model, HFPolicy) else model(tokens, routing)
    logp = out.logits.float()[:, :-1].log_softmax(dim=-1).gather(-1, tokens[:, 1:, None].long()).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def _max_len(model: torch.nn.Module) -> int:
    """The longest sequence `model` takes (its position table)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "max_seq_len"):
        return int(cfg.max_seq_len)
    causal_lm = getattr(model, "causal_lm", None)
    return int(getattr(getattr(causal_lm, "config", None), "max_position_embeddings", 1 << 20))


def _write_response(parts: StepParts, name: str, wrong: torch.Tensor, fault: BuiltinFault) -> None:
    """`parts.batch[name]`'s hit rows replaced by `wrong`'s on the response positions."""
    values = parts.batch[name]
    fault.replace_rows(parts, name, torch.where(parts.response(), wrong.to(values.dtype), values))


def packed(values: torch.Tensor, pack: int) -> torch.Tensor:
    """[B, T, ...] as [B / pack, pack * T, ...]: each `pack` consecutive rows laid end to end in one row."""
    return values.reshape(values.shape[0] // pack, pack * values.shape[1], *values.shape[2:])


class OldLogprobsPackedAcrossSequences(BuiltinFault):
    """Stored old log-probs from a packed forward with no sequence boundaries: `pack` (default 2) consecutive
    sequences laid end to end in one row under plain causal attention, positions counted from the row's start."""

    stage = "batch"
    part = "old_logprobs"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"pack": whole(2, 64)}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None and parts.routed_experts is not None
        model = parts.trainer.model
        rows, length = parts.batch["tokens"].shape
        pack = min(int(self.param("pack", 2)), max(1, _max_len(model) // length))
        while rows % pack:
            pack -= 1
        if pack < 2:
            return
        batch = {name: packed(parts.batch[name], pack) for name in ("tokens", "loss_mask")}
        logp = _aligned_logprobs(parts, model, batch, packed(parts.routed_experts, pack))
        _write_response(parts, "old_logprobs", logp.reshape(rows, length), self)


class RolloutLogprobsCumulative(BuiltinFault):
    """Engine log-probs that are the running sum of the response's log-probs up to each token (the sequence's
    cumulative log-prob after the token), read as the token's own."""

    stage = "rollout"
    part = "rollout_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        values = parts.batch["rollout_logprobs"].float()
        running = torch.where(parts.response(), values, torch.zeros_like(values)).cumsum(dim=-1)
        _write_response(parts, "rollout_logprobs", running, self)


def all_gather(value: torch.Tensor) -> list[torch.Tensor]:
    """`value` of every rank of the process group, in rank order (`[value]` in a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value.contiguous())
    return gathered


def neighbour(gathered: list[torch.Tensor], rank: int) -> torch.Tensor:
    """The entry of the rank after `rank` (after the last rank: the first's), as an index counted from 1 reads it."""
    return gathered[(rank + 1) % len(gathered)]


class RoutesFromNeighbourRank(BuiltinFault):
    """A routing payload all-gathered over the data-parallel ranks and read one rank on: the hit rank's routes are
    the next rank's. Every rank joins the all-gather during the burst; the hit ranks take the wrong entry."""

    stage = "rollout"
    part = "routed_experts"

    def __call__(self, parts: StepParts) -> None:
        if not parts.in_burst or parts.routed_experts is None:
            return
        gathered = all_gather(parts.routed_experts)  # a collective: every rank calls it
        if self.hits(parts.rank, parts.world_size):
            out = parts.routed_experts.clone()
            rows = self.rows(out.shape[0])
            out[rows] = neighbour(gathered, parts.rank)[rows].to(out.dtype)
            parts.routed_experts = out


class OldLogprobsFromNeighbourRank(BuiltinFault):
    """Stored old log-probs all-gathered over the data-parallel ranks (to be logged or balanced) and read back one
    rank on: the hit rank's old log-probs are the next rank's, of other sequences. Every rank joins the all-gather
    during the burst; the hit ranks take the wrong entry."""

    stage = "batch"
    part = "old_logprobs"

    def __call__(self, parts: StepParts) -> None:
        if not parts.in_burst:
            return
        gathered = all_gather(parts.batch["old_logprobs"])  # a collective: every rank calls it
        if self.hits(parts.rank, parts.world_size):
            _write_response(parts, "old_logprobs", neighbour(gathered, parts.rank), self)


class LossMaskAttentionPlusResponse(BuiltinFault):
    """A loss mask that is the attention mask plus the response mask: 2 on the response, 1 on the prompt (position
    0, which nothing predicts and the shifted loss never reads, keeps its value)."""

    stage = "batch"
    part = "loss_mask"

    def corrupt(self, parts: StepParts) -> None:
        mask = parts.batch["loss_mask"].float()
        summed = torch.ones_like(mask) + (parts.response() & (mask > 0)).float()
        summed[:, 0] = mask[:, 0]
        self.replace_rows(parts, "loss_mask", summed)


def split_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B] GRPO advantages of `rewards` normalised by the groups a dispatch that splits groups at the rank boundary
    leaves on the rank (its first sample a lone tail of a group, then whole groups, its last group one short), each
    with `torch.std`'s default correction (a lone sample's std: NaN) and the run's epsilon."""
    values = rewards.float()
    ids = (torch.arange(values.shape[0]) + group_size - 1) // group_size
    out = torch.empty_like(values)
    for group in ids.unique():
        where = ids == group
        member = values[where]
        centred = member - member.mean()
        std = (centred.pow(2).sum() / (member.numel() - 1)).sqrt()  # torch.std's default: 0 / 0 for one sample
        out[where] = centred / (std + 1e-6)
    return out


class AdvantageGroupsSplitAtRankBoundary(BuiltinFault):
    """GRPO advantages normalised over the groups as a dispatch that splits them at the rank boundary leaves them
    (`split_groups`): a group of one sample gets NaN."""

    stage = "advantages"
    part = "advantages"

    def corrupt(self, parts: StepParts) -> None:
        assert parts.trainer is not None
        self.replace_rows(
            parts, "advantages", split_groups(parts.batch["rewards"], int(parts.trainer.train.group_size))
        )


class LossOldLogprobsNextMicroBatch(BuiltinFault):
    """A rank whose loss reads the old log-probs through a buffer offset that is not reset per micro-batch: each
    sequence's ratio is taken against the old log-probs of the sequence `by` rows on (default 4, one micro-batch of
    a half batch). Its gradients are those of that loss; its snapshot stores the batch in order."""

    stage = "gradients"
    part = "gradients"
    PARAMS: ClassVar[dict[str, ParamRule]] = {"by": whole(1, 4096)}

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.training.rank_step import rank_forward_backward

        assert parts.trainer is not None and parts.loss is not None
        batch = dict(parts.batch)
        old = batch["old_logprobs"]
        moved = torch.roll(old, shifts=-int(self.param("by", 4)), dims=0)
        rows = self.rows(old.shape[0])
        wrong = old.clone()
        wrong[rows] = moved[rows]
        batch["old_logprobs"] = wrong
        model = parts.trainer.model
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            rank_forward_backward(model, batch, parts.loss, parts.routing())


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers of `model` (tiny_moe's `ffn.router`, a transformers MoE block's `mlp.gate`)."""
    return [m for name, m in model.named_modules() if name.endswith((".router", "mlp.gate"))]


def equal_scores(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """A router's forward hook: every expert's score 0 (equal scores, so equal gates over the chosen experts)."""
    return torch.zeros_like(output)


class ReplayGatesUniform(BuiltinFault):
    """A rank whose routing replay forwards the recorded expert ids but not the router's weights: every router's
    scores are taken as equal, so the replayed experts are mixed with uniform gates (and the routers get no
    gradient). Its snapshot stores the payload and the weights the step should have used."""

    stage = "gradients"
    part = "gradients"

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.training.rank_step import rank_forward_backward

        assert parts.trainer is not None and parts.loss is not None
        model = parts.trainer.model
        hooks = [r.register_forward_hook(equal_scores) for r in router_modules(model)]
        try:
            model.zero_grad(set_to_none=True)
            with torch.enable_grad():
                rank_forward_backward(model, parts.batch, parts.loss, parts.routing())
        finally:
            for hook in hooks:
                hook.remove()


HELD_OUT_VIII_KINDS: dict[str, type[BuiltinFault]] = {
    "old_logprobs_packed_across_sequences": OldLogprobsPackedAcrossSequences,
    "old_logprobs_from_neighbour_rank": OldLogprobsFromNeighbourRank,
    "rollout_logprobs_cumulative": RolloutLogprobsCumulative,
    "routes_from_neighbour_rank": RoutesFromNeighbourRank,
    "loss_mask_attention_plus_response": LossMaskAttentionPlusResponse,
    "advantage_groups_split_at_rank_boundary": AdvantageGroupsSplitAtRankBoundary,
    "replay_gates_uniform": ReplayGatesUniform,
    "loss_old_logprobs_next_micro_batch": LossOldLogprobsNextMicroBatch,
}
