"""Snapshot format v1: names of directories and files, and how to parse them."""

from __future__ import annotations

import re
from pathlib import Path

FORMAT_VERSION = 1

SNAPSHOTS_DIR = Path("checkpoints") / "spike_snapshots"
PRESERVED_DIR = Path("checkpoints") / "spike_snapshots-active"
# in a workspace, when the output root is not to be written: <workspace>/<this>/<output dir name>/iter_<N>
WORKSPACE_PRESERVED = Path("preserved-snapshots")

AXRL_METADATA = "axrl_metadata.json"
CHECKPOINT_METADATA = "metadata.json"
DCP_METADATA = ".metadata"
RUN_CONFIG = "run_config.yaml"
PRESERVE_MARKER = ".axrl_preserved.json"

# Megatron's `metadata.json` as megatron-core writes it (`dist_checkpointing.core.CheckpointingConfig`, 0.16.1): what
# our writer puts there, and what a legacy snapshot's replay dir restores (tests/megatron compares the two).
CHECKPOINT_METADATA_CONTENT = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}

# A snapshot dir is `iter_<N>` or `iter_<N>-<tag>`: the tag (a run id, say) keeps two runs' snapshots of one
# iteration apart. Matched with fullmatch: `$` would also accept a trailing newline.
_TAG = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_TAG_RE = re.compile(_TAG)
_ITER_RE = re.compile(rf"iter_(\d+)(?:-({_TAG}))?")
_RANK_FILE_RE = re.compile(r"(batch|grad_info|routing_payload)_rank(\d+)\.pt")
OUTPUT_DIR_RE = re.compile(r"(?P<run>.+?)~(?P<job>.+)__(?P<role>[A-Za-z0-9_.-]+)")


def iteration_dir_name(iteration: int, tag: str | None = None) -> str:
    """`iter_0000042` for iteration 42 (seven digits, like Megatron); `iter_0000042-<tag>` with a tag."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if tag is not None and not is_valid_tag(tag):
        raise ValueError(
            f"snapshot tag must match {_TAG} (a letter or digit, then letters, digits, . _ -), got {tag!r}"
        )
    return f"iter_{iteration:07d}" if tag is None else f"iter_{iteration:07d}-{tag}"


def is_valid_tag(tag: str) -> bool:
    """Whether `tag` can follow `iter_<N>-` in a snapshot dir name (up to 64 letters, digits, `.`, `_`, `-`)."""
    return _TAG_RE.fullmatch(tag) is not None


def parse_snapshot_name(name: str) -> tuple[int, str | None] | None:
    """(iteration, tag or None) of an `iter_<N>` or `iter_<N>-<tag>` directory name, else None."""
    match = _ITER_RE.fullmatch(name)
    return (int(match.group(1)), match.group(2)) if match else None


def parse_iteration(name: str) -> int | None:
    """Iteration number of an `iter_<N>` (or `iter_<N>-<tag>`) directory name, else None."""
    parsed = parse_snapshot_name(name)
    return parsed[0] if parsed else None


def snapshot_order(name: str) -> tuple[int, str]:
    """Sort key of snapshot dir names: by iteration, the untagged name first, then by tag."""
    parsed = parse_snapshot_name(name)
    return (parsed[0], parsed[1] or "") if parsed else (-1, name)


def batch_file(rank: int) -> str:
    return f"batch_rank{rank}.pt"


def grad_info_file(rank: int) -> str:
    return f"grad_info_rank{rank}.pt"


def routing_payload_file(rank: int) -> str:
    return f"routing_payload_rank{rank}.pt"


def rank_files(snapshot_dir: Path) -> dict[str, dict[int, Path]]:
    """Per-rank files present: {"batch": {rank: path}, "grad_info": {...}, "routing_payload": {...}}."""
    found: dict[str, dict[int, Path]] = {"batch": {}, "grad_info": {}, "routing_payload": {}}
    for entry in snapshot_dir.iterdir():
        match = _RANK_FILE_RE.fullmatch(entry.name)
        if match:
            found[match.group(1)][int(match.group(2))] = entry
    return {kind: dict(sorted(files.items())) for kind, files in found.items()}


def parse_output_dir_name(name: str) -> tuple[str, str, str] | None:
    """(run, job_name, role) of an output dir named `<run>~<job_name>__<role>`, else None."""
    match = OUTPUT_DIR_RE.fullmatch(name)
    if not match:
        return None
    return match.group("run"), match.group("job"), match.group("role")
