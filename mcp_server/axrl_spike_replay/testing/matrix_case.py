"""A cell of the fault matrix (`testing.fault_matrix`): a preset, the faults planted on it, and the answer."""

from __future__ import annotations

from dataclasses import dataclass

from axrl_spike_replay.capture.reference.presets import FaultSpec, get_preset

MATRIX_WORLD_SIZE = 2  # one faulty rank beside a healthy one: the witness a per-rank comparison needs


@dataclass(frozen=True)
class MatrixCase:
    """One cell of the matrix: a preset, extra faults planted on it, and the answer."""

    name: str
    family: str  # the cause family planted (one of presets.FAULT_FAMILIES)
    preset: str
    provenance: str  # one of fault_matrix.PROVENANCES
    faults: tuple[FaultSpec, ...] = ()  # planted on top of the preset's own fault
    world_size: int = MATRIX_WORLD_SIZE
    model: str | None = None  # the one model the case runs on (None: each model the matrix is run on)

    def specs(self) -> list[FaultSpec]:
        """Every fault the case plants: the preset's, then its own."""
        own = get_preset(self.preset).injected
        return [*([own] if own is not None else []), *self.faults]

    def expected_ranks(self, world_size: int) -> list[int]:
        """The data-parallel ranks the planted faults hit; [] when they hit every rank (nothing to single out)."""
        hit: set[int] = set()
        for spec in self.specs():
            if spec.ranks is None:
                return []
            hit.update(r % world_size for r in spec.ranks)
        return [] if len(hit) == world_size else sorted(hit)


def held_out_case(
    provenance: str, name: str, family: str, preset: str, *faults: FaultSpec, model: str, world_size: int = 2
) -> MatrixCase:
    """A held-out set's case: `faults` planted on `preset`, named `provenance:name`, on one model and world size."""
    return MatrixCase(f"{provenance}:{name}", family, preset, provenance, faults, world_size=world_size, model=model)
