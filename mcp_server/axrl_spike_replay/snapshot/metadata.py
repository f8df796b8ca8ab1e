"""AXRL replay metadata (`axrl_metadata.json`), including snapshots that wrote it to `metadata.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.layout import AXRL_METADATA, CHECKPOINT_METADATA, FORMAT_VERSION

# Keys that mark `metadata.json` as AXRL metadata (legacy layout) rather than the checkpoint's own.
_AXRL_MARKER_KEYS = ("iteration", "grad_norm", "spike_ratio", "parallel", "job_name")


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1


@dataclass(frozen=True)
class DetectorSpec:
    kind: str = "median_ratio"
    window: int = 20
    threshold: float = 5.0


@dataclass(frozen=True)
class AxrlMetadata:
    job_name: str
    role: str
    iteration: int
    grad_norm: float
    median_norm: float
    spike_ratio: float
    detector: DetectorSpec = field(default_factory=DetectorSpec)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    created_at: str = ""
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        """The `axrl_metadata.json` document."""
        doc = asdict(self)
        return {"format_version": doc.pop("format_version"), **doc}

    @classmethod
    def from_json(cls, doc: dict[str, Any], source: Path | str) -> AxrlMetadata:
        """Parse and validate; errors name `source` and the offending key."""
        try:
            parallel = ParallelLayout(**{k: int(v) for k, v in (doc.get("parallel") or {}).items()})
            detector = DetectorSpec(**(doc.get("detector") or {}))
            grad_norm = float(doc["grad_norm"])
            median_norm = float(doc.get("median_norm", 0.0))
            spike_ratio = doc.get("spike_ratio")
            if spike_ratio is None:
                spike_ratio = grad_norm / median_norm if median_norm else float("inf")
            return cls(
                job_name=str(doc.get("job_name", "")),
                role=str(doc.get("role", "actor")),
                iteration=int(doc["iteration"]),
                grad_norm=grad_norm,
                median_norm=median_norm,
                spike_ratio=float(spike_ratio),
                detector=detector,
                parallel=parallel,
                created_at=str(doc.get("created_at", "")),
                format_version=int(doc.get("format_version", FORMAT_VERSION)),
            )
        except KeyError as exc:
            raise SnapshotError(f"{source}: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise SnapshotError(f"{source}: invalid value ({exc})") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(doc, dict):
        raise SnapshotError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def is_legacy_layout(snapshot_dir: Path) -> bool:
    """True when the AXRL keys sit in `metadata.json` (and no `axrl_metadata.json` exists)."""
    if (snapshot_dir / AXRL_METADATA).is_file():
        return False
    checkpoint_meta = snapshot_dir / CHECKPOINT_METADATA
    if not checkpoint_meta.is_file():
        return False
    doc = _read_json(checkpoint_meta)
    return any(key in doc for key in _AXRL_MARKER_KEYS)


def read_metadata(snapshot_dir: str | Path) -> tuple[AxrlMetadata, bool]:
    """(metadata, legacy) of a snapshot directory."""
    directory = Path(snapshot_dir)
    if not directory.is_dir():
        raise SnapshotError(f"{directory}: snapshot directory not found")
    current = directory / AXRL_METADATA
    if current.is_file():
        return AxrlMetadata.from_json(_read_json(current), current), False
    if is_legacy_layout(directory):
        legacy = directory / CHECKPOINT_METADATA
        return AxrlMetadata.from_json(_read_json(legacy), legacy), True
    raise SnapshotError(
        f"{directory}: no {AXRL_METADATA} (and {CHECKPOINT_METADATA} holds no AXRL keys): not a spike snapshot"
    )
