"""One logged replay of a task: `ExperimentRow`, the experiment table's record in the task state (`<job>.json`).

The row reads and writes the JSON the task state has always held, key for key: a row read back is written back as
it was read (its keys in their order, a key this version does not know kept, a figure spelled `"inf"` or `"nan"`
by an earlier version kept so), and a field set since is added after them. A new row writes its fields in
declaration order; `baseline` only once a baseline judged it. A value of the wrong kind is an AxrlError naming the
row and the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from axrl_spike_replay.errors import AxrlError

_TEXT = (
    "id", "time", "snapshot", "backend", "target", "fidelity", "patch_sha256", "change", "finding", "config_id",
    "verdict", "device", "job_name", "role", "result_path", "command", "baseline",
)  # fmt: skip
_FIGURES = (
    "grad_norm", "recorded_grad_norm", "rel_diff", "median_norm", "ratio_to_median", "threshold",
    "baseline_grad_norm", "change_vs_baseline",
)  # fmt: skip
_COUNTS = ("world_size_saved", "world_size_used", "iteration")
_FLAGS = ("is_baseline", "rank_losses_match")
_RECORDS = ("mitigations", "hypothesis", "node")
_BOOKKEEPING = ("keys", "spelled", "unknown")


@dataclass(kw_only=True)
class ExperimentRow:
    """One replay logged into a task: what ran, where, against which baseline, and its figures and verdict."""

    id: str  # E3: what `method add` takes as the attempt
    time: str | None = None
    snapshot: str | None = None
    backend: str | None = None
    target: str | None = None
    fidelity: str | None = None
    mitigations: dict[str, Any] = field(default_factory=dict)  # normal form
                                                               # (workspace.task_record.changes.normalise_config)
    patch_sha256: str | None = None
    change: str | None = None  # the mitigations, patch or hypothesis in words; "baseline" for none
    is_baseline: bool = False
    hypothesis: dict[str, Any] = field(default_factory=dict)  # a hypothesis replay's settings (normal form)
    finding: str | None = None  # a hypothesis: judged against the recording
    rank_losses_match: bool | None = None
    config_id: str | None = None
    grad_norm: float | None = None
    recorded_grad_norm: float | None = None
    rel_diff: float | None = None
    median_norm: float | None = None
    ratio_to_median: float | None = None
    threshold: float | None = None
    baseline_grad_norm: float | None = None
    change_vs_baseline: float | None = None
    verdict: str | None = None
    world_size_saved: int | None = None
    world_size_used: int | None = None
    device: str | None = None
    job_name: str | None = None
    role: str | None = None
    iteration: int | None = None
    node: dict[str, Any] | None = None
    result_path: str | None = None
    command: str | None = None  # the command that reran it (a sweep's baseline: the baseline's own)
    baseline: str | None = None  # the id of the logged baseline this row was judged against
    # the keys as read, in their order (empty for a new row); figures read as "inf"/"nan"/"-inf"; unknown keys
    keys: tuple[str, ...] = field(default=(), repr=False, compare=False)
    spelled: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    unknown: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, doc: Any, where: str = "experiment row") -> ExperimentRow:
        """The row a JSON object holds; AxrlError naming `where` and the key for a value of the wrong kind."""
        if not isinstance(doc, Mapping):
            raise AxrlError(f"{where} must be a record, got {type(doc).__name__}")
        if not isinstance(doc.get("id"), str):
            raise AxrlError(f"{where}: `id` is missing or not text")
        values: dict[str, Any] = {}
        spelled: dict[str, str] = {}
        for key, value in doc.items():
            if key in _TEXT:
                values[key] = _checked(value, (str,), where, key, "text")
            elif key in _FIGURES:
                values[key], spelling = _figure(value, where, key)
                if spelling is not None:
                    spelled[key] = spelling
            elif key in _COUNTS:
                values[key] = _checked(value, (int,), where, key, "a whole number")
            elif key in _FLAGS:
                values[key] = _checked(value, (bool,), where, key, "true or false")
            elif key in _RECORDS:
                values[key] = _checked(value, (dict,), where, key, "a record")
        for key in ("mitigations", "hypothesis"):
            if key in values and values[key] is None:
                values[key] = {}  # read as {}; written back as null (`keys` and `_written`)
                spelled[key] = "null"
        if "is_baseline" in values and values["is_baseline"] is None:
            values["is_baseline"] = False
            spelled["is_baseline"] = "null"
        unknown = {key: value for key, value in doc.items() if key not in _FIELDS}
        return cls(**values, keys=tuple(doc), spelled=spelled, unknown=unknown)

    def to_json(self) -> dict[str, Any]:
        """The row's JSON object: a row read back as it was read (plus any field set since), a new one its fields in
        declaration order (`baseline` only when set)."""
        if not self.keys:
            return {name: self._written(name) for name in _FIELDS if name != "baseline" or self.baseline is not None}
        doc = {key: self.unknown[key] if key in self.unknown else self._written(key) for key in self.keys}
        for name in _FIELDS:
            if name not in doc and getattr(self, name) != _DEFAULTS[name]:
                doc[name] = self._written(name)
        return doc

    def _written(self, name: str) -> Any:
        value = getattr(self, name)
        spelling = self.spelled.get(name)
        if spelling == "null" and value in ({}, False):
            return None
        if spelling is not None and spelling != "null" and isinstance(value, float) and _same(value, float(spelling)):
            return spelling
        return value


def _checked(value: Any, kinds: tuple[type, ...], where: str, key: str, what: str) -> Any:
    if value is None or (isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))):
        return value
    raise AxrlError(f"{where}: `{key}` must be {what}, got {type(value).__name__}")


def _figure(value: Any, where: str, key: str) -> tuple[float | None, str | None]:
    """(the number, the spelling it was read from when it was text such as "inf"); None stays None."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value, None
    if isinstance(value, str):
        try:
            return float(value), value
        except ValueError:
            pass
    raise AxrlError(f"{where}: `{key}` must be a number, got {value!r:.40}")


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


_FIELDS = tuple(f.name for f in fields(ExperimentRow) if f.name not in _BOOKKEEPING)
_DEFAULTS: dict[str, Any] = {name: ExperimentRow(id="").__dict__[name] for name in _FIELDS if name != "id"}
_DEFAULTS["id"] = None
