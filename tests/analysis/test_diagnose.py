"""`diagnose` names the cause of each kind of spike first, with its evidence as numbers and experiments to run;
a clean step gives `natural_spike` with what was checked; a snapshot edited after the fact is caught by the
consistency checks even though its replay reproduces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.replay.analyses.attribution import attribute_spike
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
from axrl_spike_replay.vocabulary import Verb


def test_a_log_prob_mismatch_spike_is_diagnosed_as_such_with_the_carrying_sample(captured_run, cli) -> None:
    snapshot = captured_run.snapshot_dirs[0]
    d = diagnose_snapshot(snapshot)
    top = d.causes[0]
    assert top.family == "engine_mismatch" and top.strength == 1.0 and top.ranks == []  # spread over the ranks
    assert top.figures["max_abs_log_ratio_current_vs_rollout"] > 5
    assert top.figures["fraction_outside_0.5_2_current_vs_rollout"] > 0.5
    assert any("old agrees with the replay on rank" in line for line in top.evidence)  # the witness
    carrier = d.attribution_top[0]
    assert f"rank {carrier['rank']} sample {carrier['sample']} carries" in top.evidence[0]
    assert d.mitigation_items()[0] == "mismatch_token_clip_max=2"
    assert d.consistency is not None and d.consistency.self_consistent and d.consistency.agrees_with_log

    run = cli("diagnose", snapshot, "--model", "never")
    assert run.code == 0 and "rollout/trainer log-prob mismatch" in run.out
    assert "--mitigation mismatch_token_clip_max=2" in run.out and "per-sample attribution" in run.out
    doc = cli("diagnose", snapshot, "--json", "--model", "never").json()
    assert doc["causes"][0]["family"] == "engine_mismatch"
    assert doc["causes"][0]["tied_with"] == ["stale_old_logprobs"]  # without the replay the two cannot be told apart


def test_a_negative_advantage_spike_is_diagnosed_as_negative_dominance(negative_advantage_run) -> None:
    d = diagnose_snapshot(negative_advantage_run.snapshot_dirs[0])
    assert d.causes[0].family == "negative_advantage_dominance"
    assert "100.0 % of loss tokens have a negative advantage" in d.causes[0].evidence[0]
    assert d.mitigation_items()[0] == "balance_negative_advantages=true"


def test_a_clean_step_gives_a_natural_spike_and_says_what_was_checked(tmp_path: Path) -> None:
    from tiny_spike import write_tiny_spike

    snapshot = write_tiny_spike(tmp_path, job="clean", iteration=5, recorded=1.0, median=1.0)
    # its stored log-probs are placeholders (0 on every loss token): against the replay they cover nothing
    with_model = diagnose_snapshot(snapshot)
    # its recorded figures are made up (grad norm 1.0): the step does not reproduce, and that is said first
    assert [c.family for c in with_model.causes[:2]] == ["step_not_reproduced", "mask_misalignment"]
    assert {c.family for c in with_model.causes} & {"stale_old_logprobs", "bad_ref_logprobs"} == set()
    d = diagnose_snapshot(snapshot, model="never")
    assert d.causes[0].family == "natural_spike"
    assert "checked:" in d.causes[0].evidence[0]
    assert "the stored old log-probs against the replay" in d.causes[0].evidence[0]
    assert any(line.startswith("outlier_advantage:") for line in d.checked)


def _edit_batches(snapshot: Path, rank: int, sample: int, factor: float) -> None:
    """Rollout logprobs made the trainer's (no mismatch left), one sample's advantage scaled by `factor`."""
    for path in snapshot.glob("batch_rank*.pt"):
        batch = torch.load(path, weights_only=True)
        batch["rollout_logprobs"] = batch["old_logprobs"].clone()
        if path.name == f"batch_rank{rank}.pt":
            batch["advantages"][sample] *= factor
        torch.save(batch, path)


def _rewrite_recorded_norm(snapshot: Path, norm: float) -> None:
    meta_path = snapshot / "axrl_metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["grad_norm"], meta["spike_ratio"] = norm, norm / meta["median_norm"]
    meta_path.write_text(json.dumps(meta))
    for info_path in snapshot.glob("grad_info_rank*.pt"):
        info = torch.load(info_path, weights_only=True)
        info["grad_norm"] = norm
        torch.save(info, info_path)


@pytest.mark.slow
def test_an_edited_snapshot_reproduces_yet_is_flagged_and_its_outlier_advantage_diagnosed(
    captured_run, tmp_path: Path
) -> None:
    # a whole job output dir (so its log is known), its batches edited after the fact
    # and the recorded norm rewritten to what the edited batch gives: the replay "reproduces" it
    output = tmp_path / captured_run.output_dir.name
    shutil.copytree(captured_run.output_dir, output)
    snapshot = output / captured_run.snapshot_dirs[1].relative_to(captured_run.output_dir)
    _edit_batches(snapshot, rank=0, sample=3, factor=200.0)
    _rewrite_recorded_norm(snapshot, attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE))).grad_norm)
    _rewrite_recorded_norm(snapshot, run_replay(replay_request(What(snapshot))).grad_norm or 0.0)

    replay = run_replay(replay_request(What(snapshot)))
    assert replay.verdict == "reproduced"
    assert replay.consistency is not None
    names = {p.name for p in replay.consistency.problems}
    assert {"grad_norm_vs_log", "rank_loss_vs_replay"} <= names
    assert replay.consistency.self_consistent is False and replay.consistency.agrees_with_log is False

    inspection = inspect_snapshot(snapshot)
    assert any(p.startswith("[grad_norm_vs_log]") for p in inspection.problems)

    d = diagnose_snapshot(snapshot)
    top = d.causes[0]
    assert top.family == "outlier_advantage"
    assert top.figures["samples"] == [[0, 3]] and top.figures["share_of_norm"] > 0.9
    assert "sample 0:3 carries" in top.evidence[0]
    items = d.mitigation_items()
    assert items[0].startswith("advantage_outlier_mask=") and "drop_samples=0:3" in items
