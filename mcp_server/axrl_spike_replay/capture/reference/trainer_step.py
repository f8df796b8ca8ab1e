"""One reference-trainer step on one rank: rollout, advantages, gradients (via `training.rank_step`), update.

Each step a rank samples a group of responses per prompt from a bf16 copy of the policy (the
rollout engine, which also records logprobs and routes), scores them, computes advantages, takes
the fp32 old and reference logprobs, and computes its gradients with `training.rank_step` — the
same code a replay runs — then the DP mean and the global pre-clip grad norm. The loop in
`reference_trainer` puts the spike guard between the gradients and the update.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from axrl_spike_replay.capture.fault_injection.faults import Fault, StepParts, apply_faults, make_fault
from axrl_spike_replay.capture.reference.presets import Specialisation, get_preset
from axrl_spike_replay.capture.reference.rollout import generate, rollout_engine
from axrl_spike_replay.capture.reference.run_config import RunSpec
from axrl_spike_replay.capture.reference.toy_task import (
    baseline_advantages,
    broken_reward,
    echo_reward,
    grpo_advantages,
    make_prompts,
)
from axrl_spike_replay.capture.snapshot_writer import RankPayload
from axrl_spike_replay.models.policy import ModelSpec, build_policy, policy_forward
from axrl_spike_replay.models.tiny_moe import TinyMoEConfig, TinyMoEPolicy
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.loss_normalization import GRAD_INFO_KEY, GlobalCounts, all_reduce_counts
from axrl_spike_replay.training.policy_loss import local_counts
from axrl_spike_replay.training.rank_step import (
    global_grad_norm,
    param_grad_norms,
    rank_forward_backward,
    reduce_gradients,
)
from axrl_spike_replay.training.routing_replay import routing_control


@dataclass
class StepBatch:
    """One rank's batch for one step, exactly as the loss consumes it, plus its recorded routes."""

    batch: dict[str, torch.Tensor]
    routed_experts: torch.Tensor
    global_reward_mean: float
    loss: LossConfig | None = None  # the loss settings this step computes with (None: the run's)
    iteration: int = 0
    in_burst: bool = False
    # the rank's previous step (batch and routes), for a fault at the `stored` stage that writes it instead
    previous: dict[str, torch.Tensor] | None = None
    previous_routes: torch.Tensor | None = None


@dataclass
class StepGrads:
    """One rank's gradients for one step (already DP-reduced in the model's `.grad`)."""

    grad_norm: float  # global, pre-clip, after the DP mean
    local_param_norms: dict[str, float]  # this rank's own gradients before the reduction
    loss: float  # this rank's loss
    num_tokens: float  # this rank's loss tokens
    global_loss: float  # mean loss over ranks
    counts: GlobalCounts | None = None  # the step's global counts (normalization global)


def all_reduce_sum(values: list[float]) -> list[float]:
    """The values summed over the process group in float64 (unchanged in a single process)."""
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def vocab_size(spec: ModelSpec) -> int:
    """The policy's vocabulary size, whatever the model kind."""
    return int(spec.config["vocab_size"]) if not isinstance(spec, TinyMoEConfig) else spec.vocab_size


def _stream_seed(seed: int, iteration: int, rank: int) -> int:
    return (seed * 1_000_003 + iteration * 10_007 + rank * 101 + 17) % (2**63 - 1)


