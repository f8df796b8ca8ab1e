"""`replay_result.json`: what one replay produced. Written only by a replay that ran."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from axrl_spike_replay.vocabulary import Backend, Fidelity, Verdict

# baseline: reproduced / not_reproduced; mitigated: see vocabulary.MITIGATION_VERDICTS; failed: it did not run.
VERDICTS = Verdict.values()


@dataclass
class ReplayResult:
    """One replay's outcome (baseline or mitigated). `verdict` is one of VERDICTS."""

    snapshot: str
    backend: Backend
    target: str  # "local" or the SSH target as given
    fidelity: Fidelity
    world_size_saved: int
    world_size_used: int
    mitigations: dict[str, Any]  # {} for the baseline
    grad_norm: float | None
    recorded_grad_norm: float | None  # None only when rebuilt from a task row that lost a non-finite value
    rel_diff: float | None  # |grad_norm - recorded| / recorded (baseline) ; for mitigated: vs recorded too
    median_norm: float | None  # as recorded_grad_norm
    spike_ratio: float | None  # grad_norm / median_norm
    verdict: Verdict
    threshold: float | None  # detector threshold the verdict compares against
    baseline_grad_norm: float | None = None  # for mitigated replays: the baseline at the same layout
    change_vs_baseline: float | None = None  # grad_norm / baseline_grad_norm - 1
    top_params: list[dict[str, Any]] = field(default_factory=list)  # [{name, grad_norm}]
    timings: dict[str, float] = field(default_factory=dict)  # seconds: load, compute, total
    device: str = "cpu"
    job_name: str = ""
    role: str = ""
    iteration: int = -1
    config_id: str = "baseline"
    patch_sha256: str | None = None
    node: dict[str, Any] | None = None  # remote node facts (GPUs) when run over SSH
    error: str | None = None  # why, when verdict == "failed"
    created_at: str = ""
    tolerance: float | None = None  # rel_diff a baseline may show and still count as reproduced
    repeat_grad_norms: list[float] = field(default_factory=list)  # one per repeat (`--repeat N`)
    repeat_spread: float | None = None  # max - min of repeat_grad_norms (0.0: deterministic)
    rank_metrics: list[dict[str, Any]] = field(default_factory=list)  # per saved rank: loss, loss_tokens, ...
    legacy_layout: bool = False  # replayed through a temporary replay dir (legacy snapshot)
    output_dir: str = ""  # where this result's files were written ("" when none)

    def __post_init__(self) -> None:
        # Results are also rebuilt from files and task rows: the vocabulary fields always hold members.
        self.backend = Backend.parse(self.backend, "result backend")
        self.fidelity = Fidelity.parse(self.fidelity, "result fidelity")
        self.verdict = Verdict.parse(self.verdict, "result verdict")

    def to_json(self) -> dict[str, Any]:
        """The `replay_result.json` document (vocabulary members are their string values)."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ReplayResult:
        """A result read back from its JSON document; AxrlError when a vocabulary field holds an unknown value."""
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in doc.items() if k in known})
