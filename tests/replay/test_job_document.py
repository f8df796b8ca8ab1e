"""A replay job sent to launched workers as JSON arrives equal to the one sent: every mitigation's config, the
model spec (tiny MoE and transformers), the counts and the spike bar; a field without a JSON form is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigation_catalogue import EXAMPLES
from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_config
from axrl_spike_replay.experiment.mitigation.objective_mitigations import OBJECTIVES
from axrl_spike_replay.replay.compute.clean_gradient import SpikeBar
from axrl_spike_replay.replay.compute.worker_job import WorkerJob
from axrl_spike_replay.replay.jobs.job_document import job_document, job_of_document
from axrl_spike_replay.replay.plans.layout_plan import plan_layout
from axrl_spike_replay.replay.reading.inputs import load_inputs
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.sample_masks import SampleFilter, TokenDrop
from axrl_spike_replay.training.trl_settings import TrlSettings

TRL_NAMES = {m.name for m in OBJECTIVES}


def _job(snapshot: Path, configs: list[dict], **fields: object) -> WorkerJob:
    inputs = load_inputs(snapshot, snapshot, False)
    # TRL's objectives have a meaning on a TRL snapshot only: they are applied to the same loss under convention trl
    trl = LossConfig(convention="trl", trl=TrlSettings())
    applied = [apply_config({}, inputs.loss, inputs.routing)]
    applied += [
        apply_config(
            parse_config(c), trl if set(c) & TRL_NAMES else inputs.loss, inputs.routing, inputs.model.moe_layer_ids
        )
        for c in configs
    ]
    values: dict = {
        "replay_dir": str(snapshot),
        "model": inputs.model,
        "configs": tuple(applied),
        "world_size": inputs.world_size,
        "assignment": plan_layout(inputs.world_size, 1).assignment,
        **fields,
    }
    return WorkerJob(**values)


def _through_json(job: WorkerJob) -> WorkerJob:
    return job_of_document(json.loads(json.dumps(job_document(job))))


def test_every_mitigation_arrives_as_sent(spike_snapshot: Path, tmp_path: Path) -> None:
    initial = tmp_path / "initial"
    initial.mkdir()
    configs = [{name: str(initial) if name == "initial_model" else value} for name, value in EXAMPLES.items()]
    configs.append({"current_routing_layers": "first", "advantage_clip": 0.5, "ratio_outlier_mask": "token"})
    job = _job(
        spike_snapshot,
        configs,
        device="cpu",
        repeat=2,
        top=7,
        counts=GlobalCounts(2, 120.0, 8.0),
        spike_bar=SpikeBar(0.25, 5.0),
    )
    assert len(job.configs) == len(EXAMPLES) + 2
    arrived = _through_json(job)
    assert arrived == job
    for sent, got in zip(job.configs, arrived.configs, strict=True):  # field by field, for a readable failure
        assert got == sent, sent.config_id
    assert arrived.configs[-1].resolved == job.configs[-1].resolved and arrived.configs[-1].resolved


def test_a_transformers_policy_and_a_job_without_counts_or_bar(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    snapshot = record_hf_snapshot(tmp_path / "snaps", "qwen2_moe", world_size=2)
    job = _job(snapshot, [{"drop_samples": "1:2"}, {"routing_replay": "off"}])
    assert job.counts is None and job.spike_bar is None
    arrived = _through_json(job)
    assert arrived == job and arrived.model == job.model and arrived.configs[1].samples.drop == {(1, 2)}


def test_a_field_without_a_json_form_is_refused_by_name(spike_snapshot: Path) -> None:
    job = _job(spike_snapshot, [])
    probe = dataclasses.replace(job.configs[0], samples=SampleFilter(tokens=TokenDrop({})))
    with pytest.raises(ConfigError, match="leaves out single loss tokens"):
        job_document(dataclasses.replace(job, configs=(probe,)))
    with pytest.raises(ConfigError, match="not a replay job document"):
        job_of_document({"format": "something else"})
    doc = job_document(job)
    with pytest.raises(ConfigError, match="unknown field"):
        job_of_document({**doc, "shard_plan": {"x": 1}})


def test_a_sharded_job_in_the_trainers_precision_arrives_as_sent(spike_snapshot: Path) -> None:
    from axrl_spike_replay.training.precision import PrecisionPolicy

    precision = PrecisionPolicy(param_dtype="bfloat16", reduce_dtype="float32")
    job = _job(spike_snapshot, [{"advantage_clip": 0.5}], shard=True, precision=precision)
    arrived = _through_json(job)
    assert arrived == job and arrived.shard is True and arrived.precision == precision
    unrecorded = _job(spike_snapshot, [], precision=PrecisionPolicy.of_model("float32"))
    assert _through_json(unrecorded).precision == PrecisionPolicy.of_model("float32")  # its source kept
