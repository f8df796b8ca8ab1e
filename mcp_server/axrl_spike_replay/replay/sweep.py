"""Sweep: many mitigation configs on one snapshot in one run, weights loaded once.

Every process loads the snapshot's weights once and forwards each rank batch once for all the
configs that change only the loss (each config backpropagates its own loss from the shared
graph); configs that change routing or weights get their own forward. The baseline runs in the
same job, so every config is judged against the baseline at the same layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.replay.engine import ReplayOptions, replay_session
from axrl_spike_replay.replay.mitigations import check_distinct, parse_config
from axrl_spike_replay.replay.result import ReplayResult
from axrl_spike_replay.vocabulary import Fidelity, Verdict

SWEEP_FILE = "sweep_result.json"


@dataclass
class SweepResult:
    """A sweep's baseline and one replay result per config (each with its verdict vs the baseline)."""

    snapshot: str
    fidelity: Fidelity
    world_size_saved: int
    world_size_used: int
    device: str
    threshold: float
    baseline: ReplayResult
    results: list[ReplayResult] = field(default_factory=list)
    output_dir: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fidelity = Fidelity.parse(self.fidelity, "sweep fidelity")  # also when read back from a file

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["baseline"] = self.baseline.to_json()
        doc["results"] = [r.to_json() for r in self.results]
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SweepResult:
        values = dict(doc)
        values["baseline"] = ReplayResult.from_json(doc["baseline"])
        values["results"] = [ReplayResult.from_json(r) for r in doc.get("results", [])]
        return cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__})

    def cleared(self) -> list[ReplayResult]:
        """The configs whose verdict is `cleared`."""
        return [r for r in self.results if r.verdict == Verdict.CLEARED]


def run_sweep(
    snapshot: str | Path, configs: Sequence[Mapping[str, Any]], options: ReplayOptions | None = None
) -> SweepResult:
    """Replay the baseline and every config of `configs` in one job; results in the configs' order.

    Output (with a workspace): `<ts>/baseline/replay_result.json`, `<ts>/<config_id>/replay_result.json`
    for each config and `<ts>/sweep_result.json`; each is logged in the job's task file when one is open.
    """
    options = options or ReplayOptions()
    normalised = [parse_config(c, f"config {i + 1}") for i, c in enumerate(configs)]
    check_distinct(normalised)
    with replay_session(snapshot, options, normalised, "sweep") as session:
        baseline, results = session.execute()
        sweep = SweepResult(
            snapshot=str(snapshot),
            fidelity=session.plan.fidelity,
            world_size_saved=session.inputs.world_size,
            world_size_used=session.plan.nproc,
            device=options.device,
            threshold=session.threshold,
            baseline=baseline,
            results=results,
            output_dir=str(session.run.path or ""),
        )
        paths = [session.run.write_result(result, result.config_id) for result in (baseline, *results)]
        sweep.timings = {"total": baseline.timings.get("total", 0.0), "load": baseline.timings.get("load", 0.0)}
        session.run.write_json(SWEEP_FILE, sweep.to_json())
    for result, path in zip((baseline, *results), paths, strict=True):
        session.record(result, path)  # after every file is complete
    return sweep
