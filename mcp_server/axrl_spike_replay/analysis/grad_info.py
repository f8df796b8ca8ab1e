"""The largest parameter gradient norms of a snapshot, per rank and merged across ranks."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.snapshot.completeness import missing_ranks, rank_ranges_text, ranks_text
from axrl_spike_replay.snapshot.layout import rank_files
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.snapshot.rank_data import load_grad_info

MERGE_METHOD = (
    "sqrt of the sum over ranks of each rank's squared local (pre-reduction) grad norm: the norm of all "
    "ranks' local gradients together, which ranks parameters by total gradient energy; it is not the norm "
    "of the data-parallel mean gradient the optimizer applied"
)


@dataclass
class ParamGrad:
    name: str
    grad_norm: float
    numel: int | None = None


@dataclass
class RankGrads:
    rank: int
    local_grad_norm: float  # sqrt of the sum of this rank's squared per-parameter (pre-reduction) norms
    recorded_global_grad_norm: float  # the global pre-clip norm as this rank recorded it (same on every rank)
    loss: float | None
    num_tokens: int | None
    top: list[ParamGrad]
    params: int


@dataclass
class GradReport:
    """What `grads` reports: top-K parameter grad norms per rank and merged (see `merge_method`)."""

    path: str
    iteration: int
    recorded_grad_norm: float
    top: int
    ranks: list[RankGrads]
    merged: list[ParamGrad]
    merge_method: str = MERGE_METHOD
    problems: list[str] = field(default_factory=list)


def _top(norms: dict[str, float], numel: dict[str, int], k: int) -> list[ParamGrad]:
    key = {name: (math.inf if math.isnan(v) else v) for name, v in norms.items()}
    chosen = sorted(norms, key=lambda name: (-key[name], name))[:k]
    return [ParamGrad(name, norms[name], numel.get(name)) for name in chosen]


def top_param_grads(path: str | Path, top: int = 10) -> GradReport:
    """Top-`top` parameter grad norms of every rank's grad info, and merged across ranks."""
    if top < 1:
        raise ConfigError(f"`top` must be >= 1, got {top}", "top")
    directory = Path(os.path.abspath(path))
    meta, _ = read_metadata(directory)
    files = rank_files(directory)["grad_info"]
    if not files:
        raise SnapshotError(f"{directory}: no grad_info_rank<r>.pt files")
    problems: list[str] = []
    missing = missing_ranks(files, meta.parallel.world_size)
    if missing:
        problems.append(
            f"no grad info for ranks {rank_ranges_text(missing)}: merged norms cover ranks {ranks_text(files)} only"
        )
    ranks: list[RankGrads] = []
    squares: dict[str, float] = {}
    numel: dict[str, int] = {}
    for rank in files:
        info = load_grad_info(directory, rank)
        norms = info["param_grad_norms"]
        rank_numel = info["param_numel"]
        numel.update(rank_numel)
        for name, value in norms.items():
            squares[name] = squares.get(name, 0.0) + value * value
        num_tokens = info["num_tokens"]
        ranks.append(
            RankGrads(
                rank=rank,
                local_grad_norm=math.sqrt(sum(value * value for value in norms.values())),
                recorded_global_grad_norm=info["grad_norm"],
                loss=info["loss"],
                num_tokens=int(num_tokens) if num_tokens is not None and math.isfinite(num_tokens) else None,
                top=_top(norms, rank_numel, top),
                params=len(norms),
            )
        )
        if not math.isclose(info["grad_norm"], meta.grad_norm, rel_tol=1e-3):
            problems.append(f"rank {rank} recorded grad_norm {info['grad_norm']:.6g}, metadata {meta.grad_norm:.6g}")
    merged = _top({name: math.sqrt(total) for name, total in squares.items()}, numel, top)
    return GradReport(
        path=str(directory),
        iteration=meta.iteration,
        recorded_grad_norm=meta.grad_norm,
        top=top,
        ranks=ranks,
        merged=merged,
        problems=problems,
    )
