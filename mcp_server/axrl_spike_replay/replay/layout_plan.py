"""Which saved data-parallel ranks each replay process recomputes, and the fidelity that gives.

With as many processes as the saved world size each process replays its own rank: `full`
fidelity. With fewer, each process replays a contiguous block of saved ranks, summing their
gradients (each rank keeps its own loss normalisation) before the reduction divides by the saved
world size: `reduced` fidelity, a diagnostic whose float summation order differs from training.
"""

from __future__ import annotations

from dataclasses import dataclass

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.vocabulary import Fidelity


@dataclass(frozen=True)
class LayoutPlan:
    """Saved ranks per replay process."""

    world_size_saved: int
    assignment: tuple[tuple[int, ...], ...]  # assignment[p]: saved ranks replayed by process p

    @property
    def nproc(self) -> int:
        return len(self.assignment)

    @property
    def fidelity(self) -> Fidelity:
        return Fidelity.FULL if self.nproc == self.world_size_saved else Fidelity.REDUCED


def plan_layout(world_size_saved: int, nproc: int | None = None) -> LayoutPlan:
    """Blocks of saved ranks for `nproc` processes (default: the saved world size, full fidelity)."""
    if nproc is None:
        nproc = world_size_saved
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ConfigError(f"`nproc` must be an integer >= 1, got {nproc!r}", "nproc")
    if nproc > world_size_saved:
        raise ConfigError(
            f"`nproc` {nproc} is larger than the saved world size {world_size_saved}; use at most "
            f"{world_size_saved} (full fidelity) or fewer (reduced fidelity)",
            "nproc",
        )
    assignment = tuple(
        tuple(range(p * world_size_saved // nproc, (p + 1) * world_size_saved // nproc)) for p in range(nproc)
    )
    return LayoutPlan(world_size_saved=world_size_saved, assignment=assignment)
