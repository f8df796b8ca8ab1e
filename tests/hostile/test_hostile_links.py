"""Symlinks out of a snapshot: a snapshot file that leads out of its snapshot dir is refused by every reader, naming
the file, and nothing it leads to reaches a message, the task file or the report. Links between a snapshot's own
files, and the links of a legacy snapshot's replay dir on another filesystem, are followed (docs/safety.md)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hostile_helpers import FIXTURE_JOB, SNAPSHOT_NAME, assert_clear_refusal_or_success, run_cli, scene

SECRET = "Sup3rS3cretHashXYZ"
# what /etc/shadow holds: YAML reads each line as a key, so a run config that is this file has "unknown sections"
SHADOW = f"root:$6$salt${SECRET}:20228:0:99999:7:::\ndaemon:*:20228:0:99999:7:::\nbin:*:20228:0:99999:7:::\n"
JOB = "fixture-moe"

# every kind of snapshot file; the replay needs all but the grad info (its per-rank checks skip a file inspect
# reports), so it refuses the others
SNAPSHOT_FILES = (
    "axrl_metadata.json",
    "run_config.yaml",
    "batch_rank0.pt",
    "grad_info_rank1.pt",
    "routing_payload_rank0.pt",
    ".metadata",
    "__0_0.distcp",
)


def _link_out(snapshot: Path, name: str, outside: Path) -> Path:
    """Move the snapshot's `name` outside and leave a symlink to it: the same bytes, read through a link out."""
    target = outside / f"moved-{name.lstrip('.')}"
    shutil.move(snapshot / name, target)
    (snapshot / name).symlink_to(target)
    return target


@pytest.mark.parametrize("name", SNAPSHOT_FILES)
def test_a_snapshot_file_that_links_out_is_refused_by_name(name: str) -> None:
    with scene() as world:
        _link_out(world.snapshot, name, world.outside)
        inspected = run_cli("inspect", world.snapshot, "--json")
        assert_clear_refusal_or_success(inspected, name)
        said = inspected.err + inspected.out
        assert f"{name}: leads to {world.outside}" in said and "never followed" in said, said[-2000:]
        replayed = run_cli("replay", world.snapshot, "--workspace", world.workspace)
        assert_clear_refusal_or_success(replayed, name)
        if not name.startswith("grad_info"):
            assert replayed.code == 2 and "never followed" in replayed.err, (replayed.out[-999:], replayed.err[-999:])


def test_a_run_config_linked_to_a_secret_file_leaks_nothing_into_messages_or_the_record() -> None:
    with scene() as world:
        shadow = world.outside / "shadow"
        shadow.write_text(SHADOW)
        shadow.chmod(0o600)
        (world.snapshot / "run_config.yaml").unlink()
        (world.snapshot / "run_config.yaml").symlink_to(shadow)
        ws = ("--workspace", world.workspace)
        said = [run_cli("inspect", world.snapshot), run_cli("replay", world.snapshot, *ws)]
        said.append(run_cli("task", "open", JOB, "--snapshot", world.snapshot, *ws))
        said += [run_cli("diagnose", world.snapshot, *ws), run_cli("report", JOB, *ws)]
        for outcome in said:
            assert SECRET not in outcome.out + outcome.err and "root:" not in outcome.out + outcome.err
        assert any("run_config.yaml: leads to" in o.out + o.err for o in said)
        for path in world.workspace.rglob("*"):
            if path.is_file():
                text = path.read_text(errors="replace")
                assert SECRET not in text and "root:$6$" not in text, path


def test_a_file_that_is_not_a_run_config_is_not_quoted_in_the_refusal() -> None:
    """The file itself inside the snapshot (no link): the refusal names its sections only where they are plain
    names, each a few dozen characters at most, never a line of it."""
    with scene() as world:
        (world.snapshot / "run_config.yaml").write_text(SHADOW + "model: {}\nextra_section: 1\n")
        outcome = run_cli("replay", world.snapshot, "--workspace", world.workspace)
        assert outcome.code == 2
        assert SECRET not in outcome.err and "root:" not in outcome.err and "daemon:" not in outcome.err
        assert "unknown sections ['extra_section'] and 3 not shown (not plain names)" in outcome.err


def test_links_between_a_snapshots_own_files_are_followed() -> None:
    with scene() as world:
        kept = world.snapshot / "kept"
        kept.mkdir()
        for name in ("batch_rank1.pt", "run_config.yaml"):
            shutil.move(world.snapshot / name, kept / name)
            (world.snapshot / name).symlink_to(Path("kept") / name)
        outcome = run_cli("inspect", world.snapshot, "--json")
        assert outcome.code == 0 and '"problems": []' in outcome.out.replace("\n", "").replace("  ", ""), outcome.out


def _other_filesystem_than_tmp() -> Path | None:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and os.stat(shm).st_dev != os.stat(tempfile.gettempdir()).st_dev:
        return shm
    return None


@pytest.mark.skipif(_other_filesystem_than_tmp() is None, reason="needs /dev/shm on another filesystem than /tmp")
def test_a_legacy_replay_dir_of_symlinks_is_read_and_a_link_out_of_the_legacy_snapshot_is_refused() -> None:
    """A legacy snapshot on another filesystem than the temp dir: its replay dir holds symlinks into it (hardlinks
    cannot cross), which every reader follows into that snapshot and nowhere else."""
    from axrl_spike_replay.errors import SnapshotError
    from axrl_spike_replay.snapshot.legacy import prepare_replay_dir
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch

    legacy = FIXTURE_JOB.parent / "fx~fixture-legacy__actor" / "checkpoints" / "spike_snapshots" / SNAPSHOT_NAME
    with tempfile.TemporaryDirectory(dir=_other_filesystem_than_tmp()) as tmp:
        snapshot = Path(shutil.copytree(legacy, Path(tmp) / SNAPSHOT_NAME))
        prepared = prepare_replay_dir(snapshot)
        try:
            assert prepared.symlinked_files > 0 and prepared.linked_files == 0, prepared.message
            assert load_rank_batch(prepared.replay_dir, 0)["tokens"].numel() > 0
        finally:
            shutil.rmtree(prepared.replay_dir)
        secret = Path(tmp) / "secret.pt"
        shutil.move(snapshot / "batch_rank0.pt", secret)
        (snapshot / "batch_rank0.pt").symlink_to(secret)
        with pytest.raises(SnapshotError, match=r"batch_rank0\.pt: leads to .*secret\.pt, outside"):
            prepare_replay_dir(snapshot)
