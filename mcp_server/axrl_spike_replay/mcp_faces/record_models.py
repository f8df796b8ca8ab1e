"""Output schemas of the investigation-record tools. The library returns the views of `workspace.task_record.views`;
these describe their JSON (`to_jsonable` of a view) field by field, naming what an agent decides on and letting every
other field through (`extra="allow"`), so the schema never hides data."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from axrl_spike_replay.vocabulary import Fidelity, Verdict

Number = float | str | None  # non-finite values are null (records written before that spell them "inf" / "nan")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Note(_Open):
    time: str = Field(description="When it was written (UTC, ISO 8601)")
    text: str = Field(description="The note")


class ExperimentRow(_Open):
    id: str = Field(description="Attempt id, e.g. E3 — what method_add takes as `attempt`")
    verdict: Verdict = Field(
        description="reproduced / not_reproduced (baseline, and a hypothesis judged against the recording); "
        "cleared / partial / no_effect / worse / baseline_not_a_spike (mitigated)"
    )
    fidelity: Fidelity = Field(description="full, or reduced (a diagnostic)")
    change: str = Field(
        description="The mitigations (or patch, or 'hypothesis NAME=VALUE@RANKS') in words; 'baseline' for none"
    )
    grad_norm: Number = Field(None, description="Replayed global grad norm")
    ratio_to_median: Number = Field(None, description="grad_norm / the saved median norm")
    change_vs_baseline: Number = Field(None, description="grad_norm / baseline grad norm - 1")
    mitigations: dict[str, Any] = Field(default_factory=dict, description="Normalised mitigation config")
    hypothesis: dict[str, Any] = Field(
        default_factory=dict, description="A hypothesis replay's loss settings scoped to ranks (no mitigation)"
    )
    finding: str | None = Field(None, description="A hypothesis: 'reproduced under `aux_loss_coef=10.24@1`' or not")
    result_path: str | None = Field(None, description="Its replay_result.json")


class FailedAttempt(_Open):
    id: str = Field(description="Failure id, e.g. F1")
    reason: str = Field(description="Why it failed")
    command: str = Field("", description="What was run")


class TaskView(_Open):
    """The task of one investigation: its sections and where its files are."""

    job: str = Field(description="Job name")
    snapshot: str | None = Field(None, description="Active snapshot")
    command: str | None = Field(None, description="Replay command people can rerun")
    experiments: list[ExperimentRow] = Field(default_factory=list, description="Every logged replay, in order")
    failed: list[FailedAttempt] = Field(default_factory=list, description="Failed attempts with reasons")
    observations: list[Note] = Field(default_factory=list, description="Observations section")
    next_steps: list[Note] = Field(default_factory=list, description="Next steps section")
    methods: list[dict[str, Any]] = Field(default_factory=list, description="Methods written from this task")
    task_file: str = Field(description="The markdown task file people read")
    state_file: str = Field(description="The structured state the markdown is rendered from")


class MethodEntry(_Open):
    slug: str = Field(description="Method name (file spike-mitigation-methods/<slug>.md)")
    status: str = Field(description="proven, partial, diagnostic (reduced fidelity), or unknown")
    summary: str = Field("", description="One line: change and effect")
    path: str | None = Field(None, description="The method file")
    source: str = Field("workspace", description="workspace (this workspace's method) or shipped (the tool's library)")
    rank: int = Field(
        0,
        description="Place in the ranking: proven first, then cosine to clean (high first; a rough one, "
        "clean_reached false, after the others), then token fraction (low first)",
    )
    cosine_to_clean: float | None = Field(
        None,
        description="Cosine of the mitigated gradient with the clean gradient (the baseline without the fewest "
        "highest-pull loss tokens that bring it under the spike bar); near 1: the healthy gradient kept intact",
    )
    clean_reached: bool | None = Field(
        None,
        description="Whether that clean gradient got under the spike bar; false: the spike is not carried by a "
        "minority of tokens and the cosine is a rough reference (None: written before this was recorded)",
    )
    token_fraction: float | None = Field(None, description="Fraction of loss tokens the method masked or changed")


class MethodList(BaseModel):
    """The recorded methods of the workspace."""

    methods: list[MethodEntry] = Field(description="Every method file with its status and summary")


class MethodAdded(MethodEntry):
    """The method file just written, with its front matter and the key signals quoted in it."""

    attempt: str = Field(description="The attempt it was written from")
    verdict: Verdict = Field(description="The attempt's verdict")
    fidelity: Fidelity = Field(description="The attempt's fidelity")
    signals: dict[str, Any] = Field(default_factory=dict, description="Key signals quoted in the file")
    warnings: list[str] = Field(
        default_factory=list,
        description="Written, but worth a look: e.g. a name that says another mitigation than the attempt ran",
    )


class ReportWritten(_Open):
    """The report file and what it says."""

    job: str = Field(description="Job name")
    path: str = Field(description="tmp/spike-replay/<job>/report.md")
    text: str = Field(description="The report's markdown")
    output_dir: str | None = Field(None, description="The job's output dir the snapshot came from")
    snapshot: str | None = Field(None, description="The active snapshot")
    preserved: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Each preserved copy of its snapshots; in_use: current one's, released; last_copy: source gone",
    )
    released: list[dict[str, Any]] = Field(
        default_factory=list, description="With release: each copy, released or not, and why not (error)"
    )
    counts: dict[str, int] = Field(default_factory=dict, description="experiments, failed, methods")
