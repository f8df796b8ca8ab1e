"""Route 1 streamed: a Megatron snapshot replayed one decoder layer at a time, each layer's transformers parameters
read from its own region of the Megatron `torch_dist` checkpoint (`models.mcore.megatron_source`), computes the whole
route-1 replay's step: grad norm, per-parameter and per-rank norms under the same (transformers) names, top
parameters, rank losses and verdict within 1e-6 relative (CPU float32), at saved world sizes 2 (the snapshot
megatron-core's own training wrote, EP=2) and 1 (its rank 0 with the one-process checkpoint). Each saved layout
(TP=2 with ETP=2, EP=2, PP=2) reads a layer into exactly what route 1 loads, costing that layer's bytes; the
attribution streams too."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.models.policy import build_policy, load_policy_weights, parse_model_config
from axrl_spike_replay.replay.compute.worker import compute
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.engine import replay_session, run_replay
from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights, check_streamable
from axrl_spike_replay.replay.streamed.streamed_job import compute_streamed
from axrl_spike_replay.testing.megatron_checkpoints import tiny_section
from axrl_spike_replay.vocabulary import Backend, Shard, Verb

pytestmark = pytest.mark.slow

SAME = 1e-6


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= SAME * max(abs(a), abs(b), 1e-30)


def _job(snapshot: Path) -> WorkerJob:
    """The engine's job for `snapshot`, every saved rank in one process."""
    with replay_session(replay_request(What(snapshot), how=How(shard=Shard.OFF)), [], "replay") as session:
        job = session.worker_job()
    return dataclasses.replace(job, assignment=(tuple(range(job.world_size)),))


def _assert_same(whole: Sequence[ConfigOutcome], streamed: Sequence[ConfigOutcome]) -> None:
    for a, b in zip(whole, streamed, strict=True):
        assert _close(a.grad_norms[0], b.grad_norms[0]), (a.grad_norms, b.grad_norms)
        assert [p["name"] for p in a.top_params] == [p["name"] for p in b.top_params]
        assert [m["rank"] for m in a.rank_metrics] == [m["rank"] for m in b.rank_metrics]
        assert all(_close(m["loss"], n["loss"]) for m, n in zip(a.rank_metrics, b.rank_metrics, strict=True))
        assert a.param_grad_norms is not None and b.param_grad_norms is not None
        assert a.param_grad_norms.keys() == b.param_grad_norms.keys()
        assert any(n.startswith("model.layers.1.self_attn.") for n in b.param_grad_norms)  # transformers' names
        for name, value in a.param_grad_norms.items():
            assert _close(value, b.param_grad_norms[name]), name
        assert a.rank_param_grad_norms is not None and b.rank_param_grad_norms is not None
        for rank, norms in a.rank_param_grad_norms.items():
            assert norms.keys() == b.rank_param_grad_norms[rank].keys()
            assert all(_close(v, b.rank_param_grad_norms[rank][n]) for n, v in norms.items()), rank


def test_streamed_route_1_is_the_whole_route_1_replay_at_world_size_2(
    megatron_capture: Path, megatron_route1_replay: ReplayResult
) -> None:
    from axrl_spike_replay.replay.plans.replay_plan import Capacity, plan_replay

    job = _job(megatron_capture)
    assert job.world_size == 2
    lines: list[str] = []
    _assert_same(compute(job, 0), compute_streamed(job, progress=lines.append))
    # the plan's row counts the bytes the layer reads cost: the transformers layer's, as the Megatron regions hold them
    row = plan_replay(megatron_capture, capacity=Capacity("here", "cpu", 1, 8 << 30, "test"), shard="streamed").streamed
    assert row is not None
    assert f"streamed: read {row.bytes_read:,} bytes of weights ({row.layer_reads} layer reads" in "\n".join(lines)
    whole = megatron_route1_replay
    streamed = run_replay(replay_request(What(megatron_capture), how=How(shard=Shard.STREAMED)))
    assert streamed.verdict == whole.verdict == "reproduced" and streamed.fidelity == "full"
    assert whole.grad_norm is not None and streamed.grad_norm is not None
    assert _close(streamed.grad_norm, whole.grad_norm)
    assert streamed.shard_reason.startswith("shard streamed")
    assert [p.name for p in streamed.top_params] == [p.name for p in whole.top_params]
    # the saved ranks split over two processes, each streaming its rank from the checkpoint: the same figures
    split = run_replay(replay_request(What(megatron_capture), how=How(shard=Shard.STREAMED, nproc=2)))
    assert split.grad_norm == streamed.grad_norm and split.verdict == streamed.verdict


def _one_rank(capture: Path, checkpoint: Path, into: Path) -> Path:
    """`capture`'s rank 0 as a world-size-1 snapshot, its weights the checkpoint one megatron-core process saved."""
    snapshot = into / capture.name
    shutil.copytree(capture, snapshot)
    for old in [*snapshot.glob("*.distcp"), *snapshot.glob("*rank1.pt")]:
        old.unlink()
    for name in [".metadata", "metadata.json", "common.pt", *(p.name for p in checkpoint.glob("*.distcp"))]:
        shutil.copy2(checkpoint / name, snapshot / name)
    meta = json.loads((snapshot / "axrl_metadata.json").read_text())
    meta["parallel"].update(world_size=1, dp=1, ep=1)
    (snapshot / "axrl_metadata.json").write_text(json.dumps(meta))
    config = yaml.safe_load((snapshot / "run_config.yaml").read_text())
    config["parallel"].update({k: 1 for k in ("world_size", "dp", "ep") if k in config["parallel"]})
    (snapshot / "run_config.yaml").write_text(yaml.safe_dump(config))
    return snapshot


