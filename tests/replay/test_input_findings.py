"""Stored log-probs, masks and tokens held to the model, rank by rank: a positive stored log-prob or a mask value
that is neither 0 nor 1 is a finding the step still replays with (the trainer computed with it); a token past
the model's vocabulary is one no forward is defined on, so the step's replay is refused naming it, and the
experiment that leaves its rank out runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.experiment.result import ReplayResult, SweepResult
from axrl_spike_replay.experiment.run_dir import COMMAND_FILE
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.replay.reading.input_checks import inspect_with_inputs
from axrl_spike_replay.vocabulary import Verb


def _edit_batch(snapshot: Path, rank: int, edit: Callable[[dict[str, Any]], None]) -> None:
    path = snapshot / f"batch_rank{rank}.pt"
    batch = torch.load(path, weights_only=True)
    edit(batch)
    torch.save(batch, path)


def test_a_positive_stored_log_prob_and_an_odd_mask_value_are_findings_on_their_rank(
    snapshot_copy: Callable[[], Path], workspace: Path
) -> None:
    snap = snapshot_copy()
    assert inspect_with_inputs(snap).input_findings == []  # the capture as recorded passes every check

    def corrupt(batch: dict[str, Any]) -> None:
        batch["old_logprobs"][2, -3:] = 0.7  # three tokens of one sample: a log-prob no probability gives
        batch["loss_mask"][5, -1] = 2.0

    _edit_batch(snap, 1, corrupt)
    found = inspect_with_inputs(snap).input_findings
    [logprobs] = [f for f in found if "old_logprobs" in f]
    assert logprobs.startswith("rank 1 old_logprobs: log-probs above 0 (up to 0.7)") and "(3 of 112)" in logprobs
    assert "experiments that remove it: recompute=old_logprobs:rank1, drop_ranks=1" in logprobs
    [mask] = [f for f in found if "loss_mask" in f]
    assert mask.startswith("rank 1 loss_mask: loss-mask values [2.0]") and "(1 of 112)" in mask

    result = run_request(replay_request(What(snap), how=How(nproc=2), workspace=workspace))
    assert result.verdict != "failed" and result.fidelity == "full"  # replayed as the trainer computed it
    assert sorted(result.input_findings) == sorted(found)


def test_a_token_past_the_vocabulary_refuses_the_replay_naming_it(
    snapshot_copy: Callable[[], Path], workspace: Path
) -> None:
    snap = snapshot_copy()
    _edit_batch(snap, 0, lambda b: b["tokens"].__setitem__((1, 4), 16))  # the model has 16 tokens: 0-15
    [problem] = [p for p in inspect_with_inputs(snap).problems if p.startswith("[input]")]
    assert "rank 0 tokens: token ids [16] outside the model's vocabulary of 16 (1 of 112)" in problem
    assert "experiments that remove it: drop_ranks=0" in problem
    with pytest.raises(SnapshotError, match=r"the saved config is refused: rank 0 tokens: token ids \[16\]"):
        run_request(replay_request(What(snap), how=How(nproc=1), workspace=workspace))
    assert not (workspace / "tmp").exists()

    # the experiment that removes the bad part runs and has a verdict, judged against the recorded step; in a sweep
    # an experiment that still computes with rank 0's tokens is refused by name and the others run
    drop_request = replay_request(What(snap, mitigations={"drop_ranks": 0}), how=How(nproc=1), workspace=workspace)
    dropped = run_request(drop_request)
    assert isinstance(dropped, ReplayResult)
    assert dropped.verdict not in ("failed", None) and dropped.grad_norm is not None
    assert "drop_ranks=0" in next((workspace / "tmp").rglob(COMMAND_FILE)).read_text()  # the replay as asked
    assert any("token ids [16]" in f for f in dropped.input_findings)
    what = What(snap, verb=Verb.SWEEP, configs=({"advantage_clip": 1.0}, {"drop_ranks": 0}))
    sweep = run_request(replay_request(what, how=How(nproc=1), workspace=workspace))
    assert isinstance(sweep, SweepResult)
    command = (Path(sweep.output_dir) / COMMAND_FILE).read_text()
    assert "advantage_clip=1" in command and "drop_ranks=0" in command  # the sweep as asked, the refused one too
    clip, drop = sweep.results
    assert clip.verdict == "failed" and clip.error is not None and "is refused: rank 0 tokens" in clip.error
    assert "advantage_clip" in clip.error  # the experiment named
    assert drop.verdict == dropped.verdict and drop.grad_norm == pytest.approx(dropped.grad_norm, rel=1e-9)
