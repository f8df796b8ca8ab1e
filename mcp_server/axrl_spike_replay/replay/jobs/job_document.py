"""A replay job as JSON, for processes a launcher starts on other machines (torchrun, srun): no pickle crosses.

The spawn launcher hands a `WorkerJob` to its processes by pickling it between processes of one tree. A process
that torchrun starts on another node reads its job from a request file instead, so the job travels as a JSON
document: each field by its own rule (the model spec as its run-config section, each config's loss and routing
as their sections, the counts and the spike bar as plain numbers), and `job_of_document` gives back a job equal
to the one sent (tests/replay/test_job_document.py checks it for every mitigation). A field added to `WorkerJob`
later travels as is when it is a plain JSON value; anything else is refused here by name, so a job never arrives
without part of itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.mitigation.recompute import Recompute
from axrl_spike_replay.models.policy import parse_model_config
from axrl_spike_replay.replay.compute.clean_gradient import SpikeBar
from axrl_spike_replay.replay.compute.worker_job import WorkerJob
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.precision import PrecisionPolicy
from axrl_spike_replay.training.routing_config import RoutingConfig
from axrl_spike_replay.training.sample_masks import SampleFilter

JOB_FORMAT = "axrl-replay-job"
JOB_VERSION = 1
_OWN_RULES = {"model", "configs", "assignment", "counts", "spike_bar", "precision"}


def job_document(job: WorkerJob) -> dict[str, Any]:
    """`job` as a JSON-able mapping; ConfigError naming a field that has no JSON form."""
    doc: dict[str, Any] = {"format": JOB_FORMAT, "version": JOB_VERSION}
    for item in dataclasses.fields(job):
        value = getattr(job, item.name)
        if item.name == "model":
            doc["model"] = value.to_dict()
        elif item.name == "configs":
            doc["configs"] = [_config_document(cfg) for cfg in value]
        elif item.name == "assignment":
            doc["assignment"] = [list(ranks) for ranks in value]
        elif item.name == "counts":
            doc["counts"] = value.to_doc() if value is not None else None
        elif item.name == "spike_bar":
            doc["spike_bar"] = dataclasses.asdict(value) if value is not None else None
        elif item.name == "precision":
            doc["precision"] = value.describe() if value is not None else None
        elif _plain(value):
            doc[item.name] = list(value) if isinstance(value, tuple) else value
        else:
            raise ConfigError(
                f"WorkerJob.{item.name} ({type(value).__name__}) has no JSON form for a launched worker; give it a "
                "rule in replay/jobs/job_document.py"
            )
    return doc


def job_of_document(doc: Mapping[str, Any]) -> WorkerJob:
    """The job a `job_document` describes; ConfigError saying what is wrong otherwise."""
    if doc.get("format") != JOB_FORMAT or doc.get("version") != JOB_VERSION:
        raise ConfigError(f"not a replay job document ({JOB_FORMAT} version {JOB_VERSION})")
    names = {item.name for item in dataclasses.fields(WorkerJob)}
    unknown = sorted(set(doc) - names - {"format", "version"})
    if unknown:
        raise ConfigError(f"the replay job has unknown field(s) {shown(unknown, 120)}: a newer sender?")
    values: dict[str, Any] = {k: v for k, v in doc.items() if k in names and k not in _OWN_RULES}
    for key in ("configs", "assignment", "model"):
        if key not in doc:
            raise ConfigError(f"the replay job has no `{key}`")
    values["model"] = parse_model_config(dict(doc["model"]))
    values["configs"] = tuple(_config_of(item) for item in doc["configs"])
    values["assignment"] = tuple(tuple(int(r) for r in ranks) for ranks in doc["assignment"])
    counts = doc.get("counts")
    values["counts"] = GlobalCounts.from_doc(counts, "the replay job", "counts") if counts is not None else None
    bar = doc.get("spike_bar")
    values["spike_bar"] = SpikeBar(float(bar["median_norm"]), float(bar["threshold"])) if bar is not None else None
    precision = doc.get("precision")
    values["precision"] = _precision_of(precision) if precision is not None else None
    try:
        return WorkerJob(**values)
    except TypeError as exc:
        raise ConfigError(f"the replay job is incomplete ({exc})") from None


def _precision_of(doc: Any) -> PrecisionPolicy:
    """The precision policy a job document carries (its `describe()`: the three dtypes and their source)."""
    if not isinstance(doc, Mapping):
        raise ConfigError("the replay job's `precision` is not a mapping")
    policy = PrecisionPolicy.from_dict({k: v for k, v in doc.items() if k != "source"}, "the replay job's precision")
    return dataclasses.replace(policy, source=str(doc.get("source", policy.source)))


def _plain(value: Any) -> bool:
    """A JSON scalar, or a list/tuple/mapping of them (nested)."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return True  # non-finite floats travel as JSON's NaN / Infinity, which Python's json reads back
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _config_document(cfg: AppliedConfig) -> dict[str, Any]:
    samples = cfg.samples
    if samples.tokens is not None:  # only the clean gradient's own probes drop single tokens, never a job's config
        raise ConfigError(f"{cfg.label}: a config that leaves out single loss tokens cannot be sent to a worker")
    return {
        "config_id": cfg.config_id,
        "mitigations": _mitigations(cfg),
        "loss": cfg.loss.to_dict(),
        "routing": cfg.routing.to_dict(),
        "weights": cfg.weights,
        "samples": {
            "outlier_threshold": samples.outlier_threshold,
            "outlier_scope": samples.outlier_scope,
            "drop": sorted([rank, index] for rank, index in samples.drop),
            "drop_ranks": sorted(samples.drop_ranks),
            "keep_ranks": sorted(samples.keep_ranks) if samples.keep_ranks is not None else None,
        },
        "recompute": [list(item) for item in sorted(cfg.recompute.items, key=_item_order)],
        "resolved": dict(cfg.resolved),
        "rank_losses": [[rank, loss.to_dict()] for rank, loss in sorted(cfg.rank_losses.items())],
    }


