"""An engineer preserves snapshots before rotation deletes them: hardlinks, never data copies on one
filesystem; idempotent; the source is only read; a rotation mid-copy leaves nothing looking complete."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from axrl_spike_replay.capture.snapshot_writer import rotate_snapshots
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.files.atomic import current_umask
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
from axrl_spike_replay.snapshot.layout import PRESERVE_MARKER, PRESERVED_DIR, SNAPSHOTS_DIR
from axrl_spike_replay.snapshot.preservation.preserve import preserve


def _state(directory: Path) -> dict[str, tuple[str, int, int]]:
    """{relative path: (sha256, size, mtime_ns)} of every file: what 'never modifies' must keep."""
    state = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes()
        st = path.stat()
        state[str(path.relative_to(directory))] = (hashlib.sha256(data).hexdigest(), st.st_size, st.st_mtime_ns)
    return state


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def test_preserve_hardlinks_every_file_and_leaves_the_source_as_it_was(make_output_dir) -> None:
    out = make_output_dir()
    source = out / SNAPSHOTS_DIR / "iter_0000042"
    before = _state(out / SNAPSHOTS_DIR)

    result = preserve(out, 42)

    (copy,) = result.preserved
    target = out / PRESERVED_DIR / "iter_0000042"
    assert (copy.iteration, Path(copy.path), copy.status) == (42, target, "preserved")
    assert copy.linked_files == len(_files(source)) and copy.copied_files == 0
    for rel in _files(source):
        assert (target / rel).stat().st_ino == (source / rel).stat().st_ino  # same inode: no bytes copied
    assert _files(target) == sorted([*_files(source), PRESERVE_MARKER])
    marker = json.loads((target / PRESERVE_MARKER).read_text())
    assert marker["made_by"] == "axrl-spike-replay" and marker["iteration"] == 42
    assert marker["source"] == str(source.resolve()) and marker["files"] == _files(source)
    assert marker["created_at"]
    assert _state(out / SNAPSHOTS_DIR) == before
    assert result.failed == []


def test_preserve_defaults_to_every_retained_snapshot_and_is_idempotent(make_output_dir, cli) -> None:
    out = make_output_dir()
    first = cli("preserve", out, "--json")
    assert first.code == 0
    doc = first.json()
    assert [(p["iteration"], p["linked_files"] > 0, p["copied_files"]) for p in doc["preserved"]] == [
        (41, True, 0),
        (42, True, 0),
    ]
    assert set(doc["preserved"][0]) >= {"iteration", "path", "linked_files", "copied_files"}
    snapshot_state = _state(out / PRESERVED_DIR)

    again = cli("preserve", out, "--json").json()
    assert [(p["iteration"], p["status"], p["linked_files"]) for p in again["preserved"]] == [
        (41, "already_preserved", 0),
        (42, "already_preserved", 0),
    ]
    assert _state(out / PRESERVED_DIR) == snapshot_state
    assert "already preserved" in cli("preserve", out, "--iteration", "41").out


def test_a_preserved_copy_outlives_rotation_and_still_reads(make_output_dir) -> None:
    out = make_output_dir()
    preserve(out)
    rotate_snapshots(out / SNAPSHOTS_DIR, keep_last=1)  # the trainer rotates iteration 41 away
    assert not (out / SNAPSHOTS_DIR / "iter_0000041").exists()

    survivor = inspect_snapshot(out / PRESERVED_DIR / "iter_0000041")
    assert survivor.iteration == 41 and survivor.problems == []
    assert survivor.ranks[0].num_loss_tokens == 36


def _cross_fs_dir() -> Path | None:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != Path(__file__).stat().st_dev:
        return shm
    return None


def test_preserve_copies_for_real_across_filesystems(make_output_dir) -> None:
    """The preserved dir lives on another filesystem (tmpfs /dev/shm): links fail with EXDEV, files are copied."""
    other = _cross_fs_dir()
    out = make_output_dir()
    if other is None or other.stat().st_dev == out.stat().st_dev:
        pytest.skip("no second writable filesystem here (/dev/shm); covered by the EXDEV test below")
    elsewhere = Path(tempfile.mkdtemp(prefix="axrl-preserved-", dir=other))
    try:
        (out / PRESERVED_DIR).symlink_to(elsewhere, target_is_directory=True)
        (copy,) = preserve(out, 42).preserved
        source = out / SNAPSHOTS_DIR / "iter_0000042"
        assert copy.linked_files == 0 and copy.copied_files == len(_files(source))
        for rel in _files(source):
            assert (Path(copy.path) / rel).read_bytes() == (source / rel).read_bytes()
        assert inspect_snapshot(copy.path).problems == []
    finally:
        shutil.rmtree(elsewhere)


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o666])
def test_a_preserved_copy_is_never_more_readable_than_its_source_and_keeps_its_time(
    make_output_dir, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    """Copied (not linked) files get the source's permission bits less the umask, never a new file's default
    (0666 less the umask: 0644 for a 0600 source), and keep their modification time."""
    copied = mode & ~current_umask()
    out = make_output_dir()
    source = out / SNAPSHOTS_DIR / "iter_0000041"
    for rel in _files(source):
        (source / rel).chmod(mode)
    other = _cross_fs_dir()
    if other is not None and other.stat().st_dev != out.stat().st_dev:
        elsewhere = Path(tempfile.mkdtemp(prefix="axrl-preserved-", dir=other))
        (out / PRESERVED_DIR).symlink_to(elsewhere, target_is_directory=True)
    else:  # no second filesystem here: os.link fails as the kernel does across mounts
        elsewhere = None
        monkeypatch.setattr(os, "link", _no_links)
    try:
        (copy,) = preserve(out, 41).preserved
        assert copy.copied_files == len(_files(source))
        for rel in _files(source):
            made = (Path(copy.path) / rel).stat()
            assert oct(made.st_mode & 0o777) == oct(copied), rel
            assert made.st_mtime_ns == (source / rel).stat().st_mtime_ns, rel
    finally:
        if elsewhere is not None:
            shutil.rmtree(elsewhere)


def _no_links(src: object, dst: object, *args: object, **kwargs: object) -> None:
    raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))


def test_preserve_falls_back_to_copying_when_the_filesystem_refuses_links(
    make_output_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in for a second filesystem where the machine has none: os.link raises EXDEV exactly as the
    # kernel does across mounts (the real cross-filesystem case is the test above).
    def no_links(src: object, dst: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))

    out = make_output_dir()
    monkeypatch.setattr(os, "link", no_links)
    (copy,) = preserve(out, 41).preserved
    source = out / SNAPSHOTS_DIR / "iter_0000041"
    assert copy.linked_files == 0 and copy.copied_files == len(_files(source))
    for rel in _files(source):
        assert (Path(copy.path) / rel).stat().st_ino != (source / rel).stat().st_ino
        assert (Path(copy.path) / rel).read_bytes() == (source / rel).read_bytes()


def test_rotation_mid_copy_is_reported_and_leaves_nothing_that_looks_complete(
    make_output_dir, monkeypatch: pytest.MonkeyPatch, cli
) -> None:
    # The trainer's real rotation runs while preserve links files: os.link is wrapped only to pick the
    # moment (after the third file), because two processes cannot be interleaved deterministically.
    out = make_output_dir()
    real_link = os.link
    calls = []

    def link_then_rotate(src: object, dst: object, *args: object, **kwargs: object) -> None:
        calls.append(src)
        if len(calls) == 3:
            rotate_snapshots(out / SNAPSHOTS_DIR, keep_last=1)  # deletes iteration 41 under our feet
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link_then_rotate)
    run = cli("preserve", out, "--iteration", "41", "--json")

    assert run.code == 1
    doc = run.json()
    assert doc["preserved"] == []
    (failure,) = doc["failed"]
    assert failure["iteration"] == 41
    assert "rotated away" in failure["error"] and "nothing was preserved" in failure["error"]
    assert sorted(p.name for p in (out / PRESERVED_DIR).iterdir() if not p.name.endswith(".lock")) == []


def test_rotation_right_after_linking_keeps_a_complete_copy(make_output_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    out = make_output_dir()
    source = out / SNAPSHOTS_DIR / "iter_0000041"
    total = len(_files(source))
    real_link = os.link
    calls = []

    def link_then_rotate(src: object, dst: object, *args: object, **kwargs: object) -> None:
        real_link(src, dst, *args, **kwargs)
        calls.append(src)
        if len(calls) == total:
            rotate_snapshots(out / SNAPSHOTS_DIR, keep_last=1)

    monkeypatch.setattr(os, "link", link_then_rotate)
    (copy,) = preserve(out, 41).preserved
    assert not source.exists()
    assert copy.linked_files == total and inspect_snapshot(copy.path).problems == []


def test_an_unknown_iteration_or_a_foreign_dir_is_refused(make_output_dir, cli) -> None:
    out = make_output_dir()
    with pytest.raises(AxrlError, match=r"no retained snapshot for iteration 7 \(retained: 41, 42\)"):
        preserve(out, 7)
    foreign = out / PRESERVED_DIR / "iter_0000042"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("someone's own copy")

    run = cli("preserve", out, "--json")
    assert run.code == 1
    doc = run.json()
    assert [p["iteration"] for p in doc["preserved"]] == [41]
    assert "not made by axrl-spike-replay" in doc["failed"][0]["error"]
    assert _files(foreign) == ["notes.txt"]


def _outside_tree(tmp_path: Path) -> Path:
    """Someone else's files, outside the output dir: what a planted symlink points at."""
    outside = tmp_path / "someone-elses-files"
    (outside / "deep").mkdir(parents=True)
    (outside / "secret.txt").write_text("not a snapshot")
    (outside / "deep" / "more.txt").write_text("still not a snapshot")
    return outside


