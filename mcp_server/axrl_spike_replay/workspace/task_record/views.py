"""The values the workspace verbs hand to the faces: the task, a method written or listed, the report written.

The task state on disk (`<job>.json`) stays a JSON document handled inside `workspace/`; these are what a face
reads. Field names and order are the keys of the JSON documents the faces print (`--json`, MCP structured
output), so `to_jsonable` of a view is the document the faces have always shown. Experiment rows are typed
(`ExperimentRow`, whose JSON is the task file's); the other rows (failures, notes, preserved copies) are records of
the task file and stay plain JSON objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow

Row = dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class TaskView:
    """One investigation's task: its state and where its files are."""

    format_version: int
    job: str
    created_at: str
    updated_at: str
    snapshot: str | None
    snapshot_history: list[Row]
    command: str | None
    experiments: list[ExperimentRow]  # its JSON: each row's `to_json()`, as the task state holds it
    failed: list[Row]
    observations: list[Row]
    next_steps: list[Row]
    methods: list[Row]
    reports: list[Row]
    preserved_copies: list[Row]
    task_file: str
    state_file: str


@dataclass(frozen=True, kw_only=True)
class MethodEntry:
    """One method file of the workspace; its JSON is the file's whole front matter plus its path."""

    slug: str
    status: str
    summary: str | None
    path: str
    front_matter: Row
    source: str = "workspace"  # workspace: this workspace's spike-mitigation-methods/; shipped: the tool's library
    rank: int = 0  # place in the ranking (1 first: proven, healthy gradient most intact, smallest footprint)

    def to_json(self) -> Row:
        """The front matter as written (every field, in order), with the file's path, source and rank."""
        return {**self.front_matter, "path": self.path, "source": self.source, "rank": self.rank}


@dataclass(frozen=True, kw_only=True)
class MethodAdded:
    """The method file just written: its front matter, its path and the key signals quoted in it."""

    axrl_method: int
    slug: str
    status: str
    summary: str
    job: str
    job_name: str
    role: str | None
    iteration: int | None
    snapshot: str | None
    attempt: str
    verdict: str
    fidelity: str
    mitigations: Row
    config_key: str
    patch_sha256: str | None
    grad_norm: float | None
    baseline_grad_norm: float | None
    spike_ratio: float | None
    threshold: float | None
    result_path: str | None
    created_at: str
    path: str
    signals: Row
    confirms_shipped: str | None = None  # the shipped method recording the same change, which this spike confirms
    # the ranking figures as the file's front matter holds them, and the method's place among the listed ones
    cosine_to_clean: float | None = None
    clean_reached: bool | None = None
    token_fraction: float | None = None
    sample_fraction: float | None = None
    rank: int = 0
    warnings: list[str] = field(default_factory=list)  # e.g. a name that says another mitigation than the attempt's


@dataclass(frozen=True, kw_only=True)
class ReportResult:
    """The report just written: what it shows, where it is, its text, and the copies released after it."""

    job: str
    generated_at: str
    snapshot: str | None
    output_dir: str | None
    snapshot_history: list[Row]
    command: str | None
    fidelity: list[Row]
    baselines: list[Row]
    attempt_baselines: list[Row]
    attempts: list[Row]  # mitigation attempts, each judged against its run's baseline
    failed: list[Row]
    methods: list[Row]
    observations: list[Row]
    next_steps: list[Row]
    preserved: list[Row]
    preserved_kept: list[Row]
    counts: dict[str, int]
    release_requested: bool
    release_last_copy: bool
    path: str
    released: list[Row]
    text: str
    diagnosis: Row | None = None  # `diagnose` on the task's snapshot, its experiments with the attempts that ran them
    # what to change in the trainer that wrote the snapshot: {trainer, label, known, methods: [{slug, settings, ...}]}
    trainer: Row | None = None
    # hypothesis replays (loss settings scoped to ranks), each judged against the recording: its `finding` reads
    # "reproduced under `aux_loss_coef=10.24@1`"
    hypotheses: list[Row] = field(default_factory=list)
