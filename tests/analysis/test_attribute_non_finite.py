"""Attributing a step whose replayed gradient is not finite: refused, naming the step, never a table of zero shares.

The story: a NaN advantage on one sample made the step's gradient NaN. Every sample's share of a NaN gradient is
undefined (each was once printed as 0, which reads as "no sample carries it"). `attribute` refuses, naming the
iteration and the non-finite norm, and says how to go on; `diagnose` lists the attribution under "not checked" with
that reason and still runs the rest of its model evidence."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from snapshot_edits import copy_fixture, edit_batch

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.replay.analyses.attribution import attribute_spike
from axrl_spike_replay.vocabulary import Verb


def _nan_step(tmp_path: Path) -> Path:
    snapshot = copy_fixture(tmp_path)

    def nan_advantage(b: dict[str, Any]) -> None:
        b["advantages"] = b["advantages"].clone()
        b["advantages"][2] = math.nan

    edit_batch(snapshot, 0, nan_advantage)
    meta_path = snapshot / "axrl_metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["grad_norm"] = math.nan
    meta_path.write_text(json.dumps(meta))
    return snapshot


def test_attributing_a_non_finite_step_is_refused_naming_the_step(tmp_path: Path, cli) -> None:
    snapshot = _nan_step(tmp_path)
    with pytest.raises(SnapshotError, match=r"iteration 21's replayed gradient is not finite \(grad norm nan"):
        attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=3)))
    run = cli("attribute", snapshot, "--top", "3")
    assert run.code != 0 and "Traceback" not in run.err
    assert "iteration 21's replayed gradient is not finite" in run.err and "drop_samples" in run.err
    assert "share" not in run.out  # no table of shares


def test_diagnose_says_why_a_non_finite_step_has_no_attribution_and_keeps_its_other_evidence(tmp_path: Path) -> None:
    snapshot = _nan_step(tmp_path)
    d = diagnose_snapshot(snapshot, model="always")
    [line] = [n for n in d.not_checked if n.startswith("per-sample attribution (")]
    assert "iteration 21's replayed gradient is not finite" in line
    assert d.attribution_top == [] and d.step is not None  # the signal check and the loss channel still ran
    assert d.top.family == "non_finite" and "drop_samples=0:2" in d.mitigation_items()
