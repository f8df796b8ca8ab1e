"""A few lines of key signals for a method file, from batch analysis and gradient attribution."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.jsonable import to_jsonable

MAX_LINES = 10


def key_signals(snapshot: str | Path, top: int = 3) -> dict[str, Any]:
    """`{"lines": [...], "notes": [...]}`: batch signals and attribution, summarised; notes say what was unreadable."""
    lines: list[str] = []
    notes: list[str] = []
    path = Path(snapshot)
    if not path.is_dir():
        note = f"snapshot {path} is no longer readable (not a directory); signals not recomputed"
        return {"lines": [], "notes": [note]}
    for label, compute in (("batch signals", _batch_signals), ("attribution", _attribution)):
        try:
            lines += compute(path, top)
        except ImportError as exc:
            notes.append(f"{label}: not available in this installation ({exc})")
        except AxrlError as exc:
            notes.append(f"{label}: snapshot {path} could not be read ({exc})")
        except Exception as exc:  # best effort: a method file is still written, with the reason noted
            notes.append(f"{label}: not computed for {path} ({type(exc).__name__}: {exc})")
    return {"lines": lines[:MAX_LINES], "notes": notes}


def _batch_signals(path: Path, top: int) -> list[str]:
    from axrl_spike_replay.analysis.batch_signals import analyze_snapshot

    return summarise_batch(to_jsonable(analyze_snapshot(path, top=top)), top)


def _attribution(path: Path, top: int) -> list[str]:
    from axrl_spike_replay.replay.attribution import attribute_spike

    return summarise_attribution(to_jsonable(attribute_spike(path, top=top)), top)


def summarise_batch(doc: dict[str, Any], top: int) -> list[str]:
    """Spike size, loss tokens, importance-ratio outliers, advantage balance and the top outlier tokens."""
    lines = [
        f"spike: grad norm {_short(doc.get('grad_norm'))}, {_short(doc.get('spike_ratio'))}x the median "
        f"(iteration {doc.get('iteration')}, ranks {len(doc.get('ranks') or [])})"
    ]
    tokens = doc.get("tokens") or {}
    if tokens:
        lines.append(
            f"loss tokens: {tokens.get('loss_tokens')} of {tokens.get('total')} ({_short(tokens.get('loss_fraction'))})"
        )
    ratio = doc.get("ratio") or {}
    if ratio.get("available"):
        outside = ratio.get("fraction_outside") or {}
        abs_lr = ratio.get("abs_log_ratio") or {}
        lines.append(
            f"importance ratio (old vs rollout): {_short(outside.get('0.5-2.0'))} of loss tokens outside [0.5, 2], "
            f"max |log(pi_old/pi_rollout)| {_short(abs_lr.get('max'))}"
        )
    sign = doc.get("sign_balance") or {}
    if sign:
        lines.append(
            f"advantages: {_dominance(sign.get('dominant'))}, negative/positive total "
            f"{_short(sign.get('negative_to_positive'))} ({sign.get('negative_tokens')} negative, "
            f"{sign.get('positive_tokens')} positive tokens)"
        )
    outliers = doc.get("outliers") or {}
    for key, label, column in (
        ("tokens_by_abs_log_ratio", "top tokens by |log(pi_old/pi_rollout)|", "log_ratio"),
        ("tokens_by_abs_advantage", "top tokens by |advantage|", "advantage"),
    ):
        rows = outliers.get(key) or []
        if rows:
            cells = [f"rank {r.get('rank')} sample {r.get('sample')} pos {r.get('position')}: {_short(r.get(column))}"
                     for r in rows[:top]]  # fmt: skip
            lines.append(f"{label}: " + "; ".join(cells))
    if doc.get("missing"):
        lines.append("not in the snapshot: " + ", ".join(str(m).split(" ", 1)[0] for m in doc["missing"]))
    return lines


def summarise_attribution(doc: dict[str, Any], top: int) -> list[str]:
    """The samples that carry the replayed grad norm, with their advantage and importance-ratio signals."""
    samples = doc.get("samples") or []
    base = doc.get("log_ratio_base") or "old"
    if not samples:
        return summarise("attribution", doc, top)
    cells = [
        f"rank {s.get('rank')} sample {s.get('sample')}: {_pct(s.get('share'))} "
        f"(advantage {_short(s.get('advantage'))}, max |log(pi/pi_{base})| {_short(s.get('max_abs_log_ratio'))})"
        for s in samples[:top]
    ]
    lines = [f"samples carrying the grad norm (of {doc.get('total_samples')}): " + "; ".join(cells)]
    lines.append(
        f"attribution: replayed grad norm {_short(doc.get('grad_norm'))} ({doc.get('fidelity')}), "
        f"router term {_short(doc.get('router_term'))}, sum check rel error {_short(doc.get('sum_rel_error'))}"
    )
    return lines


def _pct(value: Any) -> str:
    return f"{value * 100:.1f}%" if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"


def _dominance(dominant: Any) -> str:
    return "balanced" if dominant in (None, "balanced") else f"{dominant} dominate"


def summarise(kind: str, doc: Any, top: int) -> list[str]:
    """A few readable lines from an analysis document: its scalar facts, then the head of each ranked list."""
    if not isinstance(doc, dict):
        return [f"{kind}: {_short(doc)}"]
    lines: list[str] = []
    summary = doc.get("summary") if isinstance(doc.get("summary"), dict) else None
    scalars = [(k, v) for k, v in (summary or doc).items() if _is_scalar(v) and k not in _SKIP]
    if scalars:
        lines.append(f"{kind}: " + ", ".join(f"{k}={_short(v)}" for k, v in scalars[:6]))
    for key, value in doc.items():
        if key in _SKIP or not isinstance(value, list) or not value:
            continue
        head = ", ".join(_entry(item) for item in value[:top])
        lines.append(f"{kind} {key} (top {min(top, len(value))}): {head}")
    return lines


_SKIP = {"snapshot", "path", "snapshot_dir", "created_at", "format_version", "notes", "warnings"}


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) and not (isinstance(value, str) and len(value) > 60)


def _entry(item: Any) -> str:
    if isinstance(item, dict):
        scalars = [(k, v) for k, v in item.items() if _is_scalar(v)]
        return "(" + ", ".join(f"{k}={_short(v)}" for k, v in scalars[:4]) + ")"
    return _short(item)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
