"""Which saved data-parallel ranks each replay process recomputes, and the fidelity that gives.

With as many processes as the saved world size each process replays its own rank. With fewer, each process
replays a contiguous block of saved ranks in turn, summing their gradients (each rank keeps its own batch,
micro-batches and loss normalisation) before the reduction divides by the saved world size: the same data-parallel
mean over every saved rank, only the float summation order of the sum differs (as it does between any two
all-reduce implementations). Both are `full` fidelity: every saved rank is replayed. `reduced` is left for a
replay that does not compute every saved rank (an external command that says so).
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
        """Full when every saved rank is replayed (by its own process or in turn with others), else reduced."""
        covered = {rank for ranks in self.assignment for rank in ranks}
        return Fidelity.FULL if covered == set(range(self.world_size_saved)) else Fidelity.REDUCED

    @property
    def ranks_per_process(self) -> int:
        return max(len(ranks) for ranks in self.assignment)

    @property
    def tolerance_class(self) -> Fidelity:
        """Whose tolerance a baseline is held to (`experiment.verdict.tolerance`): full's where each process replays
        one saved rank; where a process sums several in turn, the data-parallel sum's float summation order is not
        the trainer's, and the looser rule (reduced's: 1e-5 on CPU) applies, the fidelity staying full."""
        return Fidelity.FULL if self.ranks_per_process == 1 else Fidelity.REDUCED


def plan_layout(world_size_saved: int, nproc: int | None = None) -> LayoutPlan:
    """Blocks of saved ranks for `nproc` processes (default: the saved world size, one each); every saved rank is
    replayed, so the fidelity is full."""
    if nproc is None:
        nproc = world_size_saved
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ConfigError(f"`nproc` must be an integer >= 1, got {nproc!r}", "nproc")
    if nproc > world_size_saved:
        raise ConfigError(
            f"`nproc` {nproc} is larger than the saved world size {world_size_saved}; use at most "
            f"{world_size_saved} (one process per saved rank) or fewer (each replaying several in turn)",
            "nproc",
        )
    assignment = tuple(
        tuple(range(p * world_size_saved // nproc, (p + 1) * world_size_saved // nproc)) for p in range(nproc)
    )
    return LayoutPlan(world_size_saved=world_size_saved, assignment=assignment)
