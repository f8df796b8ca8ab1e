"""`param_grad_norms_vs_replay`: the recorded per-parameter grad norms against the replay's own.

A replay that matches the recorded global norm proves little on its own: edit a batch, replay it, and write the
replay's global norm into the snapshot, and the verdict says `reproduced`. The per-parameter norms the trainer
recorded are the step's gradient in far more numbers than one; they must match what the replay computes from the
snapshot's weights and batch, parameter by parameter.

What is compared depends on what the trainer recorded (grad info `param_grad_norms_kind`):

- local (no kind; our reference trainer, Megatron's local norms): each rank's norms of its gradient before the
  data-parallel mean, against the replay's gradient of the same rank's batch, computed rank by rank before any
  reduction. The engine computes each saved rank's gradient on its own in every layout, so a reduced-fidelity
  replay compares these exactly as a full one does.
- `reduced` on every rank, identical norms on every rank, or one rank: the norms of the reduced gradient, against
  the replay's reduced gradient.
- `reduced_shard` on every rank (FSDP: each rank's shard of the reduced gradient): merged per parameter over the
  ranks (sqrt of the sum of squares), against the replay's reduced gradient.

Each parameter may differ by the replay's tolerance (the one its verdict uses for that fidelity and device) of
its own norm plus that tolerance of the norm it is part of (the global norm; for a local norm, the rank's local
norm): a reduced gradient summed in another order than training's (a reduced-fidelity replay, a GPU) can differ
by more than the relative tolerance in a parameter whose gradient nearly cancels over the ranks, never by more than
that share of the whole. Parameters are matched by name after dropping wrappers' segments (`_fsdp_wrapped_module.`,
`module.` ...); when no recorded name is a parameter of the replayed model (e.g. FSDP1's flat parameters), nothing
is compared and the check is not listed as made. Non-finite norms are left to the diagnosis.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.consistency import SHARDS_OF_THE_REDUCED, Consistency, ConsistencyProblem
from axrl_spike_replay.snapshot.layout import rank_files
from axrl_spike_replay.snapshot.rank_data import load_grad_info

NAME = "param_grad_norms_vs_replay"
WORST_SHOWN = 3
_WRAPPERS = re.compile(r"(?<![^.])(?:_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod|module)\.")

Norms = Mapping[str, float]


def plain_name(name: str) -> str:
    """A parameter name without the segments FSDP, activation checkpointing, compile or DDP wrap it in."""
    return _WRAPPERS.sub("", name)


def check_replayed_param_norms(
    out: Consistency,
    snapshot_dir: str | Path,
    reduced: Norms | None,
    local: Mapping[int, Norms] | None,
    tolerance: float,
    replay: str,
) -> Consistency:
    """Add the per-parameter comparison: `reduced` the replay's norms of the reduced gradient, `local` each saved
    rank's norms of its own gradient (both {parameter name: norm}); `replay` says which replay, for the message."""
    directory = Path(snapshot_dir)
    infos: dict[int, dict[str, Any]] = {}
    for rank in sorted(rank_files(directory)["grad_info"]):
        try:
            infos[rank] = load_grad_info(directory, rank)
        except SnapshotError:
            out.skip(NAME, f"grad info of rank {rank} unreadable (inspect says why)")
            return out
    recorded = {r: {plain_name(k): v for k, v in i["param_grad_norms"].items()} for r, i in infos.items()}
    if not infos or not all(recorded.values()):
        out.skip(NAME, "not every rank's grad info records per-parameter norms")
        return out
    kinds = {info.get("param_grad_norms_kind") for info in infos.values()}
    first = next(iter(recorded.values()))
    if kinds == {SHARDS_OF_THE_REDUCED}:
        merged = {name: math.sqrt(math.fsum(n.get(name, 0.0) ** 2 for n in recorded.values())) for name in first}
        pairs = [(None, merged, reduced)]
    elif kinds == {"reduced"} or len(recorded) == 1 or all(n == first for n in recorded.values()):
        pairs = [(None, first, reduced)]
    else:
        pairs = [(rank, norms, (local or {}).get(rank)) for rank, norms in recorded.items()]
    found = [_compare(rank, norms, ours, tolerance, replay) for rank, norms, ours in pairs if ours]
    if not any(compared for compared, _ in found):
        out.skip(NAME, "no recorded parameter name is a parameter of the replayed model (e.g. FSDP1's flat ones)")
        return out
    out.checked.append(NAME)
    for _, problem in found:
        if problem is not None:
            out.add(problem)
    return out


def _compare(
    rank: int | None, recorded: Norms, replayed: Norms, tolerance: float, replay: str
) -> tuple[int, ConsistencyProblem | None]:
    """(parameters compared, the problem when some differ beyond tolerance)."""
    ours = {plain_name(k): v for k, v in replayed.items()}
    scale = math.sqrt(math.fsum(v * v for v in ours.values() if math.isfinite(v)))
    rows = []
    compared = 0
    for name, was in recorded.items():
        now = ours.get(name)
        if now is None or not (math.isfinite(was) and math.isfinite(now)):
            continue
        compared += 1
        slack = tolerance * max(abs(was), abs(now)) + tolerance * scale
        if abs(now - was) > slack:
            rows.append((abs(now - was), name, was, now))
    if not rows:
        return compared, None
    rows.sort(reverse=True)
    worst = [
        {"name": name, "recorded": was, "replayed": now, "rel_diff": diff / max(abs(was), abs(now))}
        for diff, name, was, now in rows[:WORST_SHOWN]
    ]
    whose = (
        f"rank {rank}'s recorded per-parameter grad norms (before the data-parallel mean)"
        if rank is not None
        else ("the recorded per-parameter grad norms (of the reduced gradient)")
    )
    listed = "; ".join(f"{w['name']} recorded {w['recorded']:.6g}, replayed {w['replayed']:.6g}" for w in worst)
    return compared, ConsistencyProblem(
        NAME,
        f"{whose} differ from those {replay} computes in {len(rows)} of {compared} parameters beyond tolerance "
        f"{tolerance:.0e} "
        f"({listed}); the recorded norms are not those of the snapshot's weights and batch: a loss or gradient "
        "scale the run config does not record (one factor on every parameter, or one per layer or parameter family), "
        "a stored batch that is not the one the rank trained on, or edited weights or norms (`diagnose` reads which)",
        {"rank": rank, "compared": compared, "differing": len(rows), "tolerance": tolerance, "worst": worst},
    )
