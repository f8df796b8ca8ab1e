"""A mitigation's identity: its config in one normal form, or its patch hash, and a one-line description."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from axrl_spike_replay.experiment.mitigation.mitigations import canonical, normal_form
from axrl_spike_replay.experiment.mitigation.rank_scope import hypothesis_text, is_scoped, scope_text


def normalise_config(mitigations: dict[str, Any] | None) -> dict[str, Any]:
    """The mitigation config in the one normal form (`experiment.mitigation.mitigations.normal_form`, as `parse_config`
    returns)."""
    return normal_form(mitigations)


def config_key(mitigations: dict[str, Any] | None) -> str:
    """A stable hash of the normalised config (equal configs, equal keys; 2 and 2.0 alike, as in records
    written before the normal form was typed)."""
    text = json.dumps(canonical(normalise_config(mitigations)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def describe_change(
    mitigations: dict[str, Any] | None, patch_sha256: str | None = None, hypothesis: dict[str, Any] | None = None
) -> str:
    """`mismatch_token_clip_max=2, routing.replay=loss_tokens`, `patch 1a2b3c4d5e6f`, `hypothesis aux_loss_coef=10.24@1`
    or `baseline`."""
    if hypothesis:
        return f"hypothesis {hypothesis_text(normalise_config(hypothesis))}"
    parts = [f"{key}={_short(value)}" for key, value in _flatten(normalise_config(mitigations))]
    if patch_sha256:
        parts.insert(0, f"patch {patch_sha256[:12]}")
    return ", ".join(parts) or "baseline"


def is_baseline(
    mitigations: dict[str, Any] | None, patch_sha256: str | None = None, hypothesis: dict[str, Any] | None = None
) -> bool:
    """True when nothing was changed: no mitigation knob set, no patch and no hypothesis."""
    return not normalise_config(mitigations) and not patch_sha256 and not hypothesis


def _flatten(doc: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in doc.items():
        if is_scoped(value):
            out.append((f"{prefix}{key}", scope_text(value)))
        elif isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # 2.0 reads as 2
    if isinstance(value, list):
        return "[" + ",".join(_short(v) for v in value) + "]"
    return str(value)
