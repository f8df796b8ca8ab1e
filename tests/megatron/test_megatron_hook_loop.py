"""The Megatron hook in megatron-core's own loop, used as a trainer would: `guard.step` is given the rank's loss and
token count, which the snapshot's grad info records and the replay's per-rank loss check compares; and every
capability runs on route 1 of that snapshot. Route 1 computes the experts with transformers' `grouped_mm` by
default, which has no forward-mode AD: `attribute` and `diagnose` compute them eagerly in their forward-mode pass,
and agree with the per-sample backward."""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_helpers import REASON

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.replay.analyses.attribution import attribute_spike
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.snapshot.rank_data import load_grad_info
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml
from axrl_spike_replay.vocabulary import Verb

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def capture(megatron_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The EP=2 training loop of megatron_trainer from the reference checkpoint alone (the session's TP=1 one of
    the same section, read only), spiking at step 6."""
    if REASON is not None:
        pytest.skip(REASON)
    from megatron_trainer import train

    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

    reference = megatron_checkpoints["tp1"]
    root = tmp_path_factory.mktemp("megatron-hook-loop") / "checkpoints" / "spike_snapshots"
    section = tiny_section()
    section.pop("experts_implementation")  # as a Megatron user's model section: route 1 then takes grouped_mm
    payload = (section, str(reference), str(root), 7, 6, 2, "megatron-hook-loop")
    spawn_ranks(train, 2, payload, timeout_s=1200.0, label="megatron training")
    return next(root.glob("iter_0000006"))


def test_the_hook_records_each_rank_s_loss_and_the_replay_checks_it(capture: Path) -> None:
    infos = [load_grad_info(capture, rank) for rank in (0, 1)]
    assert all(info["loss"] is not None and info["num_tokens"] == 92.0 for info in infos)  # 4 x 24 - 4 tokens
    assert infos[0]["loss"] != infos[1]["loss"]  # each data-parallel rank's own
    result = run_replay(replay_request(What(capture)))
    assert result.consistency is not None
    assert "rank_loss_vs_replay" in result.consistency.checked
    assert not [p for p in result.consistency.problems if p.name == "rank_loss_vs_replay"]
    for info, metrics in zip(infos, sorted(result.rank_metrics, key=lambda m: m["rank"]), strict=True):
        assert metrics["loss"] == pytest.approx(info["loss"], rel=1e-4)


def test_attribute_runs_on_route_1_whose_experts_run_grouped_mm(capture: Path) -> None:
    model = read_untrusted_yaml(capture / "run_config.yaml", "run config")["model"]
    assert "experts_implementation" not in model  # route 1's default for kind megatron: grouped_mm
    forward = attribute_spike(replay_request(What(capture, verb=Verb.ATTRIBUTE, top=8, method="jvp")))
    backward = attribute_spike(replay_request(What(capture, verb=Verb.ATTRIBUTE, top=8, method="per_sample_backward")))
    assert forward.sum_rel_error < 1e-4  # the contributions add up to the replayed norm
    by_sample = {(s.rank, s.sample): s.contribution for s in backward.samples}
    assert [(s.rank, s.sample) for s in forward.samples] == [(s.rank, s.sample) for s in backward.samples]
    for s in forward.samples:
        assert s.contribution == pytest.approx(by_sample[(s.rank, s.sample)], rel=1e-4, abs=1e-6 * forward.grad_norm)
    assert {(s.rank, s.sample) for s in forward.samples[:2]} <= {(0, 1), (0, 2), (1, 1), (1, 2)}  # the burst's


def test_diagnose_with_model_evidence_runs_on_route_1(capture: Path) -> None:
    diagnosis = diagnose_snapshot(capture, model="always")
    assert diagnosis.consistency is not None
    assert "grad_norm_vs_replay" in diagnosis.consistency.checked  # the attribution's replay ran
    assert not [line for line in diagnosis.not_checked if line.startswith("model evidence")]
