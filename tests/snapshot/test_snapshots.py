"""An engineer lists an output dir's snapshots: which are retained, which preserved, how big, how spiky."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.snapshot.layout import PRESERVED_DIR, SNAPSHOTS_DIR
from axrl_spike_replay.snapshot.listing import list_snapshots
from axrl_spike_replay.snapshot.preservation.preserve import preserve


def test_lists_retained_and_preserved_snapshots_and_ignores_half_written_ones(make_output_dir) -> None:
    out = make_output_dir()
    preserve(out, 42)
    (out / SNAPSHOTS_DIR / ".iter_0000043.writing").mkdir()  # a snapshot still being written
    (out / PRESERVED_DIR / ".iter_0000041.preserving").mkdir()  # an interrupted preserve

    listing = list_snapshots(out)

    seen = [(s.iteration, s.preserved) for s in listing.snapshots]
    assert seen == [(41, False), (42, False), (42, True)]
    retained = listing.snapshots[1]
    assert retained.path == str(out / SNAPSHOTS_DIR / "iter_0000042")
    assert retained.spike_ratio == pytest.approx(20.0)
    files = [p for p in Path(retained.path).rglob("*") if p.is_file()]
    assert retained.bytes == sum(p.stat().st_size for p in files) > 0


def test_golden_capture_json(golden_outputs: Path, cli) -> None:
    run = cli("snapshots", golden_outputs / "fx~fixture-moe__actor", "--json")
    assert run.code == 0
    doc = run.json()
    on_disk = sorted(int(p.name[5:]) for p in (golden_outputs / "fx~fixture-moe__actor" / SNAPSHOTS_DIR).glob("iter_*"))
    assert [s["iteration"] for s in doc["snapshots"]] == on_disk != []
    for entry in doc["snapshots"]:
        assert set(entry) >= {"iteration", "path", "bytes", "spike_ratio", "preserved"}
        assert entry["preserved"] is False and entry["spike_ratio"] > 5


def test_the_table_lists_the_worst_snapshot_first(golden_outputs: Path, cli) -> None:
    """As the README says: worst first (the order to investigate), or by iteration when asked."""
    out = golden_outputs / "fx~fixture-moe__actor"

    def table_rows(*flags: str) -> list[tuple[int, float]]:
        lines = cli("snapshots", out, *flags).out.split("\n\n")[0].splitlines()[2:]
        return [(int(line.split()[0]), float(line.split()[2])) for line in lines]

    worst_first = table_rows()
    assert len(worst_first) >= 2 and [r for _, r in worst_first] == sorted((r for _, r in worst_first), reverse=True)
    assert worst_first[0][0] == cli("snapshots", out, "--json").json()["ranking"][0]["iteration"]
    assert [i for i, _ in table_rows("--by-iteration")] == sorted(i for i, _ in worst_first)
    assert [i for i, _ in worst_first] != sorted(i for i, _ in worst_first)  # the fixture's worst is not its first


def test_unreadable_metadata_is_reported_not_fatal(make_output_dir) -> None:
    out = make_output_dir()
    (out / SNAPSHOTS_DIR / "iter_0000041" / "axrl_metadata.json").write_text("{ not json")
    listing = list_snapshots(out)
    broken = listing.snapshots[0]
    assert broken.spike_ratio is None and "not valid JSON" in (broken.problem or "")
    assert listing.snapshots[1].problem is None


def test_missing_output_dir_is_a_clear_error(tmp_path: Path, cli) -> None:
    with pytest.raises(AxrlError, match="output directory not found"):
        list_snapshots(tmp_path / "nope")
    run = cli("snapshots", tmp_path / "nope")
    assert run.code == 2 and "nope: output directory not found" in run.err


def test_an_iteration_dir_symlinked_out_of_the_tree_is_listed_as_skipped(make_output_dir, tmp_path: Path, cli) -> None:
    out = make_output_dir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "big.bin").write_bytes(b"x" * 4096)
    (out / SNAPSHOTS_DIR / "iter_0000099").symlink_to(outside, target_is_directory=True)

    listing = list_snapshots(out)

    assert [s.iteration for s in listing.snapshots] == [41, 42]
    (skipped,) = listing.skipped
    assert skipped.iteration == 99 and skipped.path == str(out / SNAPSHOTS_DIR / "iter_0000099")
    assert f"is a symlink to {outside}" in skipped.reason and "not followed" in skipped.reason
    run = cli("snapshots", out)
    assert run.code == 0 and "skipped" in run.out and "iter_0000099" in run.out


def test_metadata_symlinked_out_of_the_snapshot_is_not_read(make_output_dir, tmp_path: Path) -> None:
    out = make_output_dir()
    snapshot = out / SNAPSHOTS_DIR / "iter_0000041"
    elsewhere = tmp_path / "someone-elses.json"
    elsewhere.write_text((snapshot / "axrl_metadata.json").read_text())
    (snapshot / "axrl_metadata.json").unlink()
    (snapshot / "axrl_metadata.json").symlink_to(elsewhere)

    entry = list_snapshots(out).snapshots[0]

    assert entry.iteration == 41 and entry.spike_ratio is None
    assert "is a symlink to" in (entry.problem or "") and "not read" in (entry.problem or "")


def test_a_log_symlinked_out_of_the_output_dir_is_not_followed(make_output_dir, tmp_path: Path) -> None:
    from axrl_spike_replay.snapshot.discovery import find_logs

    out = make_output_dir()
    elsewhere = tmp_path / "someone-elses.log"
    elsewhere.write_text("step=1 grad_norm=1.0\n")
    (out / "logs" / "planted.log").symlink_to(elsewhere)
    (out / "logs" / "alias.log").symlink_to(out / "logs" / "train.log")  # inside: fine

    assert [p.name for p in find_logs(out)] == ["alias.log", "train.log"]


def test_snapshots_are_ranked_largest_ratio_first_with_a_reason(fixture_outputs: Path, tmp_path: Path, cli) -> None:
    out = tmp_path / "run~job__actor"
    shutil.copytree(fixture_outputs / "fx~fixture-moe__actor", out)
    assert cli("preserve", out, "--iteration", "20").code == 0
    doc = cli("snapshots", out, "--json").json()
    ranking = doc["ranking"]
    assert [r["iteration"] for r in ranking] == [21, 20]  # 150.2x before 46.65x
    assert ranking[0]["order"] == 1 and "start here" in ranking[0]["reason"]
    assert "confirm" in ranking[1]["reason"]
    assert "spike_snapshots-active" in ranking[1]["path"]  # the preserved copy stands for its iteration


def test_a_snapshot_with_unusable_metadata_is_ranked_last_with_the_problem(fixture_outputs: Path, tmp_path: Path, cli):
    out = tmp_path / "run~job__actor"
    shutil.copytree(fixture_outputs / "fx~fixture-moe__actor", out)
    (out / "checkpoints" / "spike_snapshots" / "iter_0000021" / "axrl_metadata.json").write_text("{")
    ranking = cli("snapshots", out, "--json").json()["ranking"]
    assert [r["iteration"] for r in ranking] == [20, 21]
    assert ranking[1]["spike_ratio"] is None and "metadata not usable" in ranking[1]["reason"]


def test_a_step_whose_grad_norm_is_not_finite_is_ranked_first_and_said_to_be_non_finite() -> None:
    from axrl_spike_replay.snapshot.listing import SnapshotEntry, rank_snapshots

    def entry(iteration: int, ratio: float) -> SnapshotEntry:
        return SnapshotEntry(iteration, f"/out/iter_{iteration:07d}", 1, ratio, False, grad_norm=ratio)

    ranked = rank_snapshots([entry(20, 7.5), entry(21, float("nan")), entry(22, 12.0)])
    assert [r.iteration for r in ranked] == [21, 22, 20]
    assert ranked[0].reason == "start here: a non-finite grad norm (NaN or inf), the largest spike"
    assert ranked[1].reason == "spike ratio 12x the median: confirm the diagnosis and the method on it"