def test_an_iteration_dir_symlinked_out_of_the_tree_is_skipped_and_named(make_output_dir, tmp_path: Path, cli) -> None:
    out = make_output_dir()
    outside = _outside_tree(tmp_path)
    before = _state(outside)
    planted = out / SNAPSHOTS_DIR / "iter_0000099"
    planted.symlink_to(outside, target_is_directory=True)

    run = cli("preserve", out, "--json")

    assert run.code == 1
    doc = run.json()
    assert sorted(c["iteration"] for c in doc["preserved"]) == [41, 42]
    (failure,) = doc["failed"]
    assert failure["iteration"] == 99 and failure["source"] == str(planted)
    assert f"is a symlink to {outside}" in failure["error"] and "not followed" in failure["error"]
    assert not (out / PRESERVED_DIR / "iter_0000099").exists()
    assert _state(outside) == before
    text = cli("preserve", out)
    assert "iter 99: FAILED" in text.out and "not followed" in text.out

    with pytest.raises(AxrlError, match=r"iter_0000099 is a symlink to .*not followed; nothing was preserved"):
        preserve(out, 99)


def test_files_symlinked_out_of_a_snapshot_are_neither_linked_nor_copied(make_output_dir, tmp_path: Path) -> None:
    out = make_output_dir()
    outside = _outside_tree(tmp_path)
    source = out / SNAPSHOTS_DIR / "iter_0000042"
    (source / "notes.txt").symlink_to(outside / "secret.txt")
    (source / "extra").symlink_to(outside / "deep", target_is_directory=True)
    (source / "alias_metadata.json").symlink_to(source / "axrl_metadata.json")  # inside: fine

    result = preserve(out, 42)

    (copy,) = result.preserved
    preserved = Path(copy.path)
    assert not (preserved / "notes.txt").exists() and not (preserved / "extra").exists()
    assert (preserved / "alias_metadata.json").read_bytes() == (source / "axrl_metadata.json").read_bytes()
    skipped = {Path(s.path).name: s.reason for s in result.skipped}
    assert set(skipped) == {"notes.txt", "extra"}
    assert f"is a symlink to {outside / 'secret.txt'}" in skipped["notes.txt"]
    assert "not linked or copied" in skipped["notes.txt"] and "not followed" in skipped["extra"]
    marker = json.loads((preserved / PRESERVE_MARKER).read_text())
    assert "notes.txt" not in marker["files"] and "alias_metadata.json" in marker["files"]
    assert inspect_snapshot(copy.path).problems == []


def test_a_required_file_symlinked_out_of_the_snapshot_fails_that_snapshot(make_output_dir, tmp_path: Path) -> None:
    out = make_output_dir()
    source = out / SNAPSHOTS_DIR / "iter_0000041"
    batch = source / "batch_rank0.pt"
    moved = tmp_path / "elsewhere-batch.pt"
    shutil.move(batch, moved)
    batch.symlink_to(moved)

    result = preserve(out)

    assert [c.iteration for c in result.preserved] == [42]
    (failure,) = result.failed
    assert failure.iteration == 41 and "incomplete without the skipped entries" in failure.error
    assert "no batch_rank<r>.pt for ranks [0]" in failure.error
    assert not (out / PRESERVED_DIR / "iter_0000041").exists()
    assert not list((out / PRESERVED_DIR).glob(".iter_0000041*"))


def test_an_output_dir_without_snapshots_is_left_as_it_was(tmp_path: Path) -> None:
    outside = tmp_path / "not-a-job"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    result = preserve(outside)
    assert result.preserved == [] and result.failed == []
    assert sorted(p.name for p in outside.rglob("*")) == ["precious.txt"]  # no preserved dir, no lock file
