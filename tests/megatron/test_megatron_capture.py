"""The Megatron spike guard in megatron-core's own training loop (EP=2 over two gloo processes): it trips at the
spike, writes the weights through `dist_checkpointing`, the batches, the routes Megatron's router replay
recorded and grad info; the snapshot reads as a Megatron snapshot and replays to `reproduced`."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from megatron_trainer import load_hook

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.request import What, Where, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
from axrl_spike_replay.snapshot.legacy import prepare_replay_dir
from axrl_spike_replay.snapshot.rank_data import load_routing_payload
from axrl_spike_replay.snapshot.safe_load import load_pt
from axrl_spike_replay.snapshot.trainer_formats.megatron_routes import MEGATRON_ROUTES_FORMAT
from axrl_spike_replay.vocabulary import Backend

pytestmark = pytest.mark.slow


def test_the_guard_writes_a_megatron_snapshot(megatron_capture: Path) -> None:
    files = {p.name for p in megatron_capture.iterdir()}
    assert {"metadata.json", ".metadata", "common.pt", "axrl_metadata.json", "run_config.yaml"} <= files
    assert any(name.endswith(".distcp") for name in files)
    assert json.loads((megatron_capture / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    found = inspect_snapshot(megatron_capture)
    assert found.problems == []
    assert (found.world_size, found.dp, found.ep, found.tp) == (2, 2, 2, 1)
    assert found.megatron is not None
    assert found.megatron["tp_from_shards"] == 1 and found.megatron["num_experts"] == 8
    assert found.megatron["tensors"]["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == [2, 8, 64, 64]
    assert found.consistency is not None and found.consistency.self_consistent
    assert "grad_norm_vs_param_norms" in found.consistency.checked  # the merged per-parameter norms make the norm
    assert [r.routing_payload_counts for r in found.ranks] == [{0: 128, 1: 128}] * 2  # 4 x 32 tokens, 2 layers


def test_the_routes_are_saved_as_megatron_records_them(megatron_capture: Path) -> None:
    doc = load_pt(megatron_capture / "routing_payload_rank0.pt")
    assert doc["format"] == MEGATRON_ROUTES_FORMAT and doc["moe_layers"] == [0, 1]
    assert [tuple(t.shape) for t in doc["topk_indices"]] == [(32 * 4, 2)] * 2  # [S*B, K] per MoE layer
    assert doc["topk_indices"][0].dtype == torch.int64
    routes = load_routing_payload(megatron_capture, 0).routed_experts
    assert routes.shape == (4, 32, 2, 2)
    # sequence-major in Megatron: token (s, b) is row s*B + b
    assert torch.equal(routes[3, 17, 1], doc["topk_indices"][1][17 * 4 + 3])


def test_the_snapshot_replays_to_reproduced(megatron_route1_replay: ReplayResult) -> None:
    result = megatron_route1_replay
    assert result.verdict == "reproduced", (result.grad_norm, result.recorded_grad_norm)
    assert result.rel_diff is not None and result.rel_diff < 1e-6


def test_a_legacy_megatron_snapshot_is_repaired_and_replays(megatron_capture: Path, tmp_path: Path) -> None:
    """AXRL metadata in Megatron's metadata.json: the repair rule restores the checkpoint's file in a replay dir,
    as megatron-core wrote it, and megatron-core's own loader (route 2) reads the repaired checkpoint."""
    written_by_megatron = json.loads((megatron_capture / "metadata.json").read_text())
    legacy = shutil.copytree(megatron_capture, tmp_path / "iter_0000006")
    (legacy / "metadata.json").write_text((legacy / "axrl_metadata.json").read_text())
    (legacy / "axrl_metadata.json").unlink()
    found = inspect_snapshot(legacy)
    assert found.legacy_metadata and found.problems == [] and found.megatron is not None
    prepared = prepare_replay_dir(legacy, tmp_path / "replay")
    assert json.loads((Path(prepared.replay_dir) / "metadata.json").read_text()) == written_by_megatron
    result = run_replay(replay_request(What(legacy)))
    assert result.verdict == "reproduced" and result.legacy_layout
    native = run_replay(
        replay_request(What(legacy), Where(backend=Backend.MEGATRON))
    )  # dist_checkpointing.load reads it
    assert native.verdict == "reproduced" and native.legacy_layout
    assert json.loads((legacy / "metadata.json").read_text())["job_name"] == "megatron-ep2"  # untouched


def test_the_guard_never_raises_into_training(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    from axrl_spike_replay.capture.detectors import MedianRatioDetector

    hook = load_hook()
    guard = hook.MegatronSpikeGuard(
        tmp_path, model_section={}, loss_section={}, detector=MedianRatioDetector(window=2, threshold=2.0, warmup=2)
    )
    broken = object()  # not a Megatron model, and no process group: every part of a snapshot fails
    with caplog.at_level(logging.WARNING):
        guard.begin_step(broken)
        decisions = [guard.step(step, broken, norm, {}) for step, norm in enumerate((1.0, 1.0, 1.0, 50.0, 50.0), 1)]
    assert decisions == [True, True, True, False, False]  # the spikes are still skipped
    hook_log = [r.args[0] for r in caplog.records if r.name.endswith("megatron_hook") and isinstance(r.args, tuple)]
    assert hook_log == ["begin_step", "preparing the snapshot"]  # each logged once over two spikes, none raised
    assert not any(tmp_path.iterdir())


def test_the_guard_is_armed_from_step_1_by_default(tmp_path: Path) -> None:
    """Without a detector of the caller's, the hook's guard is the hooks' shared one (`guard_settings.guard_detector`):
    a spike on the second step, inside the warm-up, is skipped."""
    from axrl_spike_replay.capture.detectors import DEFAULT_WARMUP_RATIO

    hook = load_hook()
    guard = hook.MegatronSpikeGuard(tmp_path, model_section={}, loss_section={})
    assert guard.guard.detector.warmup_ratio == DEFAULT_WARMUP_RATIO
    broken = object()  # no Megatron model: the snapshot fails (logged), the decision stands
    assert [guard.step(step, broken, norm, {}) for step, norm in ((1, 1.0), (2, 1.2), (3, 35.0))] == [True, True, False]


def test_a_saved_layout_the_shards_contradict_is_refused_before_any_replay(
    megatron_capture: Path, tmp_path: Path
) -> None:
    snapshot = shutil.copytree(megatron_capture, tmp_path / "iter_0000006")
    meta = json.loads((snapshot / "axrl_metadata.json").read_text())
    meta["parallel"].update(tp=2, dp=1)  # the run says TP=2; Megatron saved linear_qkv whole
    (snapshot / "axrl_metadata.json").write_text(json.dumps(meta))
    text = (
        (snapshot / "run_config.yaml").read_text().replace("  tp: 1\n", "  tp: 2\n").replace("  dp: 2\n", "  dp: 1\n")
    )
    (snapshot / "run_config.yaml").write_text(text)
    for rank_file in ("batch_rank1.pt", "grad_info_rank1.pt", "routing_payload_rank1.pt"):
        (snapshot / rank_file).unlink()  # one data-parallel rank under TP=2 x 2 processes
    with pytest.raises(SnapshotError, match=r"saved in 1 tensor-parallel shards but the snapshot's layout says tp=2"):
        run_replay(replay_request(What(snapshot)))
    assert any("tp=2" in p for p in inspect_snapshot(snapshot).problems)
