"""Verdicts, fidelity, backends and guard actions are closed vocabularies that still read as their plain strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from axrl_spike_replay.capture.spike_guard import SpikeGuard
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.experiment.result import VERDICTS, ReplayResult
from axrl_spike_replay.vocabulary import Backend, Fidelity, GuardAction, Verdict

RESULT = {
    "snapshot": "/snapshots/run~job__actor/checkpoints/spike_snapshots/iter_0000005",
    "backend": "torch",
    "target": "local",
    "fidelity": "reduced",
    "world_size_saved": 2,
    "world_size_used": 1,
    "mitigations": {"mismatch_token_clip_max": 2},
    "grad_norm": 3.8,
    "recorded_grad_norm": 37.42,
    "rel_diff": 0.9,
    "median_norm": 2.91,
    "spike_ratio": 1.3,
    "verdict": "cleared",
    "threshold": 5.0,
}


def test_a_result_read_back_from_its_file_holds_the_vocabularies_and_writes_the_same_strings(tmp_path: Path) -> None:
    path = tmp_path / "replay_result.json"
    path.write_text(json.dumps(RESULT))
    result = ReplayResult.from_json(json.loads(path.read_text()))
    assert result.verdict is Verdict.CLEARED and result.fidelity is Fidelity.REDUCED
    assert result.backend is Backend.TORCH
    doc = json.loads(json.dumps(result.to_json()))
    assert {k: doc[k] for k in RESULT} == RESULT
    # what people read: messages, logs and templates show the bare value
    shown = f"{result.verdict} at {result.fidelity} fidelity ({result.backend!r})"
    assert shown == "cleared at reduced fidelity ('torch')"
    assert str(Verdict.BASELINE_NOT_A_SPIKE) == "baseline_not_a_spike" and f"{Fidelity.FULL:>6}" == "  full"
    assert yaml.safe_load(yaml.safe_dump({"verdict": str(result.verdict)})) == {"verdict": "cleared"}


def test_every_verdict_value_is_kept() -> None:
    assert VERDICTS == (
        "reproduced",
        "not_reproduced",
        "cleared",
        "partial",
        "no_effect",
        "worse",
        "baseline_not_a_spike",
        "failed",
    )
    assert Backend.values() == ("torch", "command", "megatron") and Fidelity.values() == ("full", "reduced")
    assert GuardAction.values() == ("proceed", "log", "skip", "rollback")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("verdict", "obliterated", r"result verdict must be one of reproduced, .*failed, got 'obliterated'"),
        ("fidelity", "\x1b[2Jhalf", r"result fidelity must be one of full, reduced, got '\\x1b\[2Jhalf'"),
        ("backend", None, r"result backend must be one of torch, command, megatron, got None"),
    ],
)
def test_a_result_file_with_a_value_outside_its_vocabulary_is_refused_by_name(
    tmp_path: Path, field: str, value: object, message: str
) -> None:
    with pytest.raises(AxrlError, match=message):
        ReplayResult.from_json({**RESULT, field: value})


def test_the_spike_guard_takes_its_action_by_name(tmp_path: Path) -> None:
    guard = SpikeGuard(tmp_path / "snapshots", action="rollback")
    assert guard.action is GuardAction.ROLLBACK
    with pytest.raises(ConfigError, match=r"one of \('log', 'skip', 'rollback'\), got 'proceed'"):
        SpikeGuard(tmp_path / "snapshots", action="proceed")
