"""Diagnose's model evidence of a snapshot's step (`replay.analyses.step_evidence_forward`): whole in this process, or
sharded by FSDP2 over several (`replay.analyses.sharded_evidence`), or its signal check streamed
(`replay.analyses.streamed_evidence`); the one entry, which decides which and says nothing is written."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.request.request_parts import RUN_TIMEOUT_S
from axrl_spike_replay.experiment.step_evidence import StepEvidence
from axrl_spike_replay.replay.analyses.sharded_evidence import EvidenceJob, run_sharded_evidence
from axrl_spike_replay.replay.analyses.step_evidence_forward import whole_evidence
from axrl_spike_replay.replay.engine import check_device, replay_dir_for
from axrl_spike_replay.replay.plans.layout_plan import plan_layout
from axrl_spike_replay.replay.plans.shard_choice import check_whole_fits, whole_or_sharded_planned
from axrl_spike_replay.replay.reading.inputs import load_inputs, one_config
from axrl_spike_replay.vocabulary import Shard


def step_evidence(
    snapshot: str | Path,
    *,
    mitigations: dict[str, Any] | None = None,
    device: str = "cpu",
    channel: bool = True,
    cancel: threading.Event | None = None,
    shard: str = "auto",
    nproc: int | None = None,
    timeout_s: float = RUN_TIMEOUT_S,
    checkpoint: bool | None = None,
) -> StepEvidence:
    """The signal check (and, with `channel`, the loss-term channel) of a snapshot's step; nothing written.

    `shard`: off, the whole model in this process; on, FSDP2 over `nproc` spawned processes (default: the saved world
    size); auto, sharded when the whole model does not fit one process here; streamed, the signal check alone, one
    decoder layer at a time in this process (`replay.analyses.streamed_evidence`; the channel is refused). The loss
    channel goes micro-batch by micro-batch, the decoder layers checkpointed as `checkpoint` says (None: as the replay
    plan of the layout says)."""
    check_device(device)
    start = time.perf_counter()
    with replay_dir_for(snapshot) as (replay_dir, legacy):
        inputs = load_inputs(snapshot, replay_dir, legacy)
        cfg = one_config(inputs, mitigations)
        if shard == Shard.STREAMED:
            if channel:
                raise ConfigError(
                    "`shard` streamed: the loss-term channel takes a gradient per loss term and per rank and is not "
                    "computed streamed; the signal check alone is (channel off), or use `shard` on or off",
                    "shard",
                )
            from axrl_spike_replay.replay.analyses.streamed_evidence import streamed_evidence

            signals = streamed_evidence(inputs, cfg, device, cancel)
            return StepEvidence(signals=signals, channel=None, seconds=time.perf_counter() - start)
        layout = plan_layout(inputs.world_size, nproc)
        choice = whole_or_sharded_planned(shard, inputs, device, layout.nproc, checkpoint)
        if choice.shard:
            job = EvidenceJob(inputs, cfg, layout.assignment, device, channel, choice.checkpoint)
            signals, terms = run_sharded_evidence(job, timeout_s, cancel)
        else:
            check_whole_fits(inputs.model, inputs.effective_precision, device, "diagnose's model evidence")
            signals, terms = whole_evidence(inputs, cfg, device, channel, cancel, choice.checkpoint)
    return StepEvidence(signals=signals, channel=terms, seconds=time.perf_counter() - start)
