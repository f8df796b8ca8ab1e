"""Fault injection for the reference trainer: a `Fault` corrupts one named part of a rank's step.

A step of the reference trainer (`trainer_step.RankTrainer.rollout`) passes through five stages, and after each
one every fault of the run is called with the step's parts as they stand (`StepParts`):

- `prompts`: `batch["prompts"]` [B, P] (already repeated per group): a data shard from another source;
- `rollout`: `tokens`, `loss_mask`, `rollout_logprobs` [B, T] and `routed_experts` [B, T, L, K]: the inference
  engine's log-probs or routes;
- `rewards`: `rewards` [B]: the reward function or verifier;
- `advantages`: `advantages` [B]: the advantage estimator;
- `batch`: everything, with the trainer's `old_logprobs` and `ref_logprobs`: the old / reference log-prob workers,
  the masks; and `parts.loss`, the loss settings the rank's step computes with (a setting that reached one rank).

A fault is any picklable callable with a `stage` (when it is called) and a `part` (what it corrupts, for the record);
it changes `parts.batch` (or `parts.routed_experts`) in place. It decides itself whether to act: `parts.in_burst`
says whether the iteration is one of the run's `train.burst` steps, `parts.rank` which data-parallel rank calls it.
The snapshot then holds the corrupted batch exactly as the loss consumed it, as a real trainer's would.

```python
from dataclasses import dataclass
from axrl_spike_replay.capture.fault_injection.faults import StepParts

@dataclass(frozen=True)
class HalfRewards:              # a verifier that halves every reward of rank 1 during the burst
    stage: str = "rewards"
    part: str = "rewards"

    def __call__(self, parts: StepParts) -> None:
        if parts.in_burst and parts.rank == 1:
            parts.batch["rewards"] = parts.batch["rewards"] / 2

capture_reference_run(out, world_size=2, preset="none", faults=[HalfRewards()], overrides={"train": {"burst": [20]}})
```

`FAULT_KINDS` are the built-in faults of the step's inputs (the presets use them); `fault_kinds()` adds those of
`unrecorded_faults` (a scale the run config does not record, a stored batch that is not the one trained on).
`FAULT_KINDS` are the built-in faults the presets use (`presets.FaultSpec` names one with its ranks, samples and
parameters); `make_fault` builds one. Every built-in fault is a bug a real RL stack has had: an off-by-one between a
tensor and the tokens it belongs to, a buffer reused from the previous step, a worker that answers out of order, a
verifier that returns another scale or NaN, a weight sync that stopped.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from axrl_spike_replay.capture.fault_injection.fault_base import STAGES, BuiltinFault, Fault, StepParts, apply_faults
from axrl_spike_replay.capture.fault_injection.fault_params import (
    BY,
    FRACTION,
    MAX_SCALE,
    MAX_SHIFT,
    SHIFT,
    SIGNAL,
    ParamRule,
    flag,
    layer_list,
    number,
    whole,
)
from axrl_spike_replay.capture.fault_injection.held_out_faults import HELD_OUT_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_iii_faults import HELD_OUT_III_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_iv_faults import HELD_OUT_IV_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_ix_faults import HELD_OUT_IX_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_v_faults import HELD_OUT_V_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_vi_faults import HELD_OUT_VI_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_vii_faults import HELD_OUT_VII_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_viii_faults import HELD_OUT_VIII_KINDS
from axrl_spike_replay.capture.fault_injection.held_out_x_faults import HELD_OUT_X_KINDS
from axrl_spike_replay.capture.fault_injection.unrecorded_faults import UNRECORDED_KINDS
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.rollout import shifted_routes
from axrl_spike_replay.capture.reference.toy_task import TASK_ALPHABET
from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.training.loss_config import LossConfig

__all__ = ["STAGES", "BuiltinFault", "Fault", "StepParts", "apply_faults", "fault_kinds", "make_fault"]


def _shift_right(values: torch.Tensor, shift: int, rows: list[int]) -> torch.Tensor:
    """`values` [B, T, ...] with `rows` moved `shift` positions later along T (the first positions repeat)."""
    out = values.clone()
    if shift <= 0:
        return out
    for r in rows:
        row = values[r]
        out[r, shift:] = row[:-shift]
        out[r, :shift] = row[:1]
    return out


class RolloutLogprobShift(BuiltinFault):
    """engine/trainer mismatch: the engine's log-probs are one position late (the engine counts a token the
    trainer's sequence lacks, e.g. a BOS), so each token is scored with its predecessor's log-prob."""

    stage = "rollout"
    part = "rollout_logprobs"

    PARAMS: ClassVar[dict[str, ParamRule]] = SHIFT

    def corrupt(self, parts: StepParts) -> None:
        lp = parts.batch["rollout_logprobs"]
        parts.batch["rollout_logprobs"] = _shift_right(lp, int(self.param("shift", 1)), self.rows(lp.shape[0]))


class RolloutStaleEngine(BuiltinFault):
    """engine/trainer mismatch: the engine's weight sync stopped after the first step; the rollout log-probs it
    reports are those of the initial weights (the reference copy, in bf16), not of the policy being trained."""

    stage = "rollout"
    part = "rollout_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.capture.reference.rollout import rollout_engine
        from axrl_spike_replay.models.tiny_moe import token_logprobs

        assert parts.trainer is not None
        engine = rollout_engine(parts.trainer.ref_model)
        with torch.no_grad():
            logits = engine(parts.batch["tokens"]).logits.float()
        stale = token_logprobs(logits, parts.batch["tokens"]).float()
        rows = self.rows(stale.shape[0])
        parts.batch["rollout_logprobs"][rows] = stale[rows]


class RoutesShift(BuiltinFault):
    """routing payload: this rank's recorded routes are `shift` tokens late (its engine worker counts a chat
    template token the trainer's sequence lacks)."""

    stage = "rollout"
    part = "routed_experts"

    PARAMS: ClassVar[dict[str, ParamRule]] = SHIFT

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None
        parts.routed_experts = shifted_routes(parts.routed_experts, int(self.param("shift", 1)))


