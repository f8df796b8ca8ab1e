"""A mitigation's identity: its config in one normal form, or its patch hash, and a one-line description."""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

_INT_RE = re.compile(r"^[+-]?\d+$")
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


def normalise_value(value: Any) -> Any:
    """One canonical form: sorted mappings, lists for sequences, 2 == 2.0 == "2", "true" == True; None dropped."""
    if isinstance(value, dict):
        items = {str(k): normalise_value(v) for k, v in value.items()}
        return {k: items[k] for k in sorted(items) if items[k] is not None and items[k] != {} and items[k] != []}
    if isinstance(value, (list, tuple)):
        return [normalise_value(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((normalise_value(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        if text.lower() in ("none", "null", ""):
            return None
        if _INT_RE.match(text):
            return int(text)
        if _FLOAT_RE.match(text):
            return normalise_value(float(text))
        return text
    return str(value)


def normalise_config(mitigations: dict[str, Any] | None) -> dict[str, Any]:
    """The mitigation config in normal form (sorted keys, canonical values, unset knobs dropped)."""
    return normalise_value(dict(mitigations or {}))


def config_key(mitigations: dict[str, Any] | None) -> str:
    """A stable hash of the normalised config (equal configs, equal keys)."""
    text = json.dumps(normalise_config(mitigations), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def describe_change(mitigations: dict[str, Any] | None, patch_sha256: str | None = None) -> str:
    """`mismatch_token_clip_max=2, routing.replay=loss_tokens`, `patch 1a2b3c4d5e6f`, or `baseline`."""
    parts = [f"{key}={_short(value)}" for key, value in _flatten(normalise_config(mitigations))]
    if patch_sha256:
        parts.insert(0, f"patch {patch_sha256[:12]}")
    return ", ".join(parts) or "baseline"


def is_baseline(mitigations: dict[str, Any] | None, patch_sha256: str | None = None) -> bool:
    """True when nothing was changed: no mitigation knob set and no patch."""
    return not normalise_config(mitigations) and not patch_sha256


def _flatten(doc: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in doc.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_short(v) for v in value) + "]"
    return str(value)
