"""Pictures where they beat numbers: the grad-norm series with its spikes, a sweep's grad norm per mitigation.

Each function takes plain numbers and returns PNG bytes (matplotlib's Agg canvas, no display, no pyplot
global state), so the CLI can save them and the MCP server can return them as images.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

# Verdict colours: green cleared, amber partial, grey no effect, red worse / failed, blue baseline.
VERDICT_COLOURS = {
    "cleared": "#2e7d32",
    "partial": "#f9a825",
    "no_effect": "#9e9e9e",
    "baseline_not_a_spike": "#bdbdbd",
    "worse": "#c62828",
    "failed": "#6d4c41",
    "reproduced": "#1565c0",
    "not_reproduced": "#90caf9",
}


def _figure(width: float = 8.0, height: float = 4.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def grad_norm_series_png(
    points: Sequence[tuple[int, float]],
    spikes: Sequence[tuple[int, float]] = (),
    *,
    title: str = "grad norm",
    log_scale: bool | None = None,
) -> bytes:
    """Grad norm per iteration as a line, each spike marked with a red cross and its iteration."""
    series = [(int(i), v) for i, g in points if (v := _finite(g)) is not None]
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    if series:
        ax.plot([i for i, _ in series], [v for _, v in series], lw=1.0, color="#1565c0", label="grad norm")
    marked = [(int(i), v) for i, g in spikes if (v := _finite(g)) is not None]
    if marked:
        ax.scatter(
            [i for i, _ in marked], [v for _, v in marked], marker="x", s=60, color="#c62828", zorder=3, label="spike"
        )
        for iteration, value in marked:
            ax.annotate(
                f"iter {iteration}",
                (iteration, value),
                textcoords="offset points",
                xytext=(4, 6),
                fontsize=8,
                color="#c62828",
            )
    values = [v for _, v in series] + [v for _, v in marked]
    positive = [v for v in values if v > 0]
    if log_scale is None:
        log_scale = bool(positive) and max(positive) / max(min(positive), 1e-30) > 50
    if log_scale and positive:
        ax.set_yscale("log")
    if not values:
        ax.text(0.5, 0.5, "no grad-norm points", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("iteration")
    ax.set_ylabel("grad norm (pre-clip)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if series or marked:
        ax.legend(loc="upper left", fontsize=8)
    return _png(fig)


def sweep_png(
    labels: Sequence[str],
    grad_norms: Sequence[float | None],
    verdicts: Sequence[str] = (),
    *,
    baseline: float | None = None,
    recorded: float | None = None,
    median: float | None = None,
    threshold: float | None = None,
    title: str = "grad norm per mitigation",
) -> bytes:
    """One horizontal bar per config, coloured by verdict, with baseline, recorded and threshold lines."""
    count = len(labels)
    fig = _figure(8.0, max(2.5, 0.45 * count + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    verdict_list = list(verdicts) + [""] * (count - len(verdicts))
    values = [_finite(g) for g in grad_norms]
    colours = [VERDICT_COLOURS.get(v, "#607d8b") for v in verdict_list]
    positions = list(range(count))
    ax.barh(positions, [v if v is not None else 0.0 for v in values], color=colours)
    for pos, value, verdict in zip(positions, values, verdict_list, strict=True):
        text = f"{value:.4g} {verdict}".rstrip() if value is not None else (verdict or "no result")
        ax.text(value or 0.0, pos, f" {text}", va="center", fontsize=8)
    ax.set_yticks(positions)
    ax.set_yticklabels([str(label) for label in labels], fontsize=8)
    ax.invert_yaxis()
    lines = [
        (_finite(baseline), "baseline replay", "#1565c0", "--"),
        (_finite(recorded), "recorded", "#000000", ":"),
    ]
    med = _finite(median)
    thr = _finite(threshold)
    if med is not None and thr is not None:
        lines.append((med * thr, f"spike threshold ({thr:g} x median)", "#c62828", "-."))
    elif med is not None:
        lines.append((med, "median", "#2e7d32", "-."))
    for value, label, colour, style in lines:
        if value is not None:
            ax.axvline(value, color=colour, ls=style, lw=1.0, label=f"{label} {value:.4g}")
    ax.set_xlabel("global grad norm (pre-clip)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    if any(value is not None for value, *_ in lines):
        ax.legend(loc="lower right", fontsize=7)
    return _png(fig)
