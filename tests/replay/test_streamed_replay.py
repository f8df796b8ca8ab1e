"""The streamed replay (one decoder layer at a time, every saved rank in one process) computes the whole replay's step.

Snapshots are recorded in this run with the trainer's own step functions (tiny_moe: tests/replay/tiny_snapshot.py;
transformers: `testing.hf_snapshot`, qwen2_moe has shared experts) at saved world sizes 1, 2 and 4. The whole replay
(`worker.compute`, every saved rank in one process) and the streamed one (`compute_streamed`) run the same job; their
grad norms, per-parameter norms, each rank's own per-parameter norms, top parameters, rank losses and (through the
engine) verdicts agree to 1e-6 relative, and the grad norm reproduces the recorded one. Nothing here compares with
numbers recorded elsewhere.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.errors import AxrlError, SnapshotError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.processes.rank_processes import RunCancelled
from axrl_spike_replay.replay.compute.worker import compute
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.engine import replay_session, run_replay
from axrl_spike_replay.replay.streamed.settings import StreamSettings
from axrl_spike_replay.replay.streamed.streamed_job import compute_streamed
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.vocabulary import Shard

SAME = 1e-6
CONFIGS = [{"mismatch_token_clip_max": 2}, {"kl_coef": 0.1, "entropy_coef": 0.01}, {"routing_replay": "off"}]


def job_of(snapshot: Path, configs: Sequence[dict[str, Any]] = ()) -> WorkerJob:
    """The job the engine makes for `snapshot` (and `configs`), every saved rank in one process."""
    with replay_session(replay_request(What(snapshot), how=How(shard=Shard.OFF)), list(configs), "replay") as session:
        job = session.worker_job()
    return dataclasses.replace(job, assignment=(tuple(range(job.world_size)),))


def close(a: float, b: float) -> bool:
    return abs(a - b) <= SAME * max(abs(a), abs(b), 1e-30)


def assert_same(whole: Sequence[ConfigOutcome], streamed: Sequence[ConfigOutcome]) -> None:
    assert [o.config_id for o in whole] == [o.config_id for o in streamed]
    for a, b in zip(whole, streamed, strict=True):
        assert close(a.grad_norms[0], b.grad_norms[0]), (a.config_id, a.grad_norms, b.grad_norms)
        assert [p["name"] for p in a.top_params] == [p["name"] for p in b.top_params]
        for p, q in zip(a.top_params, b.top_params, strict=True):
            assert close(p["grad_norm"], q["grad_norm"])
        assert [m["rank"] for m in a.rank_metrics] == [m["rank"] for m in b.rank_metrics]
        for m, n in zip(a.rank_metrics, b.rank_metrics, strict=True):
            assert close(m["loss"], n["loss"]), (m, n)
        assert a.footprint == b.footprint
        if a.param_grad_norms is None:
            assert b.param_grad_norms is None
            continue
        assert b.param_grad_norms is not None and a.param_grad_norms.keys() == b.param_grad_norms.keys()
        for name, value in a.param_grad_norms.items():
            assert close(value, b.param_grad_norms[name]), name
        assert a.rank_param_grad_norms is not None and b.rank_param_grad_norms is not None
        assert a.rank_param_grad_norms.keys() == b.rank_param_grad_norms.keys()
        for rank, norms in a.rank_param_grad_norms.items():
            assert norms.keys() == b.rank_param_grad_norms[rank].keys()
            for name, value in norms.items():
                assert close(value, b.rank_param_grad_norms[rank][name]), (rank, name)


def recorded(snapshot: Path) -> float:
    return read_metadata(snapshot)[0].grad_norm


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tiny_moe_streamed_is_the_whole_replay(tmp_path: Path, world_size: int) -> None:
    snapshot = record_tiny_snapshot(tmp_path, world_size=world_size)
    configs = CONFIGS if world_size == 2 else []
    job = job_of(snapshot, configs)
    whole, streamed = compute(job, 0), compute_streamed(job)
    assert_same(whole, streamed)
    assert close(streamed[0].grad_norms[0], recorded(snapshot))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("architecture", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_transformers_streamed_is_the_whole_replay(tmp_path: Path, architecture: str, world_size: int) -> None:
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        snapshot = record_hf_snapshot(tmp_path, architecture, world_size=world_size)
        configs = CONFIGS[:1] if world_size == 2 else []
        job = job_of(snapshot, configs)
        whole, streamed = compute(job, 0), compute_streamed(job)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert_same(whole, streamed)
    assert close(streamed[0].grad_norms[0], recorded(snapshot))


def test_hf_safetensors_weights_stream_as_the_dcp_ones(tmp_path: Path) -> None:
    """A snapshot whose weights are an HF safetensors directory (its DCP files replaced by `save_pretrained`'s of the
    same model) streams each layer through `safe_open`: every figure that of its DCP checkpoint, bit for bit."""
    import shutil

    from axrl_spike_replay.replay.compute.model_build import build_model
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        snapshot = record_hf_snapshot(tmp_path / "dcp", "qwen3_moe", world_size=2)
        job = job_of(snapshot, CONFIGS[:1])
        copy = tmp_path / "safetensors" / snapshot.name
        shutil.copytree(snapshot, copy, ignore=shutil.ignore_patterns(".metadata", "*.distcp"))
        build_model(job.model, str(snapshot), "cpu").causal_lm.save_pretrained(copy)
        assert list(copy.glob("*.safetensors")) and not list(copy.glob("*.distcp"))
        lines: list[str] = []
        dcp = compute_streamed(job)
        saved = compute_streamed(dataclasses.replace(job, replay_dir=str(copy)), progress=lines.append)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert any("layer reads" in line for line in lines), lines
    for a, b in zip(dcp, saved, strict=True):
        assert a.grad_norms == b.grad_norms and a.param_grad_norms == b.param_grad_norms, a.config_id
        assert a.rank_param_grad_norms == b.rank_param_grad_norms, a.config_id


def test_micro_batches_and_spilled_boundaries(tmp_path: Path) -> None:
    """Ranks of several micro-batches each (the trainer's split, recorded in the batch files), every boundary
    spilled to disk (host budget 0): the same step; the spill dir is gone after."""
    rank_lengths = (((4, 2, 3, 1, 4, 3), (8, 5, 7, 0, 3, 8)), ((2, 4, 1, 3, 2, 4), (2, 0, 6, 1, 8, 3)))
    loss = {"kl_coef": 0.01, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "is_base_logprobs": "rollout"}
    loss |= {"loss_agg_mode": "token-mean", "normalization": "per_rank"}
    snapshot = record_tiny_snapshot(tmp_path / "snap", rank_lengths=rank_lengths, prompt=4, loss=loss)
    for rank, sizes in {0: (4, 2), 1: (1, 2, 3)}.items():
        path = snapshot / f"batch_rank{rank}.pt"
        batch = torch.load(path, weights_only=True)
        parts, start = [], 0
        for size in sizes:
            parts.append({k: v[start : start + size] for k, v in batch.items()})
            start += size
        torch.save({"micro_batches": parts}, path)
    job = job_of(snapshot, CONFIGS[:1])
    spill = tmp_path / "spill"
    lines: list[str] = []
    streamed = compute_streamed(job, progress=lines.append, settings=StreamSettings(0, str(spill)))
    assert_same(compute(job, 0), streamed)
    assert any("spilled" in line and "(0 spilled)" not in line for line in lines), lines
    assert spill.is_dir() and not any(spill.iterdir())  # the store's own dir, removed with what it held


def test_each_layer_read_once_forward_once_per_backward(tmp_path: Path) -> None:
    """The forward reads each layer once for a forward group; the baseline's backward reads it once more, and the
    mitigated configs' backwards, taken together a layer at a time, once for all of them."""
    from axrl_spike_replay.replay.streamed import layer_weights

    snapshot = record_tiny_snapshot(tmp_path, world_size=2)
    # one forward group: the loss changes, not the forward; no spike bar, so no clean gradient is recomputed beside
    # the mitigated configs (test_streamed_signals counts those backwards)
    job = dataclasses.replace(job_of(snapshot, CONFIGS[:2]), spike_bar=None)
    reads: list[int] = []
    original = layer_weights.StreamedWeights._read_layer

    def counted(self: layer_weights.StreamedWeights, index: int) -> None:
        held = [i for i, layer in enumerate(self.program.layers) if not next(layer.parameters()).is_meta]
        assert len(held) <= 1, f"layer {index} read while {held} still held"  # at most the one computing
        reads.append(index)
        return original(self, index)

    layer_weights.StreamedWeights._read_layer = counted
    lines: list[str] = []
    try:
        outcomes = compute_streamed(job, progress=lines.append)
    finally:
        layer_weights.StreamedWeights._read_layer = original
    layers = 2
    assert reads == [*range(layers)] + [1, 0] * 2
    assert any(f"({len(reads)} layer reads" in line for line in lines), lines
    alone = [compute_streamed(dataclasses.replace(job, configs=(job.configs[0], cfg)))[1] for cfg in job.configs[1:]]
    assert [o.grad_norms for o in outcomes[1:]] == [o.grad_norms for o in alone]  # together as alone, bit for bit


def test_engine_verdicts_match(tmp_path: Path) -> None:
    """Through the engine: the streamed replay's result is the whole replay's (grad norm, verdict, fidelity)."""
    snapshot = record_tiny_snapshot(tmp_path, world_size=2)
    whole = run_replay(
        replay_request(What(snapshot, mitigations={"mismatch_token_clip_max": 2}), how=How(shard=Shard.OFF))
    )
    streamed = run_replay(
        replay_request(What(snapshot, mitigations={"mismatch_token_clip_max": 2}), how=How(shard=Shard.STREAMED))
    )
    assert streamed.verdict == whole.verdict and streamed.fidelity == whole.fidelity == "full"
    assert whole.grad_norm is not None and streamed.grad_norm is not None
    assert close(whole.grad_norm, streamed.grad_norm)
    assert streamed.shard_reason.startswith("shard streamed")
    base = run_replay(replay_request(What(snapshot), how=How(shard=Shard.STREAMED)))
    assert base.verdict == "reproduced" and base.consistency == run_replay(replay_request(What(snapshot))).consistency


def _without(snapshot: Path, out: Path, drop: str) -> Path:
    """A copy of `snapshot` whose checkpoint lacks the tensor `drop`."""
    import shutil

    from axrl_spike_replay.testing.hf_snapshot import save_dcp

    shutil.copytree(snapshot, out)
    state = {}
    from tiny_snapshot import MODEL

    from axrl_spike_replay.models.tiny_moe import TinyMoEPolicy

    model = TinyMoEPolicy(MODEL)
    from axrl_spike_replay.snapshot.dcp.checkpoint import load_model_state

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    load_model_state(snapshot, state)
    for path in out.glob("*.distcp"):
        path.unlink()
    (out / ".metadata").unlink()
    save_dcp(out, {k: v for k, v in state.items() if k != drop})
    return out


def test_missing_layer_entry_refused_before_the_forward(tmp_path: Path) -> None:
    from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights

    snapshot = record_tiny_snapshot(tmp_path / "snap", world_size=1)
    job = job_of(snapshot)
    broken = _without(snapshot, tmp_path / "broken", "blocks.1.qkv.weight")
    weights = StreamedWeights(job.model, str(broken), "cpu", job.precision)
    with pytest.raises(SnapshotError, match=r"decoder layer 1 \(blocks.1.qkv.weight\)"):
        weights.check()
    with pytest.raises(SnapshotError, match="decoder layer 1"):
        compute_streamed(dataclasses.replace(job, replay_dir=str(broken)))
    with pytest.raises(AxrlError, match=r"blocks\.1\.qkv\.weight"):  # the engine's own input checks refuse it too
        run_replay(replay_request(What(broken), how=How(shard=Shard.STREAMED)))


def test_short_layer_entry_refused_naming_the_layer(tmp_path: Path) -> None:
    import shutil

    from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights

    snapshot = record_tiny_snapshot(tmp_path / "snap", world_size=1)
    job = job_of(snapshot)
    broken = tmp_path / "short"
    shutil.copytree(snapshot, broken)
    from axrl_spike_replay.snapshot.dcp.checkpoint import read_checkpoint_metadata

    storage = read_checkpoint_metadata(broken, records=True).storage_data
    entry = next(info for index, info in storage.items() if index.fqn == "model.blocks.1.qkv.weight")
    with (broken / entry.relative_path).open("r+b") as handle:
        handle.truncate(entry.offset + entry.length - 8)  # blocks.1.qkv.weight loses its tail, and what follows it
    with pytest.raises(SnapshotError, match=r"^decoder layer 1\b.*blocks\.1\."):
        StreamedWeights(job.model, str(broken), "cpu", job.precision)


def test_cancel_and_timeout_leave_no_spill_dir(tmp_path: Path) -> None:
    snapshot = record_tiny_snapshot(tmp_path / "snap", world_size=2)
    job = job_of(snapshot, CONFIGS[:1])
    spill = tmp_path / "spill"
    cancel = threading.Event()

    def progress(line: str) -> None:
        if "layer 1/" in line:
            cancel.set()

    with pytest.raises(RunCancelled, match="cancelled"):
        compute_streamed(job, cancel, progress, StreamSettings(0, str(spill)))
    assert not any(spill.iterdir())
    with pytest.raises(RunCancelled, match="timed out"):
        compute_streamed(job, None, None, StreamSettings(0, str(spill)), timeout_s=0.0)
    assert not any(spill.iterdir())
    run_dir = tmp_path / "runs"
    cancel2 = threading.Event()
    cancel2.set()
    with pytest.raises(AxrlError):
        run_replay(
            replay_request(What(snapshot), how=How(shard=Shard.STREAMED), cancel=cancel2),
            stream=StreamSettings(0, str(run_dir)),
        )
    assert not run_dir.exists() or not any(run_dir.iterdir())


_FULL_DISK = """
import dataclasses, json, os, sys
from axrl_spike_replay.replay.engine import replay_session
from axrl_spike_replay.replay.streamed.boundaries import SpillDirFull
from axrl_spike_replay.replay.streamed.settings import StreamSettings
from axrl_spike_replay.replay.streamed.streamed_job import compute_streamed
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.vocabulary import Shard

mount, snapshot = sys.argv[1], sys.argv[2]
with replay_session(replay_request(What(snapshot), how=How(shard=Shard.OFF)), [], "replay") as session:
    job = session.worker_job()
job = dataclasses.replace(job, assignment=(tuple(range(job.world_size)),))
try:
    compute_streamed(job, settings=StreamSettings(0, mount))
    error = None
except SpillDirFull as exc:
    error = str(exc)
left = [os.path.join(d, f) for d, _, files in os.walk(mount) for f in files]
left += [d for d, dirs, _ in os.walk(mount) for d in (os.path.join(d, x) for x in dirs)]
print(json.dumps({"error": error, "left": left}))
"""


def test_spill_dir_that_fills_up_stops_cleanly(tmp_path: Path) -> None:
    """A spill dir on a 24 KiB filesystem: the replay stops naming the dir, no partial file or dir left behind."""
    from disk_full import run_on_full_disk

    snapshot = record_tiny_snapshot(tmp_path / "snap", world_size=2)
    out = run_on_full_disk(_FULL_DISK, tmp_path / "disk", 24, str(snapshot))
    assert out["error"] is not None and "spill dir" in out["error"] and "full" in out["error"], out
    assert out["left"] == [], out


def test_plan_has_a_streamed_row_and_auto_streams_only_when_nothing_else_fits(tmp_path: Path) -> None:
    from axrl_spike_replay.replay.plans.replay_plan import Capacity, plan_replay
    from axrl_spike_replay.replay.plans.shard_choice import choose_shard

    snapshot = record_tiny_snapshot(tmp_path, world_size=2)
    roomy = plan_replay(snapshot, capacity=Capacity("here", "cpu", 1, 8 << 30, "test"))
    row = roomy.streamed
    assert row is not None and row.fits and not roomy.streams
    assert row.layer_reads == 2 * 2 and row.bytes_read > 0 and row.boundaries > 0 and row.seconds > 0
    assert "streamed (1 process" in roomy.text()
    assert not choose_shard("auto", "cpu", 2, roomy).streamed
    # between the streamed peak and the smallest layout holding the step without checkpointed layers (asked for
    # here: on this tiny model a checkpointed whole layout is smaller than the streamed one's runtime floor):
    # nothing holding the step fits, streamed does
    whole_peak = min(r.memory.peak for r in roomy.rows)
    assert row.device_peak < whole_peak
    between = Capacity("here", "cpu", 1, (row.device_peak + whole_peak) // 2, "t")
    tight = plan_replay(snapshot, capacity=between, checkpoint=False)
    assert tight.smallest_full_fidelity is None and tight.streams and tight.fits
    assert "no layout fits" not in tight.layout
    choice = choose_shard("auto", "cpu", 2, tight)
    assert choice.streamed and "streamed" in choice.reason
    asked = plan_replay(snapshot, capacity=Capacity("here", "cpu", 1, 8 << 30, "test"), shard="streamed")
    assert asked.streams and asked.fits


def test_the_plans_streamed_row_with_nproc_is_one_process_of_a_run_split_over_them(tmp_path: Path) -> None:
    """With `nproc` 2 the row is one process's: half the saved ranks' boundaries (and its peak less the other half),
    every layer read by each. Against the run at `--nproc 2` (a mitigation: the clean gradient's backwards too): each
    process reads exactly the row's bytes, and holds at most the row's boundaries and more than the row of one
    process of every saved rank would leave for it (so a row not split per process fails)."""
    import re

    from axrl_spike_replay.replay.plans.replay_plan import Capacity, plan_replay

    snapshot = record_tiny_snapshot(tmp_path / "snap", world_size=4)
    roomy = Capacity("here", "cpu", 1, 8 << 30, "test")
    one, two = (plan_replay(snapshot, nproc=n, capacity=roomy, shard="streamed", configs=2).streamed for n in (1, 2))
    assert one is not None and two is not None
    assert (one.processes, one.ranks_each, two.processes, two.ranks_each) == (1, 4, 2, 2)
    assert two.boundaries * 2 == one.boundaries and two.bytes_read == one.bytes_read
    assert two.layer_reads == one.layer_reads and two.flops * 2 == one.flops
    assert two.device_peak == one.device_peak - (one.boundaries - two.boundaries)  # boundaries in host memory here
    assert "2 processes, each up to 2 saved rank(s); per process" in two.text()
    lines: list[str] = []
    request = replay_request(
        What(snapshot, mitigations={"advantage_clip": 0.5}), how=How(shard=Shard.STREAMED, nproc=2),
        progress=lines.append,
    )  # fmt: skip
    assert run_replay(request).verdict == "cleared"
    text = "\n".join(lines)
    for process in (0, 1):
        read = re.search(rf"process {process}: streamed: read ([\d,]+) bytes of weights \((\d+) layer reads", text)
        held = re.search(rf"process {process}: streamed: boundaries held ([\d,]+) bytes in memory at most, 0 on", text)
        assert read is not None and held is not None, text
        assert int(read[1].replace(",", "")) == two.bytes_read and int(read[2]) == two.layer_reads
        boundaries = int(held[1].replace(",", ""))
        assert 0.7 * two.boundaries < boundaries <= two.boundaries, (boundaries, two.boundaries)
    # on CPU the processes share the host: room for one process of every saved rank, not for two of half as many
    host = Capacity("here", "cpu", 1, (one.device_peak + 2 * two.device_peak) // 2, "t")
    assert one.device_peak < host.bytes_each < 2 * two.device_peak
    assert plan_replay(snapshot, nproc=1, capacity=host, shard="streamed").streamed.fits  # type: ignore[union-attr]
    assert not plan_replay(snapshot, nproc=2, capacity=host, shard="streamed").streamed.fits  # type: ignore[union-attr]
    # on CUDA each process has its own GPU
    gpus = Capacity("here", "cuda", 2, 8 << 30, "t")
    assert plan_replay(snapshot, nproc=2, device="cuda", capacity=gpus, shard="streamed").streamed.fits  # type: ignore[union-attr]


def test_streamed_refusals_name_the_argument(tmp_path: Path) -> None:
    from axrl_spike_replay.errors import ConfigError
    from axrl_spike_replay.investigation.request import How, What, replay_request
    from axrl_spike_replay.replay.analyses.attribution import attribute_spike
    from axrl_spike_replay.vocabulary import Shard, Verb

    snapshot = record_tiny_snapshot(tmp_path, world_size=2)
    replay_request(What(snapshot=snapshot, verb=Verb.ATTRIBUTE), how=How(shard=Shard.STREAMED, nproc=2))
    lines: list[str] = []
    with pytest.raises(ConfigError, match="at most 2 processes, not 3") as refused:
        run_replay(replay_request(What(snapshot), how=How(shard=Shard.STREAMED, nproc=3), progress=lines.append))
    assert refused.value.parameter == "nproc"
    assert not any("streamed" in line for line in lines)  # refused before anything ran
    with pytest.raises(ConfigError, match="larger than the saved world size 2") as refused:
        asked = What(snapshot, verb=Verb.ATTRIBUTE, top=3)
        attribute_spike(replay_request(asked, how=How(shard=Shard.STREAMED, nproc=3)))
    assert refused.value.parameter == "nproc"


def test_cli_replay_streamed(tmp_path: Path, cli: Any) -> None:
    """`replay --shard streamed` from the command line: the whole replay's grad norm, the reason in the result."""
    snapshot = record_tiny_snapshot(tmp_path / "snap", world_size=2)
    streamed = cli("replay", snapshot, "--shard", "streamed", "--json")
    assert streamed.code == 0, streamed.err
    whole = cli("replay", snapshot, "--shard", "off", "--json")
    a, b = streamed.json(), whole.json()
    assert isinstance(a, dict) and isinstance(b, dict)
    assert close(a["grad_norm"], b["grad_norm"]) and a["verdict"] == b["verdict"] == "reproduced"
    assert a["shard_reason"].startswith("shard streamed")


def assert_identical(one: Sequence[ConfigOutcome], split: Sequence[ConfigOutcome]) -> None:
    """The same figures bit for bit: the chain adds the passes in the one process's order."""
    for a, b in zip(one, split, strict=True):
        assert a.config_id == b.config_id and a.grad_norms == b.grad_norms and a.top_params == b.top_params
        assert [m["rank"] for m in a.rank_metrics] == [m["rank"] for m in b.rank_metrics]
        assert [m["loss"] for m in a.rank_metrics] == [m["loss"] for m in b.rank_metrics]
        assert a.param_grad_norms == b.param_grad_norms
        assert a.rank_param_grad_norms == b.rank_param_grad_norms
        assert a.footprint == b.footprint


@pytest.mark.parametrize("processes", [2, 3])
def test_saved_ranks_split_over_gloo_processes_is_the_one_process_replay(tmp_path: Path, processes: int) -> None:
    """World size 4 streamed by 2 processes (ranks 0-1, 2-3) or 3 (0-1, 2, 3), their piece sums chained: the one
    process's figures bit for bit, configs with a footprint included, and the whole replay's to 1e-6."""
    from axrl_spike_replay.replay.streamed.streamed_processes import run_streamed_processes

    snapshot = record_tiny_snapshot(tmp_path, world_size=4)
    job = job_of(snapshot, CONFIGS[:2])
    one = compute_streamed(job)
    lines: list[str] = []
    split = run_streamed_processes(job, processes, progress=lines.append)
    assert_identical(one, split)
    assert_same(compute(job, 0), split)
    assert any(line.startswith(f"process {processes - 1}: streamed") for line in lines)
    assert any("clean gradient made" in line for line in lines)  # a mitigation's clean gradient, over processes too
    for a, b in zip(one, split, strict=True):
        assert a.cosine_to_clean == b.cosine_to_clean and a.clean_gradient == b.clean_gradient


def test_transformers_split_over_processes_through_the_engine(tmp_path: Path) -> None:
    """qwen2_moe (shared experts) at world size 2, `shard` streamed with `nproc` 2 through the engine: the one-process
    streamed replay's grad norm exactly, and its verdict."""
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        snapshot = record_hf_snapshot(tmp_path, "qwen2_moe", world_size=2)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    one = run_replay(replay_request(What(snapshot), how=How(shard=Shard.STREAMED)))
    two = run_replay(replay_request(What(snapshot), how=How(shard=Shard.STREAMED, nproc=2)))
    assert two.grad_norm == one.grad_norm and two.verdict == one.verdict


def test_a_failed_read_ahead_is_raised_where_the_layer_is_needed(tmp_path: Path) -> None:
    """The next layer is read on the background thread; when its data file is gone by then, the error surfaces
    from `load_layer`, naming the checkpoint, and `close` still gives every tensor back."""
    from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights

    snapshot = record_tiny_snapshot(tmp_path, world_size=1)
    job = job_of(snapshot)
    weights = StreamedWeights(job.model, job.replay_dir, "cpu", job.precision)
    weights.check()
    weights.load_ends()
    for data in snapshot.glob("*.distcp"):
        data.unlink()
    weights.prefetch(0)
    with pytest.raises(AxrlError, match=str(snapshot)):
        weights.load_layer(0)
    weights.close()
    assert all(p.is_meta for p in weights.policy.parameters())


def test_the_plan_leaves_the_read_ahead_out_where_only_that_fits(tmp_path: Path) -> None:
    """The streamed row counts one layer read ahead; on a device one byte short of that, the row fits without it,
    says so, and the engine's choice streams without it."""
    from axrl_spike_replay.replay.plans.replay_plan import Capacity, plan_replay
    from axrl_spike_replay.replay.plans.shard_choice import choose_shard

    snapshot = record_tiny_snapshot(tmp_path, world_size=2)
    roomy = plan_replay(snapshot, capacity=Capacity("here", "cpu", 1, 8 << 30, "test"), shard="streamed").streamed
    assert roomy is not None and roomy.read_ahead and roomy.fits
    short = Capacity("here", "cpu", 1, roomy.device_peak - 1, "test")
    tight = plan_replay(snapshot, capacity=short, shard="streamed")
    row = tight.streamed
    assert row is not None and not row.read_ahead and row.fits and row.device_peak < roomy.device_peak
    assert "no read ahead: it would not fit" in row.text()
    assert roomy.read_ahead and choose_shard("streamed", "cpu", 2, tight).read_ahead is False


def _save_like_verl(rank: int, world_size: int, out: str) -> None:
    """One rank of verl's `FSDPCheckpointManager.save_checkpoint` for the tiny qwen3_moe policy `record_hf_snapshot`
    records (seed 0): its FSDP2 state dict of DTensors, and rank 0's `fsdp_config.json` and HF config."""
    import json

    from torch.distributed.fsdp import fully_shard

    from axrl_spike_replay.testing.hf_snapshot import seeded_policy

    _, policy = seeded_policy("qwen3_moe")
    actor = policy.causal_lm
    fully_shard(actor)
    torch.save(actor.state_dict(), Path(out) / f"model_world_size_{world_size}_rank_{rank}.pt")
    if rank == 0:
        (Path(out) / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
        actor.config.save_pretrained(Path(out) / "huggingface")


@pytest.mark.slow  # two spawned gloo processes save the verl shards
def test_verl_fsdp_shards_stream_as_the_whole_replay(tmp_path: Path) -> None:
    """A snapshot whose policy weights are a verl FSDP actor checkpoint (no checkpoint in the snapshot; the run
    config's `model.path` names verl's shards, saved by two FSDP2 ranks) streams each layer from the memory-mapped
    shards: the whole replay's step to 1e-6, and the DCP checkpoint's of the same weights."""
    import shutil

    import yaml

    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.snapshot.layout import RUN_CONFIG
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        snapshot = record_hf_snapshot(tmp_path / "dcp", "qwen3_moe", world_size=2)
        actor = tmp_path / "global_step_7" / "actor"
        actor.mkdir(parents=True)
        spawn_ranks(_save_like_verl, 2, str(actor))
        copy = tmp_path / "verl" / snapshot.name
        shutil.copytree(snapshot, copy, ignore=shutil.ignore_patterns(".metadata", "*.distcp"))
        config = yaml.safe_load((copy / RUN_CONFIG).read_text())
        config["model"].pop("config")  # the HF config is verl's, under the actor dir's `huggingface/`
        config["model"]["path"] = str(actor)
        (copy / RUN_CONFIG).write_text(yaml.safe_dump(config))
        assert not list(copy.glob("*.distcp")) and len(list(actor.glob("model_world_size_2_rank_*.pt"))) == 2
        job = job_of(copy, CONFIGS[:1])
        lines: list[str] = []
        whole, streamed = compute(job, 0), compute_streamed(job, progress=lines.append)
        dcp = compute_streamed(job_of(snapshot, CONFIGS[:1]))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert any("layer reads" in line for line in lines), lines
    assert_same(whole, streamed)
    assert_same(dcp, streamed)
    assert close(streamed[0].grad_norms[0], recorded(snapshot))
