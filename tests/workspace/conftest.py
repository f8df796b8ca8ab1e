"""A real tiny spike snapshot and replay results with real figures for the investigation-record tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from axrl_spike_replay.replay.result import ReplayResult

JOB = "fixture-moe"
ITERATION = 5
RECORDED = 37.42  # grad norm the trainer saw at the spike step
MEDIAN = 2.91  # median of the detector window
THRESHOLD = 5.0


@dataclass
class SpikeRun:
    output_dir: Path
    snapshot: Path
    iteration: int


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


def replay_result(snapshot: Path, grad_norm: float | None, verdict: str, **changes: object) -> ReplayResult:
    """A replay result with the figures a replay of the spike snapshot reports."""
    doc = {
        "snapshot": str(snapshot),
        "backend": "torch",
        "target": "local",
        "fidelity": "full",
        "world_size_saved": 2,
        "world_size_used": 2,
        "mitigations": {},
        "grad_norm": grad_norm,
        "recorded_grad_norm": RECORDED,
        "rel_diff": None if grad_norm is None else abs(grad_norm - RECORDED) / RECORDED,
        "median_norm": MEDIAN,
        "spike_ratio": None if grad_norm is None else grad_norm / MEDIAN,
        "verdict": verdict,
        "threshold": THRESHOLD,
        "job_name": JOB,
        "role": "actor",
        "iteration": ITERATION,
        "created_at": "2026-01-01T00:00:00+00:00",
    }
    doc.update(changes)
    return ReplayResult(**doc)


def save_result(workspace: Path, name: str, result: ReplayResult) -> Path:
    """Write `tmp/spike-replay/<job>/<name>/replay_result.json` as a replay does."""
    path = workspace / "tmp" / "spike-replay" / JOB / name / "replay_result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=2))
    return path