class RankTrainer:
    """One data-parallel rank's trainer state and the pieces of a step (the guard benchmark times them)."""

    def __init__(self, spec: RunSpec, rank: int, world_size: int) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.train = spec.train
        self.preset = get_preset(spec.train.preset)
        torch.manual_seed(spec.train.seed)
        self.model = build_policy(spec.model)
        if self.preset.specialise is not None:
            specialise_policy(self.model, self.preset.specialise)
        self.ref_model = self.copy_policy(self.model).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=spec.train.lr)
        self.param_numel = {name: p.numel() for name, p in self.model.named_parameters()}
        self.baseline: float | None = None
        # trainer bugs called at each stage of a step (`capture.fault_injection.faults`): the preset's, then any the
        # caller adds
        self.faults: list[Fault] = [make_fault(self.preset.injected)] if self.preset.injected else []
        self.previous: dict[str, torch.Tensor] | None = None  # the last step's batch (a stale-buffer fault reads it)
        self.previous_routes: torch.Tensor | None = None  # ... and its recorded routes

    def copy_policy(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy of the policy with its own routing hooks (a transformers policy is rebuilt, then loaded)."""
        if isinstance(model, TinyMoEPolicy):
            return copy.deepcopy(model)
        twin = build_policy(self.spec.model)
        twin.load_state_dict(model.state_dict())
        return twin

    def in_burst(self, iteration: int) -> bool:
        return iteration in self.train.burst

    def rollout_policy(self) -> torch.nn.Module:
        """The policy the rollout engine copies (FSDP: an unsharded copy)."""
        return self.model

    def model_state(self) -> dict[str, torch.Tensor]:
        """The weights a snapshot saves, as this rank holds them."""
        return self.model.state_dict()

    def final_state(self) -> dict[str, torch.Tensor]:
        """The whole weights at the end of a run (collective under FSDP)."""
        return self.model.state_dict()

    def rollout(self, iteration: int) -> StepBatch:
        """Generate, score and prepare this rank's batch for `iteration` (1-based); the faults act after each stage."""
        t = self.train
        burst = self.in_burst(iteration)
        generator = torch.Generator().manual_seed(_stream_seed(t.seed, iteration, self.rank))
        parts = StepParts(
            stage="prompts",
            iteration=iteration,
            rank=self.rank,
            world_size=self.world_size,
            in_burst=burst,
            prompt_len=t.prompt_len,
            batch={},
            previous=self.previous,
            generator=torch.Generator().manual_seed(_stream_seed(t.seed, iteration, self.rank) + 1),
            trainer=self,
            loss=self.spec.loss,
        )
        prompts = make_prompts(generator, t.prompts_per_rank, t.prompt_len, vocab_size(self.spec.model))
        parts.batch["prompts"] = prompts.repeat_interleave(t.group_size, dim=0)
        self._fault("prompts", parts)
        faults = self.preset.faults if burst else None
        ro = generate(
            rollout_engine(self.rollout_policy()),
            parts.batch.pop("prompts"),
            t.response_len,
            generator,
            temperature=t.temperature,
            faults=faults,
        )
        parts.batch.update(tokens=ro.tokens, loss_mask=ro.loss_mask, rollout_logprobs=ro.rollout_logprobs.float())
        parts.routed_experts = ro.routed_experts
        self._fault("rollout", parts)
        batch = parts.batch
        if burst and self.preset.reward_penalty is not None:
            batch["rewards"] = broken_reward(batch["tokens"], self.preset.reward_penalty)
        else:
            batch["rewards"] = echo_reward(batch["tokens"], t.prompt_len)
        self._fault("rewards", parts)
        rewards = batch["rewards"]
        reward_sum, count = all_reduce_sum([float(rewards.sum()), float(rewards.numel())])
        global_mean = reward_sum / count
        if t.advantage_estimator == "grpo":
            advantages = grpo_advantages(rewards, t.group_size, unbiased=self.spec.loss.convention == "verl")
        else:
            if self.baseline is None:
                self.baseline = global_mean
            advantages = baseline_advantages(rewards, self.baseline)
        batch["advantages"] = advantages.float()
        self._fault("advantages", parts)
        batch["rewards"] = batch["rewards"].float()
        batch["group_index"] = (
            torch.arange(t.prompts_per_rank).repeat_interleave(t.group_size) + self.rank * t.prompts_per_rank
        )
        routing = routing_control(self.spec.routing, batch, parts.routed_experts)
        with torch.no_grad():
            batch["old_logprobs"] = policy_forward(self.model, batch, routing, need_entropy=False).logprobs.float()
            batch["ref_logprobs"] = policy_forward(self.ref_model, batch, routing, need_entropy=False).logprobs.float()
        self._fault("batch", parts)
        routed_experts = parts.routed_experts
        assert routed_experts is not None, "a fault removed the recorded routes"
        order = ("tokens", "loss_mask", "advantages", "rollout_logprobs", "rewards", "group_index")
        batch = {**{k: parts.batch[k] for k in order if k in parts.batch}, **parts.batch}  # the saved field order
        previous, previous_routes = self.previous, self.previous_routes
        self.previous, self.previous_routes = dict(batch), routed_experts
        loss = parts.loss if parts.loss != self.spec.loss else None
        return StepBatch(
            batch=batch,
            routed_experts=routed_experts,
            global_reward_mean=global_mean,
            loss=loss,
            iteration=iteration,
            in_burst=burst,
            previous=previous,
            previous_routes=previous_routes,
        )

    def _fault(self, stage: str, parts: StepParts) -> None:
        if self.faults:
            parts.stage = stage
            apply_faults(self.faults, parts)

    def _late_fault(self, stage: str, step: StepBatch, batch: dict[str, torch.Tensor]) -> StepParts:
        """Call the faults of a stage after the rollout (`gradients`, `stored`) on `batch` (a copy of the step's)."""
        parts = StepParts(
            stage=stage,
            iteration=step.iteration,
            rank=self.rank,
            world_size=self.world_size,
            in_burst=step.in_burst,
            prompt_len=self.train.prompt_len,
            batch=batch,
            routed_experts=step.routed_experts,
            previous=step.previous,
            trainer=self,
            loss=step.loss or self.spec.loss,
        )
        if stage == "stored" and step.previous_routes is not None:
            parts.previous = {**(step.previous or {}), "_routed_experts": step.previous_routes}
        self._fault(stage, parts)
        return parts

    def gradients(self, step: StepBatch) -> StepGrads:
        """This rank's forward/backward, the DP mean of the gradients and the global pre-clip norm."""
        self.model.zero_grad(set_to_none=True)
        routing = routing_control(self.spec.routing, step.batch, step.routed_experts)
        counts = None
        loss_cfg = step.loss or self.spec.loss
        if loss_cfg.normalization == "global":  # every rank normalises by the step's counts
            counts = all_reduce_counts(*local_counts(step.batch, loss_cfg), self.world_size)
        out = rank_forward_backward(self.model, step.batch, loss_cfg, routing, counts=counts)
        self._late_fault("gradients", step, step.batch)  # a fault scales this rank's own gradients (unrecorded)
        local = param_grad_norms(self.model)
        reduce_gradients(self.model, self.world_size)
        grad_norm = global_grad_norm(self.model)
        loss = float(out.loss.detach())
        (loss_sum,) = all_reduce_sum([loss])
        return StepGrads(
            grad_norm=grad_norm,
            local_param_norms=local,
            loss=loss,
            num_tokens=float(out.metrics["loss_tokens"]),
            global_loss=loss_sum / self.world_size,
            counts=counts,
        )

    def update(self, grads: StepGrads, step: StepBatch) -> None:
        """Clip to `grad_clip` by the global norm, take the Adam step, move the reward baseline."""
        coef = self.train.grad_clip / (grads.grad_norm + 1e-6)
        if coef < 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        if self.baseline is not None:
            m = self.train.baseline_momentum
            self.baseline = m * self.baseline + (1 - m) * step.global_reward_mean

    def snapshot_payload(self, step: StepBatch, grads: StepGrads) -> RankPayload:
        """What this rank writes into a spike snapshot."""
        grad_info = {
            "grad_norm": grads.grad_norm,
            "param_grad_norms": grads.local_param_norms,
            "param_numel": self.param_numel,
            "loss": grads.loss,
            "num_tokens": grads.num_tokens,
        }
        if grads.counts is not None:  # what a replay, at any layout, normalises every rank by
            grad_info[GRAD_INFO_KEY] = grads.counts.to_doc()
        stored = self._late_fault("stored", step, dict(step.batch))  # a fault stores another batch (unrecorded)
        assert stored.routed_experts is not None
        routing_payload = {
            "routed_experts": stored.routed_experts.to(torch.int32),
            "moe_layers": list(self.spec.model.moe_layer_ids),  # absolute decoder layers (dense ones left out)
            "source": "rollout",
        }
        return RankPayload(batch=stored.batch, grad_info=grad_info, routing_payload=routing_payload)


def specialise_policy(model: torch.nn.Module, how: Specialisation) -> None:
    """Make a fresh policy expert-sensitive (from the seeded torch stream): routers redrawn with a large std,
    routed experts' weights and the output head scaled, so each token has a clear first choice of experts and
    forcing another expert changes what the model predicts by several nats."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "router.weight")):
                if how.router_std is not None:
                    p.normal_(0.0, how.router_std)
            elif ".experts." in name or name.endswith(("ffn.w_in", "ffn.w_out")):
                p.mul_(how.expert_scale)
            elif name in ("lm_head.weight", "head.weight"):
                p.mul_(how.logit_scale)