def test_streamed_route_1_is_the_whole_route_1_replay_at_world_size_1(
    megatron_capture: Path, megatron_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    snapshot = _one_rank(megatron_capture, megatron_checkpoints["tp1"], tmp_path)
    job = _job(snapshot)
    assert job.world_size == 1
    _assert_same(compute(job, 0), compute_streamed(job))
    whole = run_replay(replay_request(What(snapshot)))
    streamed = run_replay(replay_request(What(snapshot), how=How(shard=Shard.STREAMED)))
    assert streamed.verdict == whole.verdict and whole.grad_norm is not None and streamed.grad_norm is not None
    assert _close(streamed.grad_norm, whole.grad_norm)


def _reads_what_route_1_loads(section: dict[str, Any], reference: Path, checkpoint: Path) -> None:
    """Layer by layer, every tensor read from `checkpoint` equals the whole route-1 load of `reference`'s, bit for
    bit; a layer costs its own bytes."""
    spec = parse_model_config(section)
    whole = build_policy(spec)
    load_policy_weights(whole, spec, reference)
    saved = whole.state_dict()
    weights = StreamedWeights(spec, str(checkpoint), "cpu", None)
    weights.check()
    weights.load_ends()
    read = weights.read.bytes_read
    for name in weights.end_names:
        assert torch.equal(weights.policy.state_dict()[name], saved[name]), name
    for index in range(weights.n_layers):
        layer = weights.load_layer(index)
        prefix = weights.layer_prefixes[index]
        for name, value in layer.state_dict().items():
            assert torch.equal(value, saved[prefix + name]), prefix + name
        own = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
        assert weights.read.bytes_read - read == own
        read = weights.read.bytes_read
        weights.free_layer(index)
    weights.close()


@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2"])
def test_each_layer_reads_what_route_1_loads_from_every_saved_layout(
    megatron_checkpoints: dict[str, Path], layout: str
) -> None:
    _reads_what_route_1_loads(tiny_section(), megatron_checkpoints["tp1"], megatron_checkpoints[layout])


@pytest.mark.matrix
@pytest.mark.parametrize("layout", ["tp1", "ep2", "tp2"])
def test_a_deepseek_v3_layer_reads_what_route_1_loads(deepseek_layouts: dict[str, Path], layout: str) -> None:
    """Per-layer keys (`decoder.layers.<i>.…`), a dense first layer's fused gate/up, MLA, the router's expert bias."""
    section = tiny_section("deepseek_v3")
    _reads_what_route_1_loads(section, deepseek_layouts["tp1"], deepseek_layouts[layout])


@pytest.mark.matrix
def test_a_deepseek_v3_spike_streams_as_the_whole_route_1_replay(deepseek_capture: Path) -> None:
    job = _job(deepseek_capture)
    _assert_same(compute(job, 0), compute_streamed(job))


def test_what_route_1_refuses_streamed_refuses_by_name(megatron_checkpoints: dict[str, Path]) -> None:
    mixtral = parse_model_config(tiny_section("mixtral"))  # a qwen3_moe checkpoint: its QK norms are not placed
    with pytest.raises(SnapshotError, match=r"does not place.*q_layernorm.*--backend command"):
        StreamedWeights(mixtral, str(megatron_checkpoints["tp1"]), "cpu", None)
    tied = parse_model_config(tiny_section(config={**tiny_section()["config"], "tie_word_embeddings": True}))
    with pytest.raises(ConfigError, match="tied input and output embeddings") as refused:
        check_streamable(tied, None)
    assert refused.value.parameter == "shard"


def test_route_2_does_not_stream(megatron_capture: Path) -> None:
    from axrl_spike_replay.investigation.request import Where

    with pytest.raises(ConfigError, match="streamed replays a Megatron snapshot on route 1") as refused:
        replay_request(What(megatron_capture), where=Where(backend=Backend.MEGATRON), how=How(shard=Shard.STREAMED))
    assert refused.value.parameter == "shard"


def test_attribution_streams_on_route_1_as_whole(megatron_capture: Path) -> None:
    """`attribute --shard streamed` of the EP=2 capture: every sample's contribution and the router term within
    1e-6 of the grad norm of the whole route-1 attribution's."""
    from axrl_spike_replay.replay.analyses.attribution import attribute_spike

    whole = attribute_spike(replay_request(What(megatron_capture, verb=Verb.ATTRIBUTE), how=How(shard="off")))
    streamed = attribute_spike(replay_request(What(megatron_capture, verb=Verb.ATTRIBUTE), how=How(shard="streamed")))
    norm = whole.grad_norm
    assert norm is not None and streamed.grad_norm is not None and _close(streamed.grad_norm, norm)
    assert streamed.passes.startswith("streamed: 2 passes over the checkpoint")
    assert abs(streamed.router_term - whole.router_term) <= SAME * norm
    want = {(s["rank"], s["sample"]): s["contribution"] for s in whole.to_json()["samples"]}
    got = {(s["rank"], s["sample"]): s["contribution"] for s in streamed.to_json()["samples"]}
    assert got.keys() == want.keys() and len(got) == 8
    assert all(abs(got[k] - want[k]) <= SAME * norm for k in want)
