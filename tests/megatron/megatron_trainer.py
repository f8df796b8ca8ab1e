"""A small RL training loop on megatron-core's own model with the Megatron spike guard (integrations.megatron).

Each of `world` gloo processes holds its shard of the GPTModel (EP=2: four of the eight experts each), wrapped in
Megatron's DistributedDataParallel; the weights start from a checkpoint `dist_checkpointing.load` reshards. Every
step each data-parallel rank forwards its own batch, takes the GRPO loss of `training.policy_loss`, backpropagates,
lets Megatron's DDP average the gradients, measures the global pre-clip norm as Megatron's optimizer does (the
dense parameters once, the experts summed over the expert-parallel group) and asks the guard. At `burst_step` two
samples carry rollout log-probs far below the policy's with negative advantages: the spike the guard must catch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
LOSS: dict[str, Any] = {"kl_coef": 0.01, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "is_base_logprobs": "rollout"}
BATCH, PROMPT, RESPONSE = 4, 8, 24


def load_hook() -> Any:
    """The hook's module, imported from the installed package as a trainer imports it."""
    import axrl_spike_replay.integrations.megatron as hook

    return hook


def make_batch(model: Any, trace: Any, dp_rank: int, step: int, burst: bool) -> dict[str, torch.Tensor]:
    """Data-parallel rank `dp_rank`'s batch of `step`; with `burst`, two samples' rollout log-probs are far off."""
    from axrl_spike_replay.models.mcore.megatron_policy import force_routes, megatron_logprobs

    gen = torch.Generator().manual_seed(100 * step + dp_rank)
    b, t = BATCH, PROMPT + RESPONSE
    tokens = torch.randint(3, 1024, (b, t), generator=gen)
    attention = torch.ones(b, t, dtype=torch.long)  # packed, unpadded rows, as Megatron RL trainers feed them
    mask = torch.zeros(b, t)
    mask[:, PROMPT:] = 1.0
    mask[0, -4:] = 0.0
    batch = {"tokens": tokens, "loss_mask": mask, "attention_mask": attention}
    force_routes(model, None)
    with torch.no_grad():
        old = megatron_logprobs(model, trace, batch).logprobs
    rewards = torch.rand(b, generator=gen)
    advantages = rewards - rewards.mean()
    rollout = old - 0.02 * torch.rand(b, t, generator=gen) * mask
    if burst:
        for sample in (1, 2):
            rollout[sample] = rollout[sample] - 3.0 * mask[sample]
            advantages[sample] = -2.0
    batch.update(
        advantages=advantages,
        old_logprobs=old,
        ref_logprobs=old - 0.05 * torch.rand(b, t, generator=gen),
        rollout_logprobs=rollout,
    )
    return batch


def grad_norm(params: list[torch.nn.Parameter]) -> float:
    """The global pre-clip norm as Megatron's optimizer takes it: dense parameters (identical on every rank after
    the data-parallel mean) once, each expert on the rank that holds it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dense = sum(float(p.main_grad.double().pow(2).sum()) for p in params if getattr(p, "allreduce", True))
    experts = torch.tensor(
        [sum(float(p.main_grad.double().pow(2).sum()) for p in params if not getattr(p, "allreduce", True))],
        dtype=torch.float64,
    )
    dist.all_reduce(experts, group=ps.get_expert_model_parallel_group())
    return math.sqrt(dense + float(experts))


def train(rank: int, world: int, payload: tuple[dict[str, Any], str, str, int, int, int, str]) -> None:
    """Train `steps` steps from `checkpoint` at EP=`ep` with the spike guard; snapshots land under `root`."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from axrl_spike_replay.capture.detectors import MedianRatioDetector
    from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.mcore.megatron_gpt import MegatronParallel, build_gpt_model, init_parallel
    from axrl_spike_replay.models.mcore.megatron_policy import force_routes, install_trace, megatron_logprobs
    from axrl_spike_replay.training.policy_loss import LossConfig, policy_loss

    section, checkpoint, root, steps, burst_step, ep, job = payload
    hook = load_hook()
    loss_cfg = LossConfig.from_dict(LOSS)
    with megatron_on_cpu():
        parallel = MegatronParallel(ep=ep)
        init_parallel(parallel)
        gpt = build_gpt_model(MegatronModelConfig.from_dict(section), parallel)
        gpt.load_state_dict(dist_checkpointing.load(gpt.sharded_state_dict(), checkpoint), strict=False)
        model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
        trace = install_trace(gpt)
        params = [p for p in gpt.parameters() if p.requires_grad]
        guard = hook.MegatronSpikeGuard(
            root,
            model_section=section,
            loss_section=LOSS,
            job_name=job,
            detector=MedianRatioDetector(window=4, threshold=5.0, warmup=3),
        )
        dp_rank = ps.get_data_parallel_rank()
        for step in range(1, steps + 1):
            batch = make_batch(gpt, trace, dp_rank, step, burst=step == burst_step)
            model.zero_grad_buffer()
            guard.begin_step(model)
            force_routes(gpt, None)
            out = megatron_logprobs(gpt, trace, batch)
            result = policy_loss(out.logprobs, batch, loss_cfg, aux_loss=out.aux_loss, z_loss=out.z_loss)
            result.loss.backward()
            model.finish_grad_sync()
            norm = grad_norm(params)
            tokens = result.metrics["loss_tokens"]
            if guard.step(step, model, norm, batch, loss=result.loss, num_tokens=tokens):
                with torch.no_grad():
                    for p in params:
                        p.add_(p.main_grad, alpha=-1e-3)
