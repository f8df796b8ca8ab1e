"""A real tiny spike snapshot for the investigation-record tests."""

from __future__ import annotations

import pytest
from record_helpers import ITERATION, JOB, MEDIAN, RECORDED, THRESHOLD, SpikeRun


@pytest.fixture(scope="session")
def spike_run(tmp_path_factory: pytest.TempPathFactory) -> SpikeRun:
    """One output dir `run1~fixture-moe__actor` holding a real snapshot (tiny MoE, world size 2)."""
    import torch

    from axrl_spike_replay.capture.snapshot_writer import RankPayload, write_snapshot
    from axrl_spike_replay.models.tiny_moe import TinyMoEConfig, TinyMoEPolicy
    from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR
    from axrl_spike_replay.snapshot.metadata import AxrlMetadata, DetectorSpec, ParallelLayout

    torch.manual_seed(0)
    cfg = TinyMoEConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, d_ff=16, n_experts=2, top_k=1, max_seq_len=8)
    model = TinyMoEPolicy(cfg)
    output_dir = tmp_path_factory.mktemp("outputs") / f"run1~{JOB}__actor"
    meta = AxrlMetadata(
        job_name=JOB,
        role="actor",
        iteration=ITERATION,
        grad_norm=RECORDED,
        median_norm=MEDIAN,
        spike_ratio=RECORDED / MEDIAN,
        detector=DetectorSpec(threshold=THRESHOLD),
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
        grad_info = {"grad_norm": RECORDED, "param_grad_norms": {"embed.weight": 1.0}, "loss": 0.1, "num_tokens": 16}
        ranks[rank] = RankPayload(batch=batch, grad_info=grad_info)
    run_config = {"model": cfg.to_dict(), "loss": {}, "routing": {"replay": "off"}, "parallel": {"world_size": 2}}
    snapshot = write_snapshot(output_dir / SNAPSHOTS_DIR, meta, run_config, model.state_dict(), ranks)
    return SpikeRun(output_dir=output_dir, snapshot=snapshot, iteration=ITERATION)
