"""A corrupt input on one rank is the finding, never a reason to stop.

A run of the reference trainer whose rank 1 routing payload lists one expert twice in the top-k of most tokens
during the burst, and the trainer replays those routes as recorded (that expert counts twice); the reference
worker routes on its own, so the k3 KL term carries the spike. `inspect` names the rank, the field, how often,
with rank 0 as the witness; `replay` reproduces the step at full fidelity with the routes as the trainer ran
them; recomputing that rank's routes, or dropping the rank, clears the spike: the cause is proven.

The same snapshot with an expert id past the model's experts planted on rank 1: no computation is defined on it,
so the step's own replay is refused naming why and offering the experiments, and those experiments run, judged
against the recorded step."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.capture.fault_injection.faults import make_fault
from axrl_spike_replay.capture.reference.presets import FaultSpec
from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run
from axrl_spike_replay.replay.reading.input_checks import inspect_with_inputs
from axrl_spike_replay.testing.fault_matrix import burst_snapshots
from hostile_snapshot import edit_routing_payload

RECOMPUTE = "recompute=routes:rank1,old_logprobs:rank1"


@pytest.fixture(scope="module")
def duplicated_routes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The burst snapshot of a run whose rank 1 routes list one expert twice on 70 % of its tokens."""
    logging.getLogger("axrl_spike_replay.guard").setLevel(logging.ERROR)
    run = capture_reference_run(
        tmp_path_factory.mktemp("duplicated-routes"),
        run="dup",
        world_size=2,
        steps=24,
        preset="expert_sensitive",
        faults=[
            make_fault(FaultSpec("routes_duplicate", ranks=(1,), params={"fraction": 0.7})),
            make_fault(FaultSpec("ref_own_routing")),
        ],
        hide_fault=True,
        overrides={"loss": {"kl_coef": 0.1, "kl_estimator": "k3", "is_base_logprobs": "old"}},
    )
    snapshots = burst_snapshots(run, "expert_sensitive")
    assert snapshots, f"no spike at the burst: {run.grad_norms}"
    yield snapshots[0]


@pytest.mark.slow
def test_duplicated_expert_ids_on_one_rank_are_the_finding_and_the_step_replays_as_the_trainer_ran_it(
    duplicated_routes: Path, tmp_path: Path, cli
) -> None:
    seen = inspect_with_inputs(duplicated_routes)
    [finding] = seen.input_findings
    assert finding.startswith("rank 1 routed_experts (") and "list one expert more than once in a top-2" in finding
    assert "up to 2 times per token" in finding and "replayed as recorded" in finding
    assert "rank 0: 0 (healthy: ranks 0)" in finding  # the other rank is the witness
    assert f"experiments that remove it: {RECOMPUTE}, drop_ranks=1" in finding
    assert f"[input] {finding}" in json.loads(cli("inspect", duplicated_routes, "--json").out)["problems"]

    workspace = tmp_path / "ws"
    workspace.mkdir()
    run = cli(
        "sweep", duplicated_routes, "--workspace", workspace, "--mitigation", RECOMPUTE,
        "--mitigation", "drop_ranks=1", "--json",
    )  # fmt: skip
    assert run.code == 0, run.err
    sweep = json.loads(run.out)
    baseline = sweep["baseline"]
    assert baseline["verdict"] == "reproduced" and baseline["fidelity"] == "full"  # as the trainer ran the routes
    assert baseline["input_findings"] == [finding]
    assert [r["verdict"] for r in sweep["results"]] == ["cleared", "cleared"]  # each experiment proves the cause


@pytest.mark.slow
def test_an_expert_id_past_the_model_refuses_the_steps_replay_and_its_experiments_still_run(
    duplicated_routes: Path, tmp_path: Path, cli
) -> None:
    snap = Path(shutil.copytree(duplicated_routes, tmp_path / duplicated_routes.name))
    edit_routing_payload(snap, 1, lambda doc: doc.__setitem__("routed_experts", doc["routed_experts"].masked_fill(
        doc["routed_experts"] == 3, 4)))  # fmt: skip
    bad = int((torch.load(snap / "routing_payload_rank1.pt", weights_only=True)["routed_experts"] == 4).sum())

    seen = inspect_with_inputs(snap)
    ranges = [p for p in seen.problems if "expert ids [4]" in p]
    assert len(ranges) == 1 and ranges[0].startswith("[input] rank 1 routed_experts (")
    assert f"({bad} of " in ranges[0] and "the model has 4 experts per layer (ids 0-3, -1 for none)" in ranges[0]
    assert "expert ids on the other ranks: rank 0: 0-3 (healthy: ranks 0)" in ranges[0]

    workspace = tmp_path / "ws"
    workspace.mkdir()
    refused = cli("replay", snap, "--workspace", workspace)
    assert refused.code != 0 and "Traceback" not in refused.err
    said = " ".join(refused.err.split())
    assert "the saved config is refused: rank 1 routed_experts" in said
    assert f"Run instead: drop_ranks=1, {RECOMPUTE}" in said
    assert not (workspace / "tmp").exists()  # refused before anything was written

    run = cli("replay", snap, "--workspace", workspace, "--mitigation", "drop_ranks=1", "--json")
    assert run.code == 0, run.err
    result = json.loads(run.out)
    assert result["verdict"] == "cleared" and result["baseline_grad_norm"] == result["recorded_grad_norm"]
    assert any("expert ids [4]" in f for f in result["input_findings"])


@pytest.mark.slow
def test_diagnose_leads_with_the_corrupt_input_on_its_rank_and_its_experiments(
    duplicated_routes: Path, tmp_path: Path
) -> None:
    from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot

    d = diagnose_snapshot(duplicated_routes, model="always")
    top = d.top
    assert top.family == "routing_payload" and top.ranks == [1]
    assert top.evidence[0].startswith("rank 1 routed_experts (") and "healthy: ranks 0" in top.evidence[0]
    assert {RECOMPUTE, "drop_ranks=1"} <= {e.mitigation for e in top.experiments}
    assert not [n for n in d.not_checked if n.startswith("model evidence")]  # the step replays: evidence is read

    snap = Path(shutil.copytree(duplicated_routes, tmp_path / duplicated_routes.name))
    edit_routing_payload(snap, 1, lambda doc: doc.__setitem__("routed_experts", doc["routed_experts"].masked_fill(
        doc["routed_experts"] == 3, 4)))  # fmt: skip
    d = diagnose_snapshot(snap, model="always")
    assert d.top.family == "routing_payload" and d.top.ranks == [1]
    assert any("expert ids [4]" in line for line in d.top.evidence)
    [refused] = [n for n in d.not_checked if n.startswith("model evidence")]
    assert "Run instead: drop_ranks=1" in refused  # the step's own replay is undefined: its evidence names why
