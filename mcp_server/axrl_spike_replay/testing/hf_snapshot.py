"""Spike snapshots of tiny transformers MoE policies (the six architectures at hidden 64, 8 experts, top-2,
vocab 1024), recorded with the trainer's own rank step: for tests, benchmarks and examples.

As tests/replay/tiny_snapshot.py does for tiny_moe: one process builds the seeded policy, makes each rank's
batch (left-padded prompts with an attention mask, bf16 rollout routes recorded, a few samples with a
rollout-logprob mismatch: the burst), runs `rank_forward_backward` per rank, sums and divides the
gradients as `reduce_gradients` does, and writes the snapshot (DCP weights + rank files) with `write_snapshot`.
Needs the `hf` extra (transformers).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from axrl_spike_replay.capture.snapshot_writer import RankPayload, write_snapshot
from axrl_spike_replay.models.architectures import ARCHITECTURES
from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.policy import build_policy, parse_model_config, policy_forward
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.snapshot.metadata import AxrlMetadata, DetectorSpec, ParallelLayout
from axrl_spike_replay.training.policy_loss import LossConfig
from axrl_spike_replay.training.rank_step import (
    global_grad_norm,
    param_grad_norms,
    rank_forward_backward,
    reduce_gradients,
)
from axrl_spike_replay.training.routing_replay import RoutingConfig, routing_control


def tiny_config(architecture: str) -> dict[str, Any]:
    """The HF config dict of a tiny `architecture` model (as the reference trainer captures it)."""
    config = ARCHITECTURES[architecture].tiny_config()
    config.pop("model_type")
    return config


def model_section(architecture: str, **overrides: Any) -> dict[str, Any]:
    """A run config `model:` section (kind hf) for the tiny architecture."""
    return {
        "kind": "hf",
        "architecture": architecture,
        "config": tiny_config(architecture),
        "dtype": "float32",
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        **overrides,
    }


LOSS: dict[str, Any] = {"kl_coef": 0.01, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "is_base_logprobs": "rollout"}
SPIKE_RATIO = 8.0
BURST = ((0, 1), (1, 2))  # (rank, sample) pairs whose rollout logprobs are wrong
BATCH, PROMPT, RESPONSE = 4, 8, 32


def run_config(spec: HFModelConfig, world_size: int) -> dict[str, Any]:
    return {
        "model": spec.to_dict(),
        "loss": dict(LOSS),
        "routing": RoutingConfig(replay="all").to_dict(),
        "parallel": {"world_size": world_size, "tp": 1, "pp": 1, "dp": world_size, "ep": 1, "etp": 1, "cp": 1},
        "train": {"seed": 0, "preset": "hf-tiny"},
        "detector": {"kind": "median_ratio", "window": 10, "threshold": 5.0, "warmup": 4},
    }


def seeded_policy(
    architecture: str, seed: int = 0, config: dict[str, Any] | None = None
) -> tuple[HFModelConfig, torch.nn.Module]:
    """The tiny architecture's policy (or one of HF `config`), seeded, with sharp routers (so a wrong expert
    changes the output)."""
    section = model_section(architecture) if config is None else model_section(architecture, config=dict(config))
    spec = parse_model_config(section)
    assert isinstance(spec, HFModelConfig)
    torch.manual_seed(seed)
    model = build_policy(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.normal_(0.0, 1.0)
    return spec, model


def make_batch(
    spec: HFModelConfig, model: torch.nn.Module, rank: int, seed: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rank `rank`'s batch (left-padded prompts) and its routes recorded by a bf16 rollout engine."""
    gen = torch.Generator().manual_seed(1000 + 17 * rank + seed)
    b, t = BATCH, PROMPT + RESPONSE
    vocab = int(spec.config["vocab_size"])
    tokens = torch.randint(3, vocab, (b, t), generator=gen)
    attention = torch.ones(b, t, dtype=torch.long)
    attention[1, :3] = 0  # left padding of a shorter prompt
    tokens[1, :3] = 0
    mask = torch.zeros(b, t)
    mask[:, PROMPT:] = 1.0
    mask[0, -4:] = 0.0  # one shorter response
    engine = build_policy(dataclasses.replace(spec, dtype="bfloat16"))
    engine.load_state_dict(model.state_dict())
    batch = {"tokens": tokens, "loss_mask": mask, "attention_mask": attention}
    with torch.no_grad():
        rollout_out = policy_forward(engine, batch, RoutingControl(), need_entropy=False)
        routes = rollout_out.routes
        old = policy_forward(model, batch, RoutingControl(routes=routes.long()), need_entropy=False).logprobs
    rollout = rollout_out.logprobs.float()
    rewards = torch.rand(b, generator=gen)
    advantages = rewards - rewards.mean()
    for burst_rank, sample in BURST:
        if burst_rank == rank:
            rollout[sample] = rollout[sample] - 3.0 * mask[sample]
            advantages[sample] = -2.0
    batch.update(
        advantages=advantages,
        old_logprobs=old,
        ref_logprobs=old - 0.05 * torch.rand(b, t, generator=gen),
        rollout_logprobs=rollout,
        rewards=rewards,
        group_index=torch.arange(b) // 2 + rank * (b // 2),
    )
    return batch, routes.to(torch.int32)


