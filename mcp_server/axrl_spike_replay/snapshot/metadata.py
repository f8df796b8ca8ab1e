"""AXRL replay metadata (`axrl_metadata.json`), including snapshots that wrote it to `metadata.json`.

The file comes from shared storage: its size is bounded before it is read, it is parsed with a depth
and number guard, and every field used is type-checked; any problem is a SnapshotError naming the file.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown, shown_names
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.layout import AXRL_METADATA, CHECKPOINT_METADATA, FORMAT_VERSION
from axrl_spike_replay.untrusted.containment import file_inside
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError, read_bounded
from axrl_spike_replay.untrusted.untrusted_json import parse_untrusted_json

# Keys that mark `metadata.json` as AXRL metadata (legacy layout) rather than the checkpoint's own.
_AXRL_MARKER_KEYS = ("iteration", "grad_norm", "spike_ratio", "parallel", "job_name")

MAX_METADATA_BYTES = 1024 * 1024  # the document is a few hundred bytes; bounds what is read and parsed
MAX_JSON_DEPTH = 32  # the document nests two levels; Python's json recurses per level
MAX_PARALLEL_SIZE = 2**31 - 1  # world size and parallel degrees: torch.distributed ranks are int32
MAX_TEXT_CHARS = 1024  # job name, role, timestamps, detector kind
# Non-finite numbers are accepted only where the spike guard itself writes them: a NaN or inf grad
# norm is exactly the spike to investigate, and an empty window gives a NaN median and an inf ratio.
_NON_FINITE_OK = ("grad_norm", "median_norm", "spike_ratio")


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1

    @property
    def data_ranks(self) -> int:
        """How many ranks save a batch and grad info: every rank of a data-parallel layout, one per data-parallel
        rank when the model is split (TP, PP or CP > 1: the ranks of a model replica share its batch)."""
        return self.dp if self.tp * self.pp * self.cp > 1 else self.world_size


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
        median_norm = _number(doc, "median_norm", source, default=0.0)
        grad_norm = _number(doc, "grad_norm", source)
        spike_ratio = _number(doc, "spike_ratio", source, default=None)
        if spike_ratio is None:
            spike_ratio = grad_norm / median_norm if median_norm else float("inf")
        return cls(
            job_name=_text(doc, "job_name", source, ""),
            role=_text(doc, "role", source, "actor"),
            iteration=_integer(doc, "iteration", source, minimum=0),
            grad_norm=grad_norm,
            median_norm=median_norm,
            spike_ratio=spike_ratio,
            detector=_detector(doc.get("detector"), source),
            parallel=_parallel(doc.get("parallel"), source),
            created_at=_text(doc, "created_at", source, ""),
            format_version=_integer(doc, "format_version", source, minimum=1, default=FORMAT_VERSION),
        )


def _section(value: Any, name: str, source: Path | str, known: set[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SnapshotError(f"{source}: {name!r} must be an object, got {type(value).__name__} {shown(value, 60)}")
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise SnapshotError(f"{source}: {name}: unknown keys {shown_names(unknown)} (known: {sorted(known)})")
    return value


def _parallel(value: Any, source: Path | str) -> ParallelLayout:
    doc = _section(value, "parallel", source, {f.name for f in fields(ParallelLayout)})
    sizes = {key: _integer(doc, key, source, minimum=1, maximum=MAX_PARALLEL_SIZE, prefix="parallel.") for key in doc}
    return ParallelLayout(**sizes)


def _detector(value: Any, source: Path | str) -> DetectorSpec:
    doc = _section(value, "detector", source, {f.name for f in fields(DetectorSpec)})
    spec = DetectorSpec()
    kind = _text(doc, "kind", source, spec.kind, prefix="detector.")
    window = _integer(doc, "window", source, minimum=1, default=spec.window, prefix="detector.")
    threshold = _number(doc, "threshold", source, default=spec.threshold, prefix="detector.")
    if not math.isfinite(threshold):
        raise SnapshotError(f"{source}: detector.threshold must be a finite number, got {threshold}")
    return DetectorSpec(kind=kind, window=window, threshold=threshold)


_MISSING: Any = object()


def _get(doc: dict[str, Any], key: str, source: Path | str, default: Any, prefix: str) -> Any:
    if key in doc and doc[key] is not None:
        return doc[key]
    if default is _MISSING:
        raise SnapshotError(f"{source}: missing key {prefix + key!r}")
    return default


def _integer(
    doc: dict[str, Any],
    key: str,
    source: Path | str,
    *,
    minimum: int,
    maximum: int = 2**63 - 1,
    default: Any = _MISSING,
    prefix: str = "",
) -> int:
    value = _get(doc, key, source, default, prefix)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SnapshotError(
            f"{source}: {prefix}{key} must be an integer, got {type(value).__name__} {shown(value, 60)}"
        )
    if not minimum <= value <= maximum:
        raise SnapshotError(f"{source}: {prefix}{key} must be in [{minimum}, {maximum}], got {shown(value, 60)}")
    return value


def _number(doc: dict[str, Any], key: str, source: Path | str, *, default: Any = _MISSING, prefix: str = "") -> Any:
    value = _get(doc, key, source, default, prefix)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SnapshotError(f"{source}: {prefix}{key} must be a number, got {type(value).__name__} {shown(value, 60)}")
    value = float(value)  # ints are at most MAX_JSON_INT_DIGITS digits: this cannot overflow
    if not math.isfinite(value) and (prefix or key not in _NON_FINITE_OK):
        raise SnapshotError(f"{source}: {prefix}{key} must be a finite number, got {value}")
    return value


def _text(doc: dict[str, Any], key: str, source: Path | str, default: str, prefix: str = "") -> str:
    value = _get(doc, key, source, default, prefix)
    if not isinstance(value, str):
        raise SnapshotError(f"{source}: {prefix}{key} must be a string, got {type(value).__name__} {shown(value, 60)}")
    if len(value) > MAX_TEXT_CHARS:
        raise SnapshotError(f"{source}: {prefix}{key} is {len(value)} characters, more than the {MAX_TEXT_CHARS} limit")
    return value


def read_json_document(path: Path) -> dict[str, Any]:
    """A JSON object from an untrusted file: size, depth and integers bounded, never read through a symlink out of
    its directory (`containment.file_inside`); SnapshotError naming `path`."""
    try:
        target = file_inside(path)
        doc = parse_untrusted_json(read_bounded(target, MAX_METADATA_BYTES, follow_symlinks=False), MAX_JSON_DEPTH)
    except UntrustedInputError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror or exc})") from None
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
    doc = read_json_document(checkpoint_meta)
    return any(key in doc for key in _AXRL_MARKER_KEYS)


def read_metadata(snapshot_dir: str | Path) -> tuple[AxrlMetadata, bool]:
    """(metadata, legacy) of a snapshot directory."""
    directory = Path(snapshot_dir)
    if not directory.is_dir():
        raise SnapshotError(f"{directory}: snapshot directory not found")
    current = directory / AXRL_METADATA
    if current.is_file():
        return AxrlMetadata.from_json(read_json_document(current), current), False
    if is_legacy_layout(directory):
        legacy = directory / CHECKPOINT_METADATA
        return AxrlMetadata.from_json(read_json_document(legacy), legacy), True
    raise SnapshotError(
        f"{directory}: no {AXRL_METADATA} (and {CHECKPOINT_METADATA} holds no AXRL keys): not a spike snapshot"
    )
