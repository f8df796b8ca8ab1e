"""Megatron `torch_dist` checkpoints written by megatron-core itself, read from their headers: format, tensors,
the layout their shards show, one layer at a time, and refusals that name what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.errors import ConfigError, SnapshotError, UnsafeFileError
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.snapshot.metadata import ParallelLayout
from axrl_spike_replay.snapshot.trainer_formats.megatron_checkpoint import (
    is_megatron_checkpoint,
    layout_problems,
    load_regions,
    read_common_state,
    read_megatron_checkpoint,
)
from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

pytestmark = pytest.mark.slow

SAVED = {  # layout -> (world size, tp, pp, ep, etp) the checkpoint was saved with
    "tp1": ParallelLayout(world_size=1, dp=1),
    "tp2": ParallelLayout(world_size=2, tp=2, etp=2, dp=1),
    "ep2": ParallelLayout(world_size=2, ep=2, dp=2),
    "pp2": ParallelLayout(world_size=2, pp=2, dp=1),
}


def _whole(directory: Path) -> dict[str, torch.Tensor]:
    ckpt = read_megatron_checkpoint(directory)
    out = {k: torch.empty(shape, dtype=getattr(torch, dtype)) for k, (shape, dtype) in ckpt.tensors.items()}
    load_regions(directory, {k: ((0,) * t.dim(), t) for k, t in out.items()})
    return out


def test_every_layout_is_read_with_its_shards_and_the_same_weights(megatron_checkpoints: dict[str, Path]) -> None:
    reference = _whole(megatron_checkpoints["tp1"])
    assert reference["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (2, 8, 64, 64)
    assert reference["decoder.layers.self_attention.linear_qkv.weight"].shape == (2, 128, 64)  # 2 groups x (2+2) x 16
    for name, directory in megatron_checkpoints.items():
        ckpt = read_megatron_checkpoint(directory)
        layout = SAVED[name]
        assert is_megatron_checkpoint(directory)
        assert (ckpt.backend, ckpt.backend_version, ckpt.num_layers, ckpt.num_experts) == ("torch_dist", 1, 2, 8)
        assert (ckpt.tp, ckpt.etp) == (layout.tp, layout.etp), name
        assert set(ckpt.writer_ranks) <= set(range(layout.world_size))
        assert layout_problems(ckpt, layout) == [], name
        assert read_common_state(directory) == {}  # a bare model's sharded state dict has no common items
        whole = _whole(directory)
        assert whole.keys() == reference.keys()
        assert all(torch.equal(whole[k], reference[k]) for k in reference), name


def test_one_layer_or_one_expert_reads_alone(megatron_checkpoints: dict[str, Path]) -> None:
    directory = megatron_checkpoints["tp2"]
    whole = _whole(directory)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    expert = torch.empty(1, 1, 64, 64)
    load_regions(directory, {key: ((1, 5, 0, 0), expert)})  # layer 1, expert 5: four TP chunks of it
    assert torch.equal(expert, whole[key][1:2, 5:6])
    with pytest.raises(SnapshotError, match="lies outside"):
        load_regions(directory, {key: ((2, 0, 0, 0), expert)})
    with pytest.raises(SnapshotError, match="saved as float32"):
        load_regions(directory, {key: ((0, 0, 0, 0), expert.double())})


def test_shards_that_disagree_with_the_saved_layout_are_named(megatron_checkpoints: dict[str, Path]) -> None:
    ckpt = read_megatron_checkpoint(megatron_checkpoints["tp2"])
    problems = layout_problems(ckpt, ParallelLayout(world_size=1, dp=1))
    assert any("2 tensor-parallel shards" in p and "tp=1" in p for p in problems)
    assert any("2 expert-tensor-parallel shards" in p and "etp=1" in p for p in problems)
    assert any("ranks [1]" in p and "world size is 1" in p for p in problems)


def test_a_missing_pipeline_stage_is_named_with_its_layers_and_files(
    megatron_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    directory = shutil.copytree(megatron_checkpoints["pp2"], tmp_path / "pp2")
    ckpt = read_megatron_checkpoint(directory)
    stage_1 = set(ckpt.layer_files[1]) - set(ckpt.layer_files[0])
    assert stage_1, "layer 1 lives in the second stage's files"
    for name in stage_1:
        (directory / name).unlink()
    (problem,) = layout_problems(ckpt, SAVED["pp2"])
    assert "layers [1] (pipeline stage 1 of pp=2)" in problem
    assert all(name in problem for name in stage_1) and "--backend command" in problem


def test_an_unsupported_checkpoint_format_or_release_is_refused(
    megatron_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    directory = shutil.copytree(megatron_checkpoints["tp1"], tmp_path / "old")
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    with pytest.raises(SnapshotError, match=r"zarr.*--backend command"):
        read_megatron_checkpoint(directory)
    with pytest.raises(ConfigError, match=r"0\.8\.0.*--backend command"):
        MegatronModelConfig.from_dict(tiny_section(megatron_version="0.8.0"))


def test_olmoe_is_refused_naming_the_norm_megatron_cannot_build() -> None:
    """OLMoE's q/k norms span the whole projection; megatron-core 0.16.1's qk_layernorm is per head."""
    with pytest.raises(
        ConfigError,
        match=r"olmoe.*cannot build OLMoE.*all heads at once.*normalises each head"
        r".*mapped: qwen3_moe, qwen2_moe, mixtral, deepseek_v3.*--backend command",
    ):
        MegatronModelConfig.from_dict(tiny_section("olmoe"))


def test_gpt_oss_is_refused_naming_what_route_1_does_not_map() -> None:
    with pytest.raises(
        ConfigError,
        match=r"gpt_oss.*attention sinks.*sliding-window.*clamped SwiGLU.*interleaves.*gate/up.*--backend command",
    ):
        MegatronModelConfig.from_dict(tiny_section("gpt_oss"))


def test_a_model_we_do_not_know_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'llama'.*not mapped onto a transformers model.*--backend command"):
        MegatronModelConfig.from_dict({**tiny_section(), "architecture": "llama"})
    with pytest.raises(ConfigError, match="dense MLP layers"):
        MegatronModelConfig.from_dict(tiny_section(config={**tiny_section()["config"], "mlp_only_layers": [0]}))


def test_common_state_is_read_weights_only(megatron_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import megatron.core  # noqa: F401 - registers PosixPath and more as torch safe globals, process-wide

    directory = shutil.copytree(megatron_checkpoints["tp1"], tmp_path / "common")
    torch.save({"iteration": 7, "opaque": Path("x")}, directory / "common.pt")  # a class outside our allowlist
    with pytest.raises(UnsafeFileError):
        read_common_state(directory)
