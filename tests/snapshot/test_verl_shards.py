"""A verl FSDP actor checkpoint merges back into exactly the weights that were sharded.

Two gloo processes shard a small model with FSDP2's `fully_shard` and save it the way verl's
`FSDPCheckpointManager.save_checkpoint` does: each rank `torch.save`s its state dict (DTensors holding
the local shard) as `model_world_size_2_rank_{r}.pt`, rank 0 writes `fsdp_config.json`. The merge
loads them with `weights_only=True` and gives the unsharded fp32 weights bit for bit.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from axrl_spike_replay.errors import SnapshotError, UnsafeFileError
from axrl_spike_replay.processes.rank_processes import spawn_ranks
from axrl_spike_replay.snapshot.trainer_formats.verl_shards import is_verl_checkpoint, load_verl_shards

pytestmark = pytest.mark.slow  # two spawned gloo processes: tens of seconds on a loaded 2-core machine
_VERL_SPEC = importlib.util.find_spec("verl")
VERL = Path(_VERL_SPEC.origin).parent if _VERL_SPEC and _VERL_SPEC.origin else Path("verl-not-installed")


def _model() -> nn.Module:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3), nn.Linear(3, 7, bias=False), nn.Embedding(9, 4))
    model.register_buffer("scale", torch.tensor([0.5, 2.0]))  # a buffer: not sharded, whole on every rank
    return model


def _save_like_verl(rank: int, world_size: int, out: str) -> None:
    """One rank of an FSDP2 actor saving a checkpoint as verl 0.9.1 does."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    torch.save(model.state_dict(), Path(out) / f"model_world_size_{world_size}_rank_{rank}.pt")
    if rank == 0:
        config = {"FSDP_version": 2, "world_size": world_size}  # verl's FSDPConfig, asdict'ed
        (Path(out) / "fsdp_config.json").write_text(json.dumps(config, indent=4), encoding="utf-8")


@pytest.fixture(scope="module")
def verl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verl-actor") / "global_step_7" / "actor"
    out.mkdir(parents=True)
    spawn_ranks(_save_like_verl, 2, str(out))
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "actor"
    shutil.copytree(src, dest)
    return dest


@pytest.mark.skipif(_VERL_SPEC is None, reason="verl is not installed")
def test_the_files_follow_verl_s_own_checkpoint_manager() -> None:
    source = (VERL / "utils" / "checkpoint" / "fsdp_checkpoint_manager.py").read_text(encoding="utf-8")
    assert 'f"model_world_size_{self.world_size}_rank_{self.rank}.pt"' in source
    assert '"fsdp_config.json"' in source
    config_class = next(
        node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef) and node.name == "FSDPConfig"
    )
    fields = [n.target.id for n in config_class.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    assert fields == ["FSDP_version", "world_size"]


def test_the_shards_hold_dtensors_with_uneven_local_pieces(verl_checkpoint: Path) -> None:
    from torch.distributed.tensor import DTensor

    rank1 = torch.load(verl_checkpoint / "model_world_size_2_rank_1.pt", weights_only=False)  # our own file
    weight = rank1["0.weight"]
    assert isinstance(weight, DTensor)
    assert tuple(weight.shape) == (3, 5) and tuple(weight.to_local().shape) == (1, 5)  # 3 rows over 2 ranks


def test_merge_gives_exactly_the_unsharded_weights(verl_checkpoint: Path) -> None:
    assert is_verl_checkpoint(verl_checkpoint)
    merged = load_verl_shards(verl_checkpoint)
    expected = _model().state_dict()
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        assert merged[name].dtype == torch.float32
        assert torch.equal(merged[name], tensor), name  # bit for bit: no bf16 round trip


def test_bf16_shards_are_widened_not_narrowed(verl_checkpoint: Path, tmp_path: Path) -> None:
    from torch.distributed.tensor import DTensor

    ckpt = _copy(verl_checkpoint, tmp_path)
    for rank in (0, 1):
        path = ckpt / f"model_world_size_2_rank_{rank}.pt"
        state = torch.load(path, weights_only=False)
        state["0.weight"] = DTensor.from_local(
            state["0.weight"].to_local().bfloat16(),
            state["0.weight"].device_mesh,
            state["0.weight"].placements,
            shape=state["0.weight"].shape,
            stride=state["0.weight"].stride(),
        )
        torch.save(state, path)
    merged = load_verl_shards(ckpt)
    assert merged["0.weight"].dtype == torch.float32
    assert torch.equal(merged["0.weight"], _model().state_dict()["0.weight"].bfloat16().float())


def test_a_missing_rank_file_is_named(verl_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(verl_checkpoint, tmp_path)
    (ckpt / "model_world_size_2_rank_1.pt").unlink()
    with pytest.raises(SnapshotError, match=r"model_world_size_2_rank_1\.pt"):
        load_verl_shards(ckpt)


def test_a_world_size_that_disagrees_with_the_files_is_refused(verl_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(verl_checkpoint, tmp_path)
    (ckpt / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 4}', encoding="utf-8")
    with pytest.raises(SnapshotError, match=r"fsdp_config\.json: world_size is 4 but the directory holds shards"):
        load_verl_shards(ckpt)
    for rank in (0, 1):
        shutil.copy(ckpt / f"model_world_size_2_rank_{rank}.pt", ckpt / f"model_world_size_4_rank_{rank}.pt")
        shutil.copy(ckpt / f"model_world_size_2_rank_{rank}.pt", ckpt / f"model_world_size_4_rank_{rank + 2}.pt")
        (ckpt / f"model_world_size_2_rank_{rank}.pt").unlink()
    with pytest.raises(SnapshotError, match=r"model_world_size_4_rank_0.pt: .* sharded over 2 ranks .* world_size 4"):
        load_verl_shards(ckpt)


def test_wrong_shapes_are_named_with_the_file(verl_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(verl_checkpoint, tmp_path)
    path = ckpt / "model_world_size_2_rank_1.pt"
    state = torch.load(path, weights_only=False)
    state["scale"] = torch.tensor([0.5, 2.0, 1.0])  # a replicated buffer that differs from rank 0's
    torch.save(state, path)
    with pytest.raises(SnapshotError, match=r"model_world_size_2_rank_1.pt: 'scale' differs from rank 0"):
        load_verl_shards(ckpt)
    state = torch.load(ckpt / "model_world_size_2_rank_0.pt", weights_only=False)
    state["scale"] = torch.tensor([0.5, 2.0])
    state["2.weight"] = state["2.weight"].to_local()  # a shard saved as a plain tensor on one rank only
    torch.save(state, path)
    with pytest.raises(SnapshotError, match=r"model_world_size_2_rank_1\.pt"):
        load_verl_shards(ckpt)


def test_anything_beyond_tensors_and_dtensors_is_refused_by_file_name(verl_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = _copy(verl_checkpoint, tmp_path)
    path = ckpt / "model_world_size_2_rank_0.pt"
    state = torch.load(path, weights_only=False)
    state["extra"] = Path("/etc/passwd")  # an arbitrary class in the pickle
    torch.save(state, path)
    with pytest.raises(UnsafeFileError, match=r"model_world_size_2_rank_0\.pt: refused to load"):
        load_verl_shards(ckpt)