class RoutesStaleLayer(BuiltinFault):
    """routing payload: this rank's routes of one MoE layer come from a stale expert-id table (every id off by
    one), as when an expert-parallel re-sharding is not applied to the recorded payload. `fraction` (default 1):
    the share of tokens whose routes pass through the stale table (the experts the re-sharding moved)."""

    stage = "rollout"
    part = "routed_experts"

    PARAMS: ClassVar[dict[str, ParamRule]] = {"layers": layer_list, **FRACTION}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None and parts.trainer is not None
        routes = parts.routed_experts.clone()
        n_experts = _n_experts(parts.trainer.model)
        layers = self.param("layers", None)
        fraction = float(self.param("fraction", 1.0))
        hit = torch.rand(routes.shape[:2], generator=parts.generator) < fraction if fraction < 1.0 else None
        for layer in range(routes.shape[2]) if layers is None else layers:
            stale = (routes[:, :, layer] + 1) % n_experts
            routes[:, :, layer] = stale if hit is None else torch.where(hit[..., None], stale, routes[:, :, layer])
        parts.routed_experts = routes


class RoutesPermuted(BuiltinFault):
    """routing payload: this rank's routes belong to other samples of its batch (the payload is gathered in
    another order than the sequences, as when an async gather returns micro-batches out of order)."""

    stage = "rollout"
    part = "routed_experts"

    PARAMS: ClassVar[dict[str, ParamRule]] = BY

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None
        parts.routed_experts = torch.roll(parts.routed_experts, shifts=int(self.param("by", 1)), dims=0).contiguous()


class RoutesDuplicate(BuiltinFault):
    """routing payload: on this rank a share of tokens list one expert twice among their top-k (an id remap that
    folds two experts onto one, or an engine top-k that lost its de-duplication), and the trainer replays them as
    recorded: that expert's output counts twice, with both gates. `fraction` (default 1): the share of tokens hit;
    `layers`: the MoE layer slots (default: every one)."""

    stage = "rollout"
    part = "routed_experts"

    PARAMS: ClassVar[dict[str, ParamRule]] = {"layers": layer_list, **FRACTION}

    def corrupt(self, parts: StepParts) -> None:
        assert parts.routed_experts is not None
        routes = parts.routed_experts.clone()
        if routes.shape[-1] < 2:
            return  # top-1 routing has no second slot to repeat
        fraction = float(self.param("fraction", 1.0))
        hit = torch.rand(routes.shape[:2], generator=parts.generator) < fraction
        layers = self.param("layers", None)
        for layer in range(routes.shape[2]) if layers is None else layers:
            first = routes[:, :, layer, 0]
            routes[:, :, layer, 1] = torch.where(hit & (first >= 0), first, routes[:, :, layer, 1])
        parts.routed_experts = routes


