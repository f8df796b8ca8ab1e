"""A real tiny spike snapshot (tiny MoE, world size 2) with chosen figures, for tests that need one on disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def write_tiny_spike(
    output_dir: Path,
    *,
    job: str,
    iteration: int,
    recorded: float,
    median: float,
    threshold: float = 5.0,
    param_norm: Callable[[int], float] = lambda rank: 1.0,
) -> Path:
    """Write snapshot `iteration` under `output_dir`'s rotating snapshot dir; its path."""
    import torch

    from axrl_spike_replay.capture.snapshot_writer import RankPayload, write_snapshot
    from axrl_spike_replay.models.tiny_moe import TinyMoEConfig, TinyMoEPolicy
    from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR
    from axrl_spike_replay.snapshot.metadata import AxrlMetadata, DetectorSpec, ParallelLayout

    torch.manual_seed(0)
    cfg = TinyMoEConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, d_ff=16, n_experts=2, top_k=1, max_seq_len=8)
    model = TinyMoEPolicy(cfg)
    meta = AxrlMetadata(
        job_name=job,
        role="actor",
        iteration=iteration,
        grad_norm=recorded,
        median_norm=median,
        spike_ratio=recorded / median,
        detector=DetectorSpec(threshold=threshold),
        parallel=ParallelLayout(world_size=2, dp=2),
    )
    ranks = {}
    for rank in range(2):
        batch = {
            "tokens": torch.randint(0, 16, (2, 8)),
            "loss_mask": torch.ones(2, 8),
            "advantages": torch.tensor([1.0, -1.0]),
            "old_logprobs": torch.zeros(2, 8),
            "ref_logprobs": torch.zeros(2, 8),
            "rollout_logprobs": torch.zeros(2, 8),
            "rewards": torch.tensor([1.0, 0.0]),
            "group_index": torch.tensor([rank, rank]),
        }
        grad_info = {
            "grad_norm": recorded,
            "param_grad_norms": {"embed.weight": param_norm(rank)},
            "loss": 0.1,
            "num_tokens": 16,
        }
        ranks[rank] = RankPayload(batch=batch, grad_info=grad_info)
    run_config = {"model": cfg.to_dict(), "loss": {}, "routing": {"replay": "off"}, "parallel": {"world_size": 2}}
    return write_snapshot(output_dir / SNAPSHOTS_DIR, meta, run_config, model.state_dict(), ranks)
