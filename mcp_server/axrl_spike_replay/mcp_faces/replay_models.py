"""Output schemas of the replay tools. The library's own dataclasses live in modules that import torch, so they
are mirrored here (tests keep the fields in step) and the server starts without torch."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from axrl_spike_replay.replay.result import ReplayResult
from axrl_spike_replay.vocabulary import Fidelity


class SweepView(BaseModel):
    """A sweep: the baseline replay and one replay result per config, each judged against the baseline.

    Mirrors `replay.sweep.SweepResult` (which imports torch; a test keeps the fields in step)."""

    snapshot: str = Field(description="The snapshot replayed")
    fidelity: Fidelity = Field(description="full, or reduced (fewer processes than the saved world size: a diagnostic)")
    world_size_saved: int = Field(description="Ranks of the training run")
    world_size_used: int = Field(description="Replay processes")
    device: str = Field(description="cpu or cuda")
    threshold: float = Field(description="Spike threshold (ratio to the median) the verdicts compare against")
    baseline: ReplayResult = Field(description="The baseline replay (no mitigation)")
    results: list[ReplayResult] = Field(description="One result per config, in the order given")
    output_dir: str = Field("", description="tmp/spike-replay/<job>/<timestamp>/ holding every result")
    timings: dict[str, float] = Field(default_factory=dict, description="Seconds: load, total")


class SampleView(BaseModel):
    """One sample's share of the spike (mirrors `replay.attribution.SampleContribution`)."""

    rank: int = Field(description="Saved data-parallel rank")
    sample: int = Field(description="Sample index in that rank's batch")
    contribution: float = Field(description="<g_s, g> / ||g||: this sample's part of the global grad norm")
    share: float = Field(description="contribution / grad_norm")
    advantage: float = Field(description="The sample's advantage")
    reward: float | None = Field(None, description="The sample's reward")
    max_abs_log_ratio: float = Field(description="Largest |log pi - log pi_base| on its loss tokens")
    loss_tokens: int = Field(description="Tokens of it in the loss")
    group: int | None = Field(None, description="Prompt group")


class AttributionView(BaseModel):
    """Each sample's contribution to the spike's gradient, top K ranked (mirrors `replay.attribution.Attribution`)."""

    snapshot: str = Field(description="The snapshot")
    grad_norm: float = Field(description="Replayed global grad norm")
    recorded_grad_norm: float = Field(description="Grad norm the trainer recorded")
    rel_diff: float | None = Field(None, description="|grad_norm - recorded| / recorded")
    fidelity: Fidelity = Field(description="full, or reduced (several saved ranks in one process)")
    world_size_saved: int = Field(description="Ranks of the training run")
    total_samples: int = Field(description="Samples across all ranks")
    samples: list[SampleView] = Field(description="The top samples by contribution")
    router_term: float = Field(description="Batch-level router losses' part of the norm (not per sample)")
    contribution_sum: float = Field(description="Sum over all samples plus router_term (equals grad_norm)")
    sum_rel_error: float = Field(description="|contribution_sum - grad_norm| / grad_norm")
    method: str = Field("jvp", description="How contributions were computed")
    log_ratio_base: str = Field("old", description="Logprobs the log-ratio signal is taken against")
    mitigations: dict[str, Any] = Field(default_factory=dict, description="Mitigations applied before attributing")
    note: str = Field("", description="How to read router_term")
    timings: dict[str, float] = Field(default_factory=dict, description="Seconds")
    output_dir: str = Field("", description="Where attribution.json was written")
