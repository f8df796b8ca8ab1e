"""Two runs' snapshots of one iteration: `iter_<N>` and `iter_<N>-<run id>` (a restarted run, the verl hook) are
listed, ranked, preserved and released as two snapshots, each preserved copy under its own name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.snapshot.layout import (
    PRESERVE_MARKER,
    PRESERVED_DIR,
    SNAPSHOTS_DIR,
    iteration_dir_name,
    parse_snapshot_name,
)
from axrl_spike_replay.snapshot.listing import list_snapshots
from axrl_spike_replay.snapshot.preservation.preserve import preserve, release
from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot
from axrl_spike_replay.workspace.task_record.preserved_copies import copy_of, source_of

TAGGED = "iter_0000041-20250102T030405Z-9f3a"


@pytest.fixture
def two_runs(make_output_dir) -> Path:
    """The synthetic output dir (iterations 41 and 42) plus a restarted run's snapshot of iteration 41."""
    out = make_output_dir()
    written = write_synthetic_snapshot(out / SNAPSHOTS_DIR, SyntheticSpec(iteration=41, seed=7, grad_norm=90.0))
    assert written.name == "iter_0000041-2"  # no run id: the writer took the next free name, never the old one
    written.rename(written.parent / TAGGED)  # what a guard with a run id names it
    return out


def test_names_carry_an_optional_tag() -> None:
    assert iteration_dir_name(41, "run-b") == "iter_0000041-run-b"
    assert parse_snapshot_name(TAGGED) == (41, "20250102T030405Z-9f3a")
    assert parse_snapshot_name("iter_0000041") == (41, None)
    for bad in ("iter_0000041-", "iter_0000041-/x", "iter_0000041-a b", "iter_0000041-" + "x" * 65, "iter_-1"):
        assert parse_snapshot_name(bad) is None, bad
    with pytest.raises(ValueError, match="tag"):
        iteration_dir_name(41, "../x")


def test_both_runs_snapshots_of_an_iteration_are_listed_and_ranked(two_runs: Path, cli) -> None:
    listing = list_snapshots(two_runs)
    assert [Path(s.path).name for s in listing.snapshots] == ["iter_0000041", TAGGED, "iter_0000042"]
    assert [s.iteration for s in listing.snapshots] == [41, 41, 42]
    assert len(listing.ranking) == 3 and Path(listing.ranking[0].path).name == TAGGED  # the largest ratio first
    doc = cli("snapshots", two_runs, "--json").json()
    assert [Path(s["path"]).name for s in doc["snapshots"]] == ["iter_0000041", TAGGED, "iter_0000042"]


def test_preserving_an_iteration_keeps_each_run_s_snapshot_under_its_own_name(two_runs: Path) -> None:
    result = preserve(two_runs, 41)
    assert sorted(Path(c.path).name for c in result.preserved) == ["iter_0000041", TAGGED]
    marker = json.loads((two_runs / PRESERVED_DIR / TAGGED / PRESERVE_MARKER).read_text())
    assert (marker["iteration"], marker["name"]) == (41, TAGGED)
    again = preserve(two_runs, 41)
    assert [c.status for c in again.preserved] == ["already_preserved", "already_preserved"]
    assert [c.status for c in preserve(two_runs, name=TAGGED).preserved] == ["already_preserved"]


def test_release_by_name_leaves_the_other_run_s_copy(two_runs: Path) -> None:
    preserve(two_runs, 41)
    released = release(two_runs, name=TAGGED)
    assert [Path(c.path).name for c in released.released] == [TAGGED]
    assert (two_runs / PRESERVED_DIR / "iter_0000041").is_dir()
    with pytest.raises(AxrlError, match=rf"no preserved copy for snapshot {TAGGED} \(preserved: 41\)"):
        release(two_runs, name=TAGGED)
    assert [c.iteration for c in release(two_runs, 41).released] == [41]


def test_a_copy_renamed_to_another_run_is_refused(two_runs: Path) -> None:
    preserve(two_runs, name=TAGGED)
    active = two_runs / PRESERVED_DIR
    (active / TAGGED).rename(active / "iter_0000041-other")
    with pytest.raises(AxrlError, match="marker is for iteration 41, not iter_0000041-other"):
        release(two_runs, name="iter_0000041-other")


def test_an_investigation_s_copy_is_the_snapshot_s_own_name(two_runs: Path) -> None:
    snapshot = two_runs / SNAPSHOTS_DIR / TAGGED
    copy = copy_of(snapshot)
    assert copy is not None and copy["path"] == str(two_runs / PRESERVED_DIR / TAGGED) and copy["iteration"] == 41
    assert source_of(copy) == snapshot