def _item_order(item: tuple[str, int | None, int | None]) -> tuple[str, int, int]:
    """A recompute item's place in the document (None, for every rank or layer, first)."""
    name, rank, layer = item
    return name, -1 if rank is None else rank, -1 if layer is None else layer


def _config_of(doc: Mapping[str, Any]) -> AppliedConfig:
    samples = doc.get("samples") or {}
    loss = dict(doc["loss"])
    return AppliedConfig(
        config_id=str(doc["config_id"]),
        mitigations=dict(doc.get("mitigations") or {}),
        loss=LossConfig.from_dict(loss, "the replay job's loss"),
        routing=RoutingConfig.from_dict(dict(doc["routing"]), "the replay job's routing"),
        weights=doc.get("weights"),
        samples=SampleFilter(
            outlier_threshold=samples.get("outlier_threshold"),
            outlier_scope=samples.get("outlier_scope", "batch"),
            drop=frozenset((int(r), int(i)) for r, i in samples.get("drop") or ()),
            drop_ranks=frozenset(int(r) for r in samples.get("drop_ranks") or ()),
            keep_ranks=frozenset(int(r) for r in keep) if (keep := samples.get("keep_ranks")) is not None else None,
        ),
        recompute=Recompute(
            frozenset(
                (str(name), None if rank is None else int(rank), None if layer is None else int(layer))
                for name, rank, layer in doc.get("recompute") or ()
            )
        ),
        resolved=dict(doc.get("resolved") or {}),
        rank_losses={
            int(rank): LossConfig.from_dict(dict(own), f"the replay job's loss of rank {rank}")
            for rank, own in doc.get("rank_losses") or ()
        },
    )


def _mitigations(cfg: AppliedConfig) -> dict[str, Any]:
    """A config's normalised mitigations (plain values already: they come from YAML or `NAME=VALUE`)."""
    for name, value in cfg.mitigations.items():
        if not _plain(value):
            raise ConfigError(f"{cfg.label}: mitigation {name} value {shown(value, 60)} has no JSON form")
    return dict(cfg.mitigations)
