"""Evidence that needs the model: per-sample attribution, the per-rank signal check with the loss channel
(`replay.analyses.step_evidence_forward`), and route agreement per MoE layer merged over the ranks (read off the
signal check).

Both rebuild the snapshot's model with the replay engine on CPU: in this process, or, when the whole model does
not fit one process (or `shard` on), sharded with FSDP2 over several (`replay.analyses.sharded_attribution`,
`replay.analyses.sharded_evidence`). Attribution is one gradient pass plus one forward-mode pass over every rank batch
(see replay/analyses/attribution.py; sharded, one backward per sample), route agreement one no-grad forward per MoE
layer.
`diagnose` runs them itself only when that is cheap (a checkpoint of at most AUTO_MODEL_BYTES that the torch engine
can rebuild) or asked to (`model` always); otherwise it takes an attribution the caller already has and says what it
left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.request.request_parts import How
from axrl_spike_replay.experiment.result import Attribution
from axrl_spike_replay.experiment.step_evidence import SignalCheck, StepEvidence
from axrl_spike_replay.snapshot.metadata import read_json_document
from axrl_spike_replay.vocabulary import Shard

AUTO_MODEL_BYTES = 256 * 1024 * 1024  # above this, a CPU pass costs minutes: ask for an attribution instead


@dataclass
class LayerAgreement:
    """How often the snapshot's model, routing on its own scores in this layer (the recorded routes replayed in
    the others), picks the recorded experts: fractions of routed tokens whose expert set differs."""

    layer: int
    loss_tokens: int
    other_tokens: int
    loss_disagreement: float | None
    other_disagreement: float | None


@dataclass
class RouteAgreement:
    layers: list[LayerAgreement] = field(default_factory=list)
    routing_replay: str = ""  # the run's routing replay mode (recorded routes used in training unless "off")


def read_attribution(value: Attribution | dict[str, Any] | str | Path) -> Attribution:
    """An Attribution from an object, its JSON document or an `attribution.json` path."""
    if isinstance(value, Attribution):
        return value
    doc = value if isinstance(value, dict) else read_json_document(Path(value))
    if not isinstance(doc, dict) or not isinstance(doc.get("samples"), list):
        raise AxrlError("attribution: expected an attribution.json document with `samples`")
    try:
        return Attribution.from_json(doc)  # also one written under the old figure names
    except (TypeError, KeyError, AttributeError) as exc:
        raise AxrlError(f"attribution: not an attribution document ({exc})") from None


def model_bytes(snapshot: str | Path) -> int | None:
    """The checkpoint's tensor bytes, None when unreadable."""
    from axrl_spike_replay.errors import SnapshotError
    from axrl_spike_replay.snapshot.dcp.checkpoint import summarize_checkpoint

    try:
        return summarize_checkpoint(Path(snapshot)).bytes
    except (SnapshotError, OSError):
        return None


def run_attribution(snapshot: str | Path, top: int, how: How) -> Attribution:
    """Attribute the step here (CPU, nothing written): whole, sharded or streamed as the request's `how` says."""
    from axrl_spike_replay.experiment.request.request_parts import ReplayRequest, What
    from axrl_spike_replay.replay.analyses.attribution import attribute_spike
    from axrl_spike_replay.vocabulary import Verb

    return attribute_spike(ReplayRequest(what=What(Path(snapshot), verb=Verb.ATTRIBUTE, top=top), how=how))


def run_step_evidence(snapshot: str | Path, how: How) -> StepEvidence:
    """The signal check and the loss channel of the step, here (CPU, nothing written): whole, sharded or streamed as
    `how` says; streamed, the signal check alone (the channel is not computed streamed)."""
    from axrl_spike_replay.replay.analyses.step_evidence_run import step_evidence

    streamed = how.shard == Shard.STREAMED
    return step_evidence(snapshot, shard=how.shard, nproc=how.nproc, channel=not streamed)


def routes_of(check: SignalCheck) -> RouteAgreement:
    """The per-rank route comparison of a signal check, merged over the ranks per MoE layer (token-weighted)."""
    counts: dict[int, list[float]] = {}  # layer -> [loss differ, loss total, other differ, other total]
    for rank in check.ranks:
        for x in rank.routes:
            c = counts.setdefault(x.layer, [0.0, 0.0, 0.0, 0.0])
            c[0] += (x.loss_disagreement or 0.0) * x.loss_tokens
            c[1] += x.loss_tokens
            c[2] += (x.other_disagreement or 0.0) * x.other_tokens
            c[3] += x.other_tokens
    result = RouteAgreement(routing_replay=check.routing_replay)
    for layer in sorted(counts):
        d_loss, n_loss, d_other, n_other = counts[layer]
        result.layers.append(
            LayerAgreement(
                layer,
                int(n_loss),
                int(n_other),
                d_loss / n_loss if n_loss else None,
                d_other / n_other if n_other else None,
            )
        )
    return result
