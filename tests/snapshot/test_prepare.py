"""The replay engine asks for a replay dir: a legacy snapshot (AXRL keys in metadata.json) gets a
temporary one with hardlinks and restored metadata; a current one needs nothing; the original is untouched."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.snapshot.dcp.checkpoint import summarize_checkpoint
from axrl_spike_replay.snapshot.layout import AXRL_METADATA, CHECKPOINT_METADATA, CHECKPOINT_METADATA_CONTENT
from axrl_spike_replay.snapshot.legacy import prepare_replay_dir
from axrl_spike_replay.snapshot.metadata import read_metadata


def _fingerprint(directory: Path) -> dict[str, tuple[str, int, int]]:
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        st = path.stat()
        out[path.name] = (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_ino, st.st_mtime_ns)
    return out


@pytest.fixture
def legacy_copy(golden_legacy_snapshot: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "snap" / golden_legacy_snapshot.name
    shutil.copytree(golden_legacy_snapshot, dest)
    return dest


def test_legacy_snapshot_gets_a_replay_dir_of_hardlinks_and_restored_metadata(
    legacy_copy: Path, tmp_path: Path
) -> None:
    before = _fingerprint(legacy_copy)
    legacy_doc = json.loads((legacy_copy / CHECKPOINT_METADATA).read_text())

    prepared = prepare_replay_dir(legacy_copy, tmp_path / "replay")

    replay = Path(prepared.replay_dir)
    assert prepared.legacy is True and replay == tmp_path / "replay"
    assert json.loads((replay / CHECKPOINT_METADATA).read_text()) == CHECKPOINT_METADATA_CONTENT
    assert json.loads((replay / AXRL_METADATA).read_text()) == legacy_doc
    for name in before:
        if name != CHECKPOINT_METADATA:
            assert (replay / name).stat().st_ino == (legacy_copy / name).stat().st_ino, name
    assert prepared.linked_files == len(before) - 1 and prepared.symlinked_files == 0
    meta, legacy = read_metadata(replay)
    assert legacy is False and meta.iteration == legacy_doc["iteration"]
    assert summarize_checkpoint(replay).tensors > 0
    assert _fingerprint(legacy_copy) == before  # the original is untouched


def test_default_replay_dir_is_a_new_temp_dir(legacy_copy: Path, cli) -> None:
    run = cli("prepare", legacy_copy, "--json")
    assert run.code == 0
    doc = run.json()
    try:
        assert doc["legacy"] is True and Path(doc["replay_dir"]).is_dir()
        assert Path(doc["replay_dir"]) != legacy_copy and "axrl-replay-" in doc["replay_dir"]
    finally:
        shutil.rmtree(doc["replay_dir"])
    assert legacy_copy.is_dir()


def test_current_snapshot_needs_nothing(golden_snapshot: Path, cli) -> None:
    run = cli("prepare", golden_snapshot, "--json")
    assert run.code == 0
    doc = run.json()
    assert doc["legacy"] is False and doc["replay_dir"] == str(golden_snapshot)
    assert "nothing to prepare" in cli("prepare", golden_snapshot).out


def test_symlinks_where_hardlinks_are_impossible(
    legacy_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stand-in for a temp dir on another filesystem: os.link raises EXDEV as the kernel does across mounts.
    def no_links(src: object, dst: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))

    monkeypatch.setattr(os, "link", no_links)
    prepared = prepare_replay_dir(legacy_copy, tmp_path / "replay")
    replay = Path(prepared.replay_dir)
    assert prepared.linked_files == 0 and prepared.symlinked_files > 0
    assert (replay / "batch_rank0.pt").is_symlink()
    assert (replay / "batch_rank0.pt").resolve() == (legacy_copy / "batch_rank0.pt").resolve()
    assert not (replay / CHECKPOINT_METADATA).is_symlink()


def test_refuses_a_non_empty_dest(legacy_copy: Path, tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(AxrlError, match="must not exist or be empty"):
        prepare_replay_dir(legacy_copy, busy)
    before = sorted(p.name for p in legacy_copy.iterdir())
    with pytest.raises(AxrlError, match="outside the snapshot"):
        prepare_replay_dir(legacy_copy, legacy_copy / "inner")
    assert sorted(p.name for p in legacy_copy.iterdir()) == before


def test_the_replay_dirs_metadata_is_no_more_readable_than_the_snapshots(legacy_copy: Path, tmp_path: Path) -> None:
    (legacy_copy / CHECKPOINT_METADATA).chmod(0o600)
    prepared = prepare_replay_dir(legacy_copy, tmp_path / "replay")
    for name in (CHECKPOINT_METADATA, AXRL_METADATA):
        assert oct(os.stat(Path(prepared.replay_dir) / name).st_mode & 0o777) == oct(0o600), name
