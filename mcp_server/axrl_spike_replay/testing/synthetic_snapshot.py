"""Synthetic spike snapshots with known contents, for tests, benchmarks and examples of other stacks' field names.

Every snapshot is written by the real writer (`capture.snapshot_writer.write_snapshot`). The batch
has planted outliers at fixed places so readers can be checked exactly:
- the largest |log-ratio| (old - rollout = +3.0) is on rank `world_size - 1`, sample 2, position 9;
- the largest |advantage| (-4.0) is on rank 0, sample 1.
`naming` saves the batch under canonical names, verl's or OpenRLHF's (which has no rollout logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.snapshot.metadata import AxrlMetadata, DetectorSpec, ParallelLayout

if TYPE_CHECKING:
    import torch

NAMINGS = ("canonical", "verl", "openrlhf")
OUTLIER_LOG_RATIO = 3.0
OUTLIER_ADVANTAGE = -4.0


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of a synthetic snapshot. `extra_tensors` adds {name: shape} float32 tensors to every batch file."""

    iteration: int = 42
    world_size: int = 2
    batch_size: int = 4
    seq_len: int = 16
    prompt_len: int = 6
    vocab_size: int = 32
    moe_layers: tuple[int, ...] = (0, 1)
    top_k: int = 2
    n_experts: int = 4
    naming: str = "canonical"
    routing: bool = True
    legacy: bool = False
    job_name: str = "synthetic-moe"
    grad_norm: float = 40.0
    median_norm: float = 2.0
    seed: int = 0
    extra_tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)


def _canonical_batch(spec: SyntheticSpec, rank: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    import torch

    b, t, p = spec.batch_size, spec.seq_len, spec.prompt_len
    tokens = torch.randint(0, spec.vocab_size, (b, t), generator=gen)
    mask = torch.zeros(b, t)
    mask[:, p:] = 1.0
    mask[b - 1, t - 4 :] = 0.0  # the last sample's response ends early
    old = -(torch.rand(b, t, generator=gen) * 1.5 + 0.5) * mask
    rollout = old + 0.01 * torch.randn(b, t, generator=gen) * mask
    ref = old + 0.05 * torch.randn(b, t, generator=gen) * mask
    advantages = torch.tensor([1.0, -0.5, -2.0, 0.5] * (b // 4 + 1))[:b] * (1 + 0.1 * rank)
    if rank == spec.world_size - 1 and b > 2 and t > 9:
        rollout[2, 9] = old[2, 9] - OUTLIER_LOG_RATIO
    if rank == 0 and b > 1:
        advantages[1] = OUTLIER_ADVANTAGE
    turn = torch.zeros(b, t, dtype=torch.long)
    turn[:, p:] = 1
    turn[:, p + (t - p) // 2 :] = 2
    return {
        "tokens": tokens,
        "loss_mask": mask,
        "advantages": advantages,
        "old_logprobs": old,
        "ref_logprobs": ref,
        "rollout_logprobs": rollout,
        "rewards": (advantages > 0).float(),
        "turn_index": turn,
        "group_index": torch.arange(b) // 2 + rank * 100,
    }


def _renamed(batch: dict[str, torch.Tensor], spec: SyntheticSpec) -> dict[str, torch.Tensor]:
    """The batch as verl or OpenRLHF would save it: responses-only per-token tensors [B, R]."""
    p = spec.prompt_len
    resp = {name: batch[name][:, p:].contiguous() for name in ("loss_mask", "old_logprobs", "ref_logprobs")}
    adv = (batch["advantages"][:, None] * batch["loss_mask"][:, p:]).contiguous()  # per-token advantages
    if spec.naming == "verl":
        token_rewards = (batch["rewards"][:, None] * (resp["loss_mask"].cumsum(1) == 1)).contiguous()
        return {
            "input_ids": batch["tokens"],
            "response_mask": resp["loss_mask"],
            "old_log_probs": resp["old_logprobs"],
            "ref_log_prob": resp["ref_logprobs"],
            "rollout_log_probs": batch["rollout_logprobs"][:, p:].contiguous(),
            "advantages": adv,
            "token_level_rewards": token_rewards,
        }
    return {
        "sequences": batch["tokens"],
        "action_mask": resp["loss_mask"],
        "action_log_probs": resp["old_logprobs"],
        "base_action_log_probs": resp["ref_logprobs"],
        "advantages": adv,
    }


def _routing(spec: SyntheticSpec, gen: torch.Generator) -> dict[str, Any]:
    import torch

    b, t = spec.batch_size, spec.seq_len
    routes = torch.randint(0, spec.n_experts, (b, t, len(spec.moe_layers), spec.top_k), generator=gen)
    routes = routes.to(torch.int32)
    routes[b - 1, t - 4 :] = -1  # padding after the short response: no route
    return {"routed_experts": routes, "moe_layers": list(spec.moe_layers), "source": "rollout"}


def write_synthetic_snapshot(snapshots_root: str | Path, spec: SyntheticSpec | None = None) -> Path:
    """Write a synthetic snapshot `iter_<N>` under `snapshots_root` (e.g. `<out>/checkpoints/spike_snapshots`)."""
    import torch

    from axrl_spike_replay.capture.snapshot_writer import RankPayload, write_snapshot

    spec = spec or SyntheticSpec()
    if spec.naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}, got {spec.naming!r}")
    gen = torch.Generator().manual_seed(spec.seed)
    meta = AxrlMetadata(
        job_name=spec.job_name,
        role="actor",
        iteration=spec.iteration,
        grad_norm=spec.grad_norm,
        median_norm=spec.median_norm,
        spike_ratio=spec.grad_norm / spec.median_norm,
        detector=DetectorSpec(),
        parallel=ParallelLayout(world_size=spec.world_size, dp=spec.world_size),
        created_at="2025-01-01T00:00:00+00:00",
    )
    model = {
        "embed.weight": torch.randn(spec.vocab_size, 8, generator=gen),
        "head.weight": torch.randn(8, 8, generator=gen),
    }
    ranks = {}
    for rank in range(spec.world_size):
        batch = _canonical_batch(spec, rank, gen)
        if spec.naming != "canonical":
            batch = _renamed(batch, spec)
        for name, shape in spec.extra_tensors.items():
            batch[name] = torch.ones(shape)
        norms = {"embed.weight": 1.0 + rank, "head.weight": 0.5, f"experts.{rank}.w": 10.0 * (rank + 1)}
        mask = next((batch[k] for k in ("loss_mask", "response_mask", "action_mask") if k in batch), None)
        if mask is None:
            raise ValueError(f"synthetic rank {rank} batch has no loss mask (loss_mask, response_mask or action_mask)")
        grad_info = {
            "grad_norm": spec.grad_norm,
            "param_grad_norms": norms,
            "param_numel": {name: 64 for name in norms},
            "loss": 0.1 * (rank + 1),
            "num_tokens": int(mask.sum()),
        }
        ranks[rank] = RankPayload(batch, grad_info, _routing(spec, gen) if spec.routing else None)
    run_config = {"parallel": {"world_size": spec.world_size, "dp": spec.world_size}, "synthetic": True}
    return write_snapshot(snapshots_root, meta, run_config, model, ranks, legacy_layout=spec.legacy)