def record_hf_snapshot(
    root: Path,
    architecture: str = "qwen3_moe",
    world_size: int = 2,
    seed: int = 0,
    config: dict[str, Any] | None = None,
) -> Path:
    """Record a spike snapshot of the tiny `architecture` (or of HF `config`, for benchmarks at real sizes) under
    `root`; its `iter_*` dir.

    The policy pins deterministic algorithms while it records; the process gets its own setting back."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    spec, model = seeded_policy(architecture, seed, config)
    state = {k: v.detach() for k, v in model.state_dict().items()}  # nothing below steps the weights
    cfg = run_config(spec, world_size)
    loss_cfg = LossConfig.from_dict(cfg["loss"])
    payloads, local_norms, losses = {}, {}, {}
    totals: list[torch.Tensor] | None = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rank in range(world_size):
            batch, routes = make_batch(spec, model, rank, seed)
            model.zero_grad(set_to_none=True)
            routing = routing_control(RoutingConfig.from_dict(cfg["routing"]), batch, routes)
            out = rank_forward_backward(model, batch, loss_cfg, routing)
            local_norms[rank] = param_grad_norms(model)
            losses[rank] = float(out.loss.detach())
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            # summed in rank order as they come (one sum held, not every rank's gradient: real sizes fit the host)
            totals = grads if totals is None else [t.add_(g) for t, g in zip(totals, grads, strict=True)]
            payloads[rank] = (batch, routes)
        assert totals is not None  # world_size >= 1
        for p, total in zip(model.parameters(), totals, strict=True):
            p.grad = total
        reduce_gradients(model, world_size)
        grad_norm = global_grad_norm(model)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    meta = AxrlMetadata(
        job_name=f"hf-{architecture}",
        role="actor",
        iteration=7,
        grad_norm=grad_norm,
        median_norm=grad_norm / SPIKE_RATIO,
        spike_ratio=SPIKE_RATIO,
        detector=DetectorSpec(kind="median_ratio", window=10, threshold=5.0),
        parallel=ParallelLayout(world_size=world_size, dp=world_size),
    )
    moe_layers = list(spec.moe_layer_ids)
    ranks = {
        rank: RankPayload(
            batch=batch,
            grad_info={"grad_norm": grad_norm, "param_grad_norms": local_norms[rank], "loss": losses[rank]},
            routing_payload={"routed_experts": routes, "moe_layers": moe_layers, "source": "rollout"},
        )
        for rank, (batch, routes) in payloads.items()
    }
    return write_snapshot(root, meta, cfg, state, ranks)


def save_dcp(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """A DCP checkpoint of `state` under `model.`, as the snapshot writer saves model weights."""
    from axrl_spike_replay.capture.checkpoint_writer import save_model_checkpoint

    save_model_checkpoint({f"model.{k}": v.detach().cpu() for k, v in state.items()}, directory)
