"""The levers that test a hypothesis about one rank or one stored signal, each against the replay it must equal:
`drop_ranks` / `keep_ranks` as that rank's loss mask zeroed (and its router losses left out, a part of this step too
small to show at 1e-6: tests/replay/test_leave_out_ranks.py holds that to the bit); `recompute=old_logprobs:rankR`
on stale old log-probs as the snapshot before they went stale; `recompute=routes:rankR,old_logprobs:rankR` on a
shifted routing payload as the snapshot before it was shifted."""

from __future__ import annotations

from pathlib import Path

import pytest
from snapshot_edits import copy_fixture, edit_batch, no_mismatch, set_loss, shift_routes, stale_old_logprobs

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay


def _norm(snapshot: Path, **mitigations: object) -> float:
    norm = run_replay(replay_request(What(snapshot, mitigations=mitigations), how=How(nproc=1))).grad_norm
    assert norm is not None
    return norm


def test_dropping_a_rank_is_that_ranks_loss_mask_zeroed(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path / "a")
    zeroed = copy_fixture(tmp_path / "b")
    edit_batch(zeroed, 1, lambda b: b.__setitem__("loss_mask", b["loss_mask"] * 0))
    expected = _norm(zeroed)
    assert _norm(snapshot, drop_ranks="1") == pytest.approx(expected, rel=1e-6)
    assert _norm(snapshot, keep_ranks="0") == pytest.approx(expected, rel=1e-6)
    assert expected < 0.9 * _norm(snapshot)  # rank 1 carried part of it: the lever changes the step
    with pytest.raises(ConfigError, match="not in the snapshot"):
        run_replay(replay_request(What(snapshot, mitigations={"drop_ranks": "2"}), how=How(nproc=1)))
    with pytest.raises(ConfigError, match="leave no saved rank"):
        run_replay(replay_request(What(snapshot, mitigations={"drop_ranks": "0,1"}), how=How(nproc=1)))


def test_recomputing_stale_old_log_probs_gives_back_the_sound_step(tmp_path: Path) -> None:
    sound = copy_fixture(tmp_path / "sound")
    no_mismatch(sound)
    set_loss(sound, is_base_logprobs="old")
    stale = copy_fixture(tmp_path / "stale")
    no_mismatch(stale)
    set_loss(stale, is_base_logprobs="old")
    stale_old_logprobs(stale, rank=1)
    spike, healthy = _norm(stale), _norm(sound)
    assert spike > 20 * healthy  # the stale rank makes the spike
    assert _norm(stale, recompute="old_logprobs:rank1") == pytest.approx(healthy, rel=1e-5)
    assert _norm(stale, recompute="old_logprobs:rank0") == pytest.approx(spike, rel=1e-5)  # the sound rank: no change


def test_recomputing_a_shifted_routing_payload_with_its_old_log_probs_gives_back_the_sound_step(tmp_path: Path) -> None:
    sound = copy_fixture(tmp_path / "sound")
    shifted = copy_fixture(tmp_path / "shifted")
    shift_routes(shifted, rank=1)
    healthy, broken = _norm(sound), _norm(shifted)
    assert abs(broken - healthy) > 0.01 * healthy  # the shifted payload changes the step
    both = _norm(shifted, recompute="routes:rank1,old_logprobs:rank1")
    assert both == pytest.approx(healthy, rel=1e-5)
    with pytest.raises(ConfigError, match="MoE layers"):
        run_replay(replay_request(What(shifted, mitigations={"recompute": "routes:rank1:layer7"}), how=How(nproc=1)))
