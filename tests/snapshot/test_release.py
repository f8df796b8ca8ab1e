"""An engineer releases preserved copies when done; the tool deletes only copies it made itself."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.snapshot.layout import PRESERVE_MARKER, PRESERVED_DIR, SNAPSHOTS_DIR
from axrl_spike_replay.snapshot.preservation.preserve import preserve, release


def test_release_deletes_the_preserved_copy_and_nothing_else(make_output_dir, cli) -> None:
    out = make_output_dir()
    preserve(out)
    source_batch = out / SNAPSHOTS_DIR / "iter_0000042" / "batch_rank0.pt"
    assert source_batch.stat().st_nlink == 2

    run = cli("release", out, "--iteration", "42", "--json")

    assert run.code == 0
    doc = run.json()
    assert doc["released"] == [{"iteration": 42, "path": str(out / PRESERVED_DIR / "iter_0000042")}]
    assert not (out / PRESERVED_DIR / "iter_0000042").exists()
    assert (out / PRESERVED_DIR / "iter_0000041").is_dir()
    assert source_batch.stat().st_nlink == 1 and source_batch.read_bytes()  # the retained snapshot is whole
    assert sorted(p.name for p in (out / SNAPSHOTS_DIR).iterdir()) == ["iter_0000041", "iter_0000042"]

    rest = release(out)
    assert [c.iteration for c in rest.released] == [41] and rest.refused == []
    assert release(out).released == []  # nothing left: a no-op


def test_release_refuses_dirs_it_did_not_make(make_output_dir, cli) -> None:
    out = make_output_dir()
    preserve(out)
    active = out / PRESERVED_DIR
    # a hand-made copy without a marker
    shutil.copytree(out / SNAPSHOTS_DIR / "iter_0000041", active / "iter_0000007")
    # a copy someone added a file to
    (active / "iter_0000041" / "my_notes.txt").write_text("keep me")
    # a marker that names another tool
    other = active / "iter_0000042" / PRESERVE_MARKER
    other.write_text(json.dumps({**json.loads(other.read_text()), "made_by": "rsync"}))

    run = cli("release", out, "--json")

    assert run.code == 1
    refused = {Path(r["path"]).name: r["reason"] for r in run.json()["refused"]}
    assert set(refused) == {"iter_0000007", "iter_0000041", "iter_0000042"}
    assert "no readable .axrl_preserved.json marker" in refused["iter_0000007"]
    assert "my_notes.txt" in refused["iter_0000041"]
    assert "'rsync'" in refused["iter_0000042"]
    assert all((active / name).is_dir() for name in refused)

    with pytest.raises(AxrlError, match=r"refused to delete: .*not made by axrl-spike-replay"):
        release(out, 7)
    single = cli("release", out, "--iteration", "7")
    assert single.code == 2 and "refused to delete" in single.err and "Traceback" not in single.err


def test_a_marker_copied_onto_another_iteration_is_refused(make_output_dir) -> None:
    out = make_output_dir()
    preserve(out, 41)
    active = out / PRESERVED_DIR
    (active / "iter_0000041").rename(active / "iter_0000099")
    with pytest.raises(AxrlError, match="marker is for iteration 41, not iter_0000099"):
        release(out, 99)


def test_release_never_reaches_the_rotating_snapshots(make_output_dir) -> None:
    """Even when the preserved dir is a symlink onto the rotating dir and a marker was planted there."""
    out = make_output_dir()
    retained = out / SNAPSHOTS_DIR / "iter_0000042"
    files = sorted(p.name for p in retained.iterdir())
    (retained / PRESERVE_MARKER).write_text(
        json.dumps({"made_by": "axrl-spike-replay", "iteration": 42, "files": files})
    )
    (out / PRESERVED_DIR).symlink_to(out / SNAPSHOTS_DIR, target_is_directory=True)

    result = release(out)

    assert result.released == []
    assert any("not inside" in r.reason or "rotating" in r.reason for r in result.refused)
    assert retained.is_dir() and sorted(p.name for p in retained.iterdir()) == sorted([*files, PRESERVE_MARKER])


def test_release_of_a_missing_copy_names_what_is_there(make_output_dir) -> None:
    out = make_output_dir()
    preserve(out, 41)
    with pytest.raises(AxrlError, match=r"no preserved copy for iteration 42 \(preserved: 41\)"):
        release(out, 42)


BAD_MARKERS = {
    "iteration-a-word": lambda good: json.dumps({**good, "iteration": "twenty"}).encode(),
    "iteration-negative": lambda good: json.dumps({**good, "iteration": -5}).encode(),
    "iteration-null": lambda good: json.dumps({**good, "iteration": None}).encode(),
    "iteration-bool": lambda good: json.dumps({**good, "iteration": True}).encode(),
    "files-nested": lambda good: json.dumps({**good, "files": [[1]]}).encode(),
    "files-escaping": lambda good: json.dumps({**good, "files": ["../../etc/passwd"]}).encode(),
    "made-by-a-list": lambda good: json.dumps({**good, "made_by": ["axrl-spike-replay"]}).encode(),
    "a-list": lambda good: b"[1, 2, 3]",
    "not-json": lambda good: b"{ half a marker",
    "not-utf8": lambda good: b'{"made_by": "\xff\xfe"}',
    "nested-100k": lambda good: b"[" * 100_000 + b"]" * 100_000,
    "huge": lambda good: b'{"pad": "' + b"x" * (9 * 1024 * 1024) + b'"}',
}


@pytest.mark.parametrize("kind", sorted(BAD_MARKERS))
def test_one_corrupt_marker_is_refused_by_name_and_the_other_copies_proceed(make_output_dir, cli, kind: str) -> None:
    out = make_output_dir()
    preserve(out)
    marker = out / PRESERVED_DIR / "iter_0000041" / PRESERVE_MARKER
    good = json.loads(marker.read_text())
    marker.write_bytes(BAD_MARKERS[kind](good))

    # preserve again: the good copy is already there, the bad one is reported, nothing crashes
    again = cli("preserve", out, "--json")
    assert again.code == 1 and "Traceback" not in again.err
    assert [c["status"] for c in again.json()["preserved"]] == ["already_preserved"]
    assert "iter_0000041 exists but" in again.json()["failed"][0]["error"]

    run = cli("release", out, "--json")

    assert run.code == 1 and "Traceback" not in run.err
    doc = run.json()
    assert [c["iteration"] for c in doc["released"]] == [42]
    (refused,) = doc["refused"]
    assert refused["path"] == str(out / PRESERVED_DIR / "iter_0000041") and "marker" in refused["reason"]
    assert len(refused["reason"]) < 400  # bounded: never the marker's content
    assert (out / PRESERVED_DIR / "iter_0000041").is_dir() and not (out / PRESERVED_DIR / "iter_0000042").exists()
    single = cli("release", out, "--iteration", "41")
    assert single.code == 2 and "refused to delete" in single.err and "Traceback" not in single.err


def test_a_marker_that_is_a_symlink_or_a_pipe_is_not_followed(make_output_dir, tmp_path: Path) -> None:
    out = make_output_dir()
    preserve(out)
    copy41, copy42 = out / PRESERVED_DIR / "iter_0000041", out / PRESERVED_DIR / "iter_0000042"
    real = tmp_path / "planted.json"
    real.write_text((copy41 / PRESERVE_MARKER).read_text())
    (copy41 / PRESERVE_MARKER).unlink()
    (copy41 / PRESERVE_MARKER).symlink_to(real)
    (copy42 / PRESERVE_MARKER).unlink()
    os.mkfifo(copy42 / PRESERVE_MARKER)  # opening it for reading would wait forever

    result = release(out)

    assert result.released == []
    reasons = {Path(r.path).name: r.reason for r in result.refused}
    assert set(reasons) == {"iter_0000041", "iter_0000042"}
    assert "cannot be read" in reasons["iter_0000041"] and "not a regular file" in reasons["iter_0000042"]
