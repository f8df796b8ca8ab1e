"""Legacy snapshots (AXRL keys in `metadata.json`) get a temporary replay dir; the original is never touched.

The replay dir holds a hardlink to every file of the snapshot except `metadata.json`, a restored
checkpoint `metadata.json` and the AXRL metadata as `axrl_metadata.json`. Where a hardlink is
impossible (the temp dir is on another filesystem) a symlink is made instead: replay only reads,
and a snapshot of hundreds of GB is never copied. New files are written, never written through a
link, so the snapshot's own files cannot change. The caller removes the replay dir when done
(`shutil.rmtree` removes the links only).

A snapshot file that is a symlink out of the snapshot is refused, never linked (the rule of every snapshot
reader, `containment.file_inside`). The replay dir is private (0700) and marked as links into the snapshot
(`containment.link_into`): readers follow its symlinks into that snapshot and nowhere else.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from axrl_spike_replay.errors import AxrlError, SnapshotError
from axrl_spike_replay.files.atomic import atomic_write_json
from axrl_spike_replay.snapshot.layout import AXRL_METADATA, CHECKPOINT_METADATA, CHECKPOINT_METADATA_CONTENT
from axrl_spike_replay.snapshot.metadata import read_json_document, read_metadata
from axrl_spike_replay.snapshot.safe_load import inside_its_tree
from axrl_spike_replay.untrusted.containment import LINKS_INTO, link_into

_NO_LINK_ERRNOS = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


@dataclass
class PreparedSnapshot:
    """Where to replay `snapshot` from. For a current-layout snapshot `replay_dir` is the snapshot itself."""

    snapshot: str
    replay_dir: str
    legacy: bool
    linked_files: int = 0
    symlinked_files: int = 0
    message: str = ""


def _link(src: Path, dst: Path) -> bool:
    """Hardlink (True), or symlink where the filesystem cannot hardlink (False)."""
    try:
        os.link(src, dst)
        return True
    except OSError as exc:
        if exc.errno not in _NO_LINK_ERRNOS:
            raise SnapshotError(f"{src}: cannot link into the replay dir ({exc.strerror})") from None
    os.symlink(src.resolve(), dst)
    return False


def _fill(snapshot: Path, target: Path) -> tuple[int, int]:
    linked = symlinked = 0
    link_into(target, snapshot)  # what readers check the symlinks below against (containment.file_inside)
    for dirpath, _, names in os.walk(snapshot):
        rel_dir = Path(dirpath).relative_to(snapshot)
        (target / rel_dir).mkdir(parents=True, exist_ok=True)
        for name in names:
            rel = rel_dir / name
            if rel in (Path(CHECKPOINT_METADATA), Path(AXRL_METADATA), Path(LINKS_INTO)):
                continue  # replaced by new files, never written through a link
            # the file itself, never what a link out of the snapshot leads to (os.link would follow it)
            if _link(inside_its_tree(snapshot / rel, snapshot), target / rel):
                linked += 1
            else:
                symlinked += 1
    return linked, symlinked


def prepare_replay_dir(path: str | Path, dest: str | Path | None = None) -> PreparedSnapshot:
    """A replay dir for a legacy snapshot (under `dest`, or a new temp dir); a current one needs none."""
    snapshot = Path(os.path.abspath(path))
    _, legacy = read_metadata(snapshot)
    if not legacy:
        return PreparedSnapshot(
            snapshot=str(snapshot),
            replay_dir=str(snapshot),
            legacy=False,
            message=f"current layout ({AXRL_METADATA} present): nothing to prepare, replay reads it in place",
        )
    legacy_meta = snapshot / CHECKPOINT_METADATA
    doc = read_json_document(legacy_meta)  # bounded and parsed again; read_metadata validated its fields
    source = os.stat(legacy_meta)  # what is written from it is no more readable than it
    if dest is None:
        target = Path(tempfile.mkdtemp(prefix=f"axrl-replay-{snapshot.name}-"))  # private (0700)
    else:
        target = Path(os.path.abspath(dest))
        if target.resolve().is_relative_to(snapshot.resolve()):
            raise AxrlError(f"{target}: the replay dir must be outside the snapshot {snapshot}")
        if target.is_symlink() or (target.exists() and (not target.is_dir() or any(target.iterdir()))):
            raise AxrlError(f"{target}: replay dir must not exist or be empty")
        target.mkdir(parents=True, exist_ok=True)
        os.chmod(target, 0o700)  # private, as a temp one: readers follow its links only then (linked_tree)

    try:
        linked, symlinked = _fill(snapshot, target)
        atomic_write_json(target / CHECKPOINT_METADATA, CHECKPOINT_METADATA_CONTENT, copy_of=source)
        atomic_write_json(target / AXRL_METADATA, doc, copy_of=source)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)  # only links and files we wrote
        raise
    how = f"{linked} hardlinked" + (f", {symlinked} symlinked (other filesystem)" if symlinked else "")
    return PreparedSnapshot(
        snapshot=str(snapshot),
        replay_dir=str(target),
        legacy=True,
        linked_files=linked,
        symlinked_files=symlinked,
        message=(
            f"legacy layout (AXRL keys in {CHECKPOINT_METADATA}): replay dir with {how} files, a restored "
            f"checkpoint {CHECKPOINT_METADATA} and {AXRL_METADATA}; the snapshot was not touched"
        ),
    )