class OffPolicyResponses(BuiltinFault):
    """a hard (or foreign) batch: the responses are not the policy's own samples but tokens drawn uniformly from the
    task's alphabet (a replay buffer, a teacher, another data source), scored consistently: the engine's rollout
    log-probs are its own scores of those tokens, so every stored signal is right; the tokens are simply unlikely."""

    stage = "rollout"
    part = "tokens"

    PARAMS: ClassVar[dict[str, ParamRule]] = FRACTION

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.capture.reference.rollout import rollout_engine
        from axrl_spike_replay.models.tiny_moe import token_logprobs

        assert parts.trainer is not None
        tokens = parts.batch["tokens"].clone()
        rows = self.rows(tokens.shape[0])
        fraction = float(self.param("fraction", 1.0))
        span = tokens.shape[1] - parts.prompt_len
        drawn = torch.randint(0, TASK_ALPHABET, (len(rows), span), generator=parts.generator)
        keep = torch.rand((len(rows), span), generator=parts.generator) >= fraction
        resp = tokens[rows, parts.prompt_len :]
        tokens[rows, parts.prompt_len :] = torch.where(keep, resp, drawn)
        engine = rollout_engine(parts.trainer.model)
        with torch.no_grad():
            out = engine(tokens)
        parts.batch["tokens"] = tokens
        parts.batch["rollout_logprobs"] = token_logprobs(out.logits.float(), tokens).float()
        parts.routed_experts = out.routes.to(torch.int32)


class RewardScale(BuiltinFault):
    """outlier advantage (reward-scale bug): the verifier returns some samples' rewards on another scale (a
    percentage, not a fraction)."""

    stage = "rewards"
    part = "rewards"

    PARAMS: ClassVar[dict[str, ParamRule]] = {
        "factor": number(-MAX_SCALE, MAX_SCALE),
        "offset": number(-MAX_SCALE, MAX_SCALE),
    }

    def corrupt(self, parts: StepParts) -> None:
        rewards = parts.batch["rewards"].clone()
        rows = self.rows(rewards.shape[0])
        rewards[rows] = rewards[rows] * float(self.param("factor", 100.0)) + float(self.param("offset", 0.0))
        parts.batch["rewards"] = rewards


class RewardPenalty(BuiltinFault):
    """negative-advantage dominance: the reward function penalises every sample (a broken format check or a
    length limit set below every response), so every advantage against the running baseline is negative."""

    stage = "rewards"
    part = "rewards"

    PARAMS: ClassVar[dict[str, ParamRule]] = {"penalty": number(-MAX_SCALE, MAX_SCALE)}

    def corrupt(self, parts: StepParts) -> None:
        rewards = parts.batch["rewards"].clone()
        rows = self.rows(rewards.shape[0])
        rewards[rows] = rewards[rows] - float(self.param("penalty", 10.0))
        parts.batch["rewards"] = rewards


class RewardNaN(BuiltinFault):
    """non-finite values: the verifier times out on some samples and its client returns NaN as their reward."""

    stage = "rewards"
    part = "rewards"

    def corrupt(self, parts: StepParts) -> None:
        rewards = parts.batch["rewards"].clone()
        rewards[self.rows(rewards.shape[0])] = float("nan")
        parts.batch["rewards"] = rewards


class RolloutLogprobNegInf(BuiltinFault):
    """non-finite values: the engine reports -inf for a sampled token its own top-p filter had excluded (the
    sampler and the log-prob computation disagree on the filter)."""

    stage = "rollout"
    part = "rollout_logprobs"

    PARAMS: ClassVar[dict[str, ParamRule]] = {"position": whole(0, MAX_SHIFT)}

    def corrupt(self, parts: StepParts) -> None:
        lp = parts.batch["rollout_logprobs"].clone()
        position = parts.prompt_len + int(self.param("position", 2))
        for r in self.rows(lp.shape[0]):
            lp[r, min(position, lp.shape[1] - 1)] = float("-inf")
        parts.batch["rollout_logprobs"] = lp


class StoredLogprobFault(BuiltinFault):
    """A fault of a log-prob tensor the trainer stored (`part`: old_logprobs or ref_logprobs)."""

    part = "old_logprobs"

    PARAMS: ClassVar[dict[str, ParamRule]] = SIGNAL

    def corrupt(self, parts: StepParts) -> None:
        name = str(self.param("signal", self.part))
        values = parts.batch[name]
        parts.batch[name] = self.corrupted(parts, values, self.rows(values.shape[0]))

    def corrupted(self, parts: StepParts, values: torch.Tensor, rows: list[int]) -> torch.Tensor:
        raise NotImplementedError


