"""Replaying a spike of a transformers MoE policy (qwen3_moe, saved world size 2): full fidelity is bit-identical
to the recorded step, reduced fidelity within 1e-5, and loss-level and routing mitigations move the grad norm
(on the other five architectures too, in the `matrix`).

The snapshot (`hf_snapshot`, tests/conftest.py) is recorded once per test session with the trainer's own
rank step (axrl_spike_replay.testing.hf_snapshot).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.models.architectures import ARCHITECTURES
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.job_runner import JobRunner
from axrl_spike_replay.replay.sweep import run_sweep
from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot
from axrl_spike_replay.vocabulary import Verb


@pytest.mark.slow
def test_full_replay_is_bit_identical_to_the_recorded_step(hf_snapshot: Path, warm_runner: JobRunner) -> None:
    result = run_replay(replay_request(What(hf_snapshot), how=How(nproc=2)), runner=warm_runner)
    assert result.fidelity == "full"
    assert result.grad_norm == result.recorded_grad_norm
    assert result.verdict == "reproduced"
    assert result.top_params and result.top_params[0].name.startswith(("model.", "lm_head."))


def test_reduced_replay_and_mitigations_on_an_hf_model(hf_snapshot: Path) -> None:
    sweep = run_sweep(
        replay_request(
            What(
                hf_snapshot,
                verb=Verb.SWEEP,
                configs=tuple(
                    [{"dual_clip_c": 2.0}, {"current_routing_layers": "first"}, {"routing_replay": "loss_tokens"}]
                ),
            ),
            how=How(nproc=1),
        )
    )
    base = sweep.baseline
    assert base.fidelity == "full" and base.rel_diff is not None and base.rel_diff <= 1e-5
    assert base.verdict == "reproduced"
    assert base.consistency is not None and "param_grad_norms_vs_replay" in base.consistency.checked
    assert base.consistency.self_consistent, base.consistency.problems  # parameter by parameter, reduced
    for row in sweep.results:
        assert row.grad_norm != base.grad_norm, row.mitigations
    first = sweep.results[1]
    assert first.mitigations == {"current_routing_layers": "first"}
    assert first.resolved_mitigations == {"current_routing_layers": [0]}  # qwen3_moe's first MoE layer
    assert [r.resolved_mitigations for r in (base, sweep.results[0], sweep.results[2])] == [{}, {}, {}]


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("architecture", [a for a in ARCHITECTURES if a != "qwen3_moe"])
def test_loss_level_and_routing_mitigations_move_the_grad_norm_on_each_architecture(
    architecture: str, tmp_path: Path
) -> None:
    snapshot = record_hf_snapshot(tmp_path, architecture, world_size=2)
    configs = [{"dual_clip_c": 2.0}, {"current_routing_layers": "first"}, {"routing_replay": "loss_tokens"}]
    sweep = run_sweep(replay_request(What(snapshot, verb=Verb.SWEEP, configs=tuple(configs)), how=How(nproc=1)))
    base = sweep.baseline
    assert base.verdict == "reproduced" and base.rel_diff is not None and base.rel_diff <= 1e-5
    loss_level, first, loss_tokens = sweep.results
    assert loss_level.grad_norm != base.grad_norm
    assert first.grad_norm != base.grad_norm  # the bf16 engine routed some tokens otherwise in that layer
    first_layer = 1 if architecture == "deepseek_v3" else 0  # deepseek_v3's layer 0 is dense
    assert first.resolved_mitigations == {"current_routing_layers": [first_layer]}
    # it runs everywhere; it moves the norm only where the engine's prompt routes differ from the current ones,
    # which on olmoe and deepseek_v3 they do not
    assert loss_tokens.grad_norm is not None and loss_tokens.verdict != "failed"


def test_a_model_the_engine_cannot_build_is_refused_before_anything_runs(hf_snapshot: Path, tmp_path: Path) -> None:
    import shutil

    import yaml

    copy = tmp_path / hf_snapshot.name
    shutil.copytree(hf_snapshot, copy)
    doc = yaml.safe_load((copy / "run_config.yaml").read_text())
    doc["model"]["architecture"] = "jamba"
    (copy / "run_config.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match="--backend command"):
        run_replay(replay_request(What(copy), how=How(nproc=1)))
