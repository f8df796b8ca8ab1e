"""A Megatron checkpoint's bytes entries (its ShardedObjects: every layer's `_extra_state`) are held to "never execute a
pickle" on every reader: `inspect` lists one it would refuse, route 1 (whole or streamed) and route 2 refuse the
snapshot, and the load megatron-core runs for route 2 reads bytes entries with `weights_only=True` and an allow-list,
not DCP's `torch.load(weights_only=False)`. The hostile entry is planted in a real capture's checkpoint (here, not in
tests/hostile: the session's Megatron capture is shared through this folder's conftest, and route 2 starts rank
processes that the hostile folder's address-space cap would starve)."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.investigation.request import How, What, Where, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
from axrl_spike_replay.vocabulary import Backend, Shard

pytestmark = pytest.mark.slow

ENTRY = "decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2"


class _RunsCode:
    """Pickles as a call of `exec`: what a hostile `_extra_state` holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def plant_bytes_entry(checkpoint: Path, fqn: str, value: Any) -> None:
    """Store `value` (torch.save'd, as DCP stores a ShardedObject) as the bytes entry `fqn` of the checkpoint: its
    bytes appended to the entry's `.distcp` file, the checkpoint's `.metadata` pointed at them."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata()  # our own capture: trusted here
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    payload = io.BytesIO()
    torch.save([value], payload)
    data = checkpoint / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as handle:
        handle.write(payload.getvalue())
    info.offset, info.length = offset, len(payload.getvalue())
    with open(checkpoint / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


@pytest.fixture
def hostile_capture(megatron_capture: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the session's capture whose `linear_qkv._extra_state` runs code when unpickled; and the marker
    file that code would write."""
    snapshot = shutil.copytree(megatron_capture, tmp_path / "iter_0000006")
    marker = tmp_path / "code-ran"
    plant_bytes_entry(snapshot, ENTRY, _RunsCode(marker))
    return snapshot, marker


def test_a_bytes_entry_that_would_run_code_is_refused_by_inspect_and_both_routes(
    hostile_capture: tuple[Path, Path],
) -> None:
    snapshot, marker = hostile_capture
    problems = inspect_snapshot(snapshot).problems
    named = [p for p in problems if ENTRY in p and "__0_1.distcp" in p]
    assert named and "whose pickle calls builtins.exec" in named[0] and "nothing in it was run" in named[0], problems
    for backend in (Backend.TORCH, Backend.MEGATRON):  # route 1, route 2
        with pytest.raises(AxrlError, match=r"linear_qkv\._extra_state/shard_0_2.*pickle calls builtins\.exec"):
            run_replay(replay_request(What(snapshot), Where(backend=backend)))
    with pytest.raises(AxrlError, match=r"linear_qkv\._extra_state/shard_0_2.*pickle calls builtins\.exec"):
        run_replay(replay_request(What(snapshot), how=How(shard=Shard.STREAMED)))
    from axrl_spike_replay.models.policy import parse_model_config
    from axrl_spike_replay.replay.reading.inputs import read_run_config
    from axrl_spike_replay.replay.streamed.layer_weights import StreamedWeights

    spec = parse_model_config(read_run_config(snapshot)["model"])
    with pytest.raises(AxrlError, match=r"linear_qkv\._extra_state/shard_0_2.*pickle calls builtins\.exec"):
        StreamedWeights(spec, str(snapshot), "cpu", None)  # the streamed reader checks the checkpoint itself
    assert not marker.exists(), "the pickle ran"


def test_megatron_core_load_reads_bytes_entries_weights_only(hostile_capture: tuple[Path, Path]) -> None:
    """The load itself, without the checks the routes run first (a file swapped after them): megatron-core's
    `dist_checkpointing.load` through `snapshot.trainer_formats.megatron_load` refuses the entry in its rank process."""
    from megatron_helpers import load_gpt_rank

    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

    snapshot, marker = hostile_capture
    with pytest.raises(AxrlError, match=r"linear_qkv\._extra_state/shard_0_2.*GLOBAL exec"):
        spawn_ranks(load_gpt_rank, 1, (tiny_section(), str(snapshot)), timeout_s=300.0, label="megatron load")
    assert not marker.exists(), "the pickle ran"


def test_what_megatron_extra_state_holds_passes(megatron_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """None (the local spec's), a tensor (Transformer Engine's) and plain containers of them are read; inspect
    lists no problem."""
    from axrl_spike_replay.snapshot.dcp.checkpoint import check_checkpoint_storage

    checkpoint = shutil.copytree(megatron_checkpoints["tp1"], tmp_path / "tp1")
    plant_bytes_entry(checkpoint, ENTRY, torch.arange(8, dtype=torch.uint8))
    plant_bytes_entry(
        checkpoint, ENTRY.replace("linear_qkv", "linear_proj"), {"scale": torch.ones(2), "steps": [1, 2.0, None]}
    )
    assert check_checkpoint_storage(checkpoint) == []