class LogprobShift(StoredLogprobFault):
    """A stored log-prob tensor one position late on this rank (an off-by-one when the response is sliced out of
    the full sequence): old log-probs (`signal: old_logprobs`) or reference log-probs (`signal: ref_logprobs`)."""

    PARAMS: ClassVar[dict[str, ParamRule]] = {**SIGNAL, **SHIFT}

    def corrupted(self, parts: StepParts, values: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return _shift_right(values, int(self.param("shift", 1)), rows)


class LogprobStaleBuffer(StoredLogprobFault):
    """A stored log-prob tensor reused from the previous step on this rank (a buffer cached by micro-batch index
    and never refreshed), so it belongs to other sequences."""

    def corrupted(self, parts: StepParts, values: torch.Tensor, rows: list[int]) -> torch.Tensor:
        name = str(self.param("signal", self.part))
        if parts.previous is None or name not in parts.previous or parts.previous[name].shape != values.shape:
            return values
        out = values.clone()
        out[rows] = parts.previous[name][rows]
        return out


class LogprobScale(StoredLogprobFault):
    """A stored log-prob tensor multiplied by `factor` on this rank: 2 when its worker accumulates into a buffer it
    never zeroes (each log-prob counted twice), 0 when the buffer is never filled and stays at its zeros."""

    PARAMS: ClassVar[dict[str, ParamRule]] = {**SIGNAL, "factor": number(-MAX_SCALE, MAX_SCALE)}

    def corrupted(self, parts: StepParts, values: torch.Tensor, rows: list[int]) -> torch.Tensor:
        out = values.clone()
        out[rows] = values[rows] * float(self.param("factor", 2.0))
        return out


class LogprobPermuted(StoredLogprobFault):
    """A stored log-prob tensor whose rows belong to other samples of the rank's batch (the worker that computed
    them returned its micro-batches out of order)."""

    PARAMS: ClassVar[dict[str, ParamRule]] = {**SIGNAL, **BY}

    def corrupted(self, parts: StepParts, values: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return torch.roll(values, shifts=int(self.param("by", 1)), dims=0).contiguous()


class LogprobWrongModel(StoredLogprobFault):
    """A stored log-prob tensor computed by the wrong weights on this rank (its reference worker loaded a freshly
    initialised model: a checkpoint path that did not resolve, silently)."""

    PARAMS: ClassVar[dict[str, ParamRule]] = {**SIGNAL, "seed": whole(0, 2**63 - 1)}

    def corrupted(self, parts: StepParts, values: torch.Tensor, rows: list[int]) -> torch.Tensor:
        from axrl_spike_replay.models.policy import build_policy, policy_forward
        from axrl_spike_replay.training.routing_replay import routing_control

        assert parts.trainer is not None and parts.routed_experts is not None
        state = torch.random.get_rng_state()
        try:
            torch.manual_seed(int(self.param("seed", 12345)))
            wrong = build_policy(parts.trainer.spec.model)
        finally:
            torch.random.set_rng_state(state)
        routing = routing_control(parts.trainer.spec.routing, parts.batch, parts.routed_experts)
        with torch.no_grad():
            fresh = policy_forward(wrong, parts.batch, routing, need_entropy=False).logprobs.float()
        out = values.clone()
        out[rows] = fresh[rows]
        return out


class RefOwnRouting(BuiltinFault):
    """A reference worker that does not replay the recorded routes (routing replay wired into the actor only): its
    log-probs are the reference model's under its own routing. Harmless while the recorded routes are the model's
    own; beside a corrupt routing payload, the policy (replaying it) and its reference route differently, and the
    KL term carries the difference."""

    stage = "batch"
    part = "ref_logprobs"

    def corrupt(self, parts: StepParts) -> None:
        from axrl_spike_replay.models.policy import policy_forward
        from axrl_spike_replay.models.tiny_moe import RoutingControl

        assert parts.trainer is not None
        with torch.no_grad():
            own = policy_forward(parts.trainer.ref_model, parts.batch, RoutingControl(), need_entropy=False)
        rows = self.rows(own.logprobs.shape[0])
        parts.batch["ref_logprobs"][rows] = own.logprobs.float()[rows]


class LossSetting(BuiltinFault):
    """a loss setting that reached some ranks only: during the burst this rank's step computes its loss with other
    settings than the run's (`params`: {setting: value}, e.g. {aux_loss_coef: 10.24}): a config override read from
    one node's environment, a rank-dependent branch in the trainer. The snapshot records the run's settings, so the
    step does not reproduce; a hypothesis replay (`aux_loss_coef=10.24@1`) does."""

    stage = "batch"
    part = "loss"

    @classmethod
    def check_spec(cls, spec: FaultSpec) -> None:
        """Its params are loss settings: `LossConfig` field names, each value checked as the run config's is."""
        known = {f.name for f in dataclasses.fields(LossConfig)} - {"extra"}
        unknown = sorted(set(spec.params) - known, key=str)
        if unknown:
            raise ConfigError(f"fault loss_setting: {shown(unknown, 80)} are no loss settings (known: {sorted(known)})")
        if not spec.params:
            raise ConfigError("fault loss_setting: `params` names no loss setting (e.g. {aux_loss_coef: 10.24})")
        try:
            LossConfig(**spec.params)
        except (ConfigError, TypeError, ValueError) as err:
            raise ConfigError(f"fault loss_setting: {err}") from None

    def corrupt(self, parts: StepParts) -> None:
        if parts.loss is None:
            return
        parts.loss = dataclasses.replace(parts.loss, **self.spec.params)


class MaskShift(BuiltinFault):
    """truncated / misaligned masks: the stack keeps log-probs for the response only (zero elsewhere, as when the
    response is sliced out and padded back), and during the burst this rank's loss mask starts `shift` positions
    early: it covers the last prompt tokens, whose stored log-probs are the zero padding."""

    stage = "batch"
    part = "loss_mask"

    PARAMS: ClassVar[dict[str, ParamRule]] = {**SHIFT, "truncate": flag}

    def __call__(self, parts: StepParts) -> None:
        response = parts.response()
        for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
            if name in parts.batch:
                parts.batch[name] = torch.where(response, parts.batch[name], torch.zeros_like(parts.batch[name]))
        super().__call__(parts)

    def corrupt(self, parts: StepParts) -> None:
        mask = parts.batch["loss_mask"].clone()
        shift = int(self.param("shift", 1))
        for r in self.rows(mask.shape[0]):
            row = mask[r].clone()
            mask[r, :-shift] = row[shift:]
            if not self.param("truncate", False):
                mask[r, -shift:] = row[-shift:]
        parts.batch["loss_mask"] = mask


FAULT_KINDS: dict[str, type[BuiltinFault]] = {
    "rollout_logprob_shift": RolloutLogprobShift,
    "rollout_stale_engine": RolloutStaleEngine,
    "rollout_logprob_neg_inf": RolloutLogprobNegInf,
    "routes_shift": RoutesShift,
    "routes_stale_layer": RoutesStaleLayer,
    "routes_permuted": RoutesPermuted,
    "routes_duplicate": RoutesDuplicate,
    "off_policy_responses": OffPolicyResponses,
    "reward_scale": RewardScale,
    "reward_penalty": RewardPenalty,
    "reward_nan": RewardNaN,
    "logprob_shift": LogprobShift,
    "logprob_stale_buffer": LogprobStaleBuffer,
    "logprob_scale": LogprobScale,
    "logprob_permuted": LogprobPermuted,
    "logprob_wrong_model": LogprobWrongModel,
    "mask_shift": MaskShift,
    "ref_own_routing": RefOwnRouting,
    "loss_setting": LossSetting,
}


def fault_kinds() -> dict[str, type[BuiltinFault]]:
    """Every built-in fault kind: this module's (the step's inputs) and `unrecorded_faults`' (what the trainer does
    that its run config does not record: its gradients, the batch it stores) and `held_out_faults`' (a second
    held-out set), `held_out_iii_faults`' (a third), `held_out_iv_faults`' (a fourth), `held_out_v_faults`' (a
    fifth), `held_out_vi_faults`' (a sixth), `held_out_vii_faults`' (a seventh), `held_out_viii_faults`' (an
    eighth), `held_out_ix_faults`' (a ninth) and `held_out_x_faults`' (a tenth)."""
    return {
        **FAULT_KINDS,
        **UNRECORDED_KINDS,
        **HELD_OUT_KINDS,
        **HELD_OUT_III_KINDS,
        **HELD_OUT_IV_KINDS,
        **HELD_OUT_V_KINDS,
        **HELD_OUT_VI_KINDS,
        **HELD_OUT_VII_KINDS,
        **HELD_OUT_VIII_KINDS,
        **HELD_OUT_IX_KINDS,
        **HELD_OUT_X_KINDS,
    }


def make_fault(spec: FaultSpec) -> BuiltinFault:
    """The built-in fault `spec` names, its parameters checked (names, types, ranges) before any step runs;
    ConfigError listing the known kinds, or naming the parameter and what is wrong, otherwise."""
    kinds = fault_kinds()
    try:
        kind = kinds[spec.kind]
    except KeyError:
        raise ConfigError(f"fault kind {shown(spec.kind, 80)} is not known (known: {', '.join(kinds)})") from None
    kind.check_spec(spec)
    return kind(spec)


def _n_experts(model: torch.nn.Module) -> int:
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "n_experts"):
        return int(cfg.n_experts)
    return int(getattr(model, "n_experts"))  # noqa: B009
