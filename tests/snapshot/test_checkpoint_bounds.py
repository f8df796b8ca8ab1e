"""A checkpoint whose `.metadata` and `.distcp` entries lie is refused by name before DCP allocates or copies
anything: a deflated entry (a zip bomb), chunks that do not tile their tensor, a stream transform, a model tensor
saved as bytes. A real checkpoint passes, its weights load as saved."""

from __future__ import annotations

import io
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.models.policy import check_policy_weights, parse_model_config
from axrl_spike_replay.snapshot.dcp import checkpoint_entries
from axrl_spike_replay.snapshot.dcp.checkpoint import check_checkpoint_storage, load_model_state, summarize_checkpoint
from axrl_spike_replay.snapshot.dcp.checkpoint_tiling import tiling_problem
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml
from hostile_snapshot import set_checkpoint_chunks, write_distcp_bomb

MIB = 1 << 20


@pytest.fixture
def snap(golden_snapshot: Path, tmp_path: Path) -> Path:
    """A copy of the golden snapshot (a real capture: tiny MoE, two ranks' `.distcp` files)."""
    dest = tmp_path / golden_snapshot.name
    shutil.copytree(golden_snapshot, dest)
    return dest


def _saved_state(snapshot: Path) -> dict[str, torch.Tensor]:
    shapes = summarize_checkpoint(snapshot).shapes
    state = {
        n.removeprefix("model."): torch.full(s, float("nan"), dtype=getattr(torch, d)) for n, (s, d) in shapes.items()
    }
    load_model_state(snapshot, state)
    return state


def _model(snapshot: Path):
    return parse_model_config(read_untrusted_yaml(snapshot / "run_config.yaml")["model"])


def test_a_real_checkpoint_passes_and_loads_every_element(snap: Path) -> None:
    assert check_checkpoint_storage(snap) == []
    state = _saved_state(snap)
    assert not any(t.isnan().any() for t in state.values())  # every element came from the checkpoint


def test_a_zip_bomb_in_a_distcp_entry_is_refused_before_it_is_inflated(snap: Path) -> None:
    before = _saved_state(snap)["embed.weight"]
    size = write_distcp_bomb(snap, 256 * MIB)  # the same values, over a 256 MiB storage deflated
    assert size < 2 * MIB

    problems = inspect_snapshot(snap).problems
    [problem] = [p for p in problems if "__0_0.distcp" in p]
    assert "(entry of 'model.embed.weight', bytes " in problem
    assert f"record 'archive/data/0' is compressed ({256 * MIB} bytes from " in problem
    with pytest.raises(SnapshotError, match=r"__0_0\.distcp \(entry of 'model\.embed\.weight'.*is compressed"):
        check_policy_weights(snap, _model(snap), "the snapshot's checkpoint")
    with pytest.raises(SnapshotError, match="is compressed"):
        load_model_state(snap, {"embed.weight": torch.empty_like(before)})


def test_an_entry_stored_through_a_stream_transform_is_refused(snap: Path) -> None:
    metadata = pickle.loads((snap / ".metadata").read_bytes())  # the test's own copy: trusted here
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "model.head.weight")
    info.transform_descriptors = ["stream.zstd"]
    (snap / ".metadata").write_bytes(pickle.dumps(metadata))

    [problem] = [p for p in inspect_snapshot(snap).problems if "transform" in p]
    assert "entry of 'model.head.weight' is stored through the stream transform ['stream.zstd']" in problem


def test_a_truncated_entry_is_named(snap: Path) -> None:
    metadata = pickle.loads((snap / ".metadata").read_bytes())
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "model.head.weight")
    info.length -= 200  # cuts its zip directory
    (snap / ".metadata").write_bytes(pickle.dumps(metadata))

    problems = "\n".join(inspect_snapshot(snap).problems)
    assert "(entry of 'model.head.weight', bytes" in problems and "not a torch archive" in problems


UNTILED = [
    ([], "has no chunks: none of its 256 elements is in the checkpoint"),
    ([((0, 0), (16, 16)), ((16, 0), (1, 16))], "has a chunk at offsets (16, 0) of sizes (1, 16), outside its shape"),
    ([((0, 0), (8, 16))], "has chunks covering 128 of its 256 elements"),
    ([((0, 0), (16, 16)), ((4, 0), (4, 16))], "has chunks adding up to 320 elements for its 256: chunks overlap"),
    ([((0, 0), (12, 16)), ((8, 0), (4, 16))], "has chunks that overlap at offsets (8, 0)"),  # and 12-16 in none
    (
        [((0, 0), (8, 8)), ((0, 8), (8, 8)), ((8, 0), (8, 8)), ((4, 4), (8, 8))],
        "has chunks that overlap at offsets (4, 4)",
    ),
    ([((0, 0, 0), (16, 16, 1))], "has a chunk of 3 dimensions at offsets (0, 0, 0); the tensor has 2"),
]


@pytest.mark.parametrize(("chunks", "message"), UNTILED)
def test_chunks_that_do_not_tile_their_tensor_are_refused_by_name(snap: Path, chunks, message: str) -> None:
    set_checkpoint_chunks(snap, "model.embed.weight", chunks)

    problems = "\n".join(inspect_snapshot(snap).problems)
    assert f"tensor 'model.embed.weight' of shape (16, 16) {message}" in problems
    with pytest.raises(SnapshotError, match=r"model\.embed\.weight.*refused \(it would load partly\)"):
        check_policy_weights(snap, _model(snap), "the snapshot's checkpoint")
    with pytest.raises(SnapshotError, match="would load partly"):
        _saved_state(snap)  # the bare loader refuses too: no element is left as it was


def test_a_chunk_without_its_storage_entry_is_named(snap: Path) -> None:
    set_checkpoint_chunks(snap, "model.embed.weight", [((0, 0), (8, 16)), ((8, 0), (8, 16))])
    metadata = pickle.loads((snap / ".metadata").read_bytes())
    del metadata.storage_data[next(k for k in metadata.storage_data if k.fqn == "model.embed.weight" and k.offset[0])]
    (snap / ".metadata").write_bytes(pickle.dumps(metadata))

    problems = "\n".join(inspect_snapshot(snap).problems)
    assert "tensor 'model.embed.weight' has a chunk at offsets (8, 0) with no storage entry" in problems


def test_entries_sharing_bytes_are_refused_and_read_once(snap: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sixteen chunks, each named with the tensor's one entry: the entry is read once, the sharers refused (not the
    same zip directory parsed again for each name that points at it, as often as a `.metadata` can repeat it)."""
    set_checkpoint_chunks(snap, "model.embed.weight", [((row, 0), (1, 16)) for row in range(16)])
    read: list[str] = []
    real = checkpoint_entries._entry_problem
    monkeypatch.setattr(
        checkpoint_entries,
        "_entry_problem",
        lambda fd, path, name, *span: read.append(name) or real(fd, path, name, *span),
    )

    problems = "\n".join(check_checkpoint_storage(snap))
    assert "__0_0.distcp: entry of 'model.embed.weight' at bytes" in problems
    assert "overlaps the entry of 'model.embed.weight' at bytes" in problems
    assert read.count("model.embed.weight") == 1


@pytest.mark.parametrize(
    ("shape", "chunks"),
    [
        ((16, 16), [((0, 0), (16, 16))]),
        ((10, 3), [((0, 0), (4, 3)), ((4, 0), (4, 3)), ((8, 0), (2, 3))]),  # FSDP's uneven dim-0 shards
        ((4, 6), [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]),  # a 2 x 2 grid (TP x FSDP)
        ((4, 6), [((0, 0), (2, 6)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]),  # not a grid, still a tiling
        ((0, 8), []),  # an empty tensor
        ((), [((), ())]),  # a scalar
    ],
)
def test_layouts_that_tile_exactly_pass(shape, chunks) -> None:
    assert tiling_problem(shape, chunks) is None


def test_chunks_too_irregular_to_check_are_refused_not_searched(monkeypatch: pytest.MonkeyPatch) -> None:
    from axrl_spike_replay.snapshot.dcp import checkpoint_tiling

    grid = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]  # 4 cells
    monkeypatch.setattr(checkpoint_tiling, "MAX_GRID_CELLS", 3)
    problem = tiling_problem((4, 6), grid)
    assert problem == (
        "has 4 chunks whose boundaries cut it into 4 cells, more than the 3 that can be checked for overlaps and "
        "gaps; refused"
    )


def _save_as_bytes(snap: Path, fqn: str, payload: bytes) -> None:
    """Declare the checkpoint's `fqn` a bytes entry holding `payload` (appended to its data file)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = pickle.loads((snap / ".metadata").read_bytes())
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == fqn)
    data = (snap / info.relative_path).read_bytes()
    (snap / info.relative_path).write_bytes(data + payload)
    info.offset, info.length = len(data), len(payload)
    (snap / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_model_tensor_saved_as_bytes_is_refused_before_dcp_unpickles_it(snap: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class RunsACommand:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    for payload in (pickle.dumps(RunsACommand()), _torch_saved(RunsACommand())):  # a bare pickle, a torch archive
        hostile = shutil.copytree(snap, tmp_path / f"hostile{len(payload)}")
        _save_as_bytes(hostile, "model.head.weight", payload)
        with pytest.raises(SnapshotError, match=r"entry of 'model\.head\.weight', bytes \d+-\d+\): refused"):
            load_model_state(hostile, {"head.weight": torch.zeros(16, 16)})
    assert not marker.exists()
    # bytes that hold nothing hostile are still no tensor: DCP would unpickle them, so the name is refused first
    _save_as_bytes(snap, "model.head.weight", _torch_saved([None]))
    with pytest.raises(SnapshotError, match=r"'model\.head\.weight' is saved as bytes, not a tensor; refused"):
        load_model_state(snap, {"head.weight": torch.zeros(16, 16)})


def _torch_saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_an_entry_whose_pickle_is_garbled_is_named_when_the_load_fails(snap: Path) -> None:
    metadata = pickle.loads((snap / ".metadata").read_bytes())
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "model.head.weight")
    path = snap / info.relative_path
    data = bytearray(path.read_bytes())
    entry = bytes(data[info.offset : info.offset + info.length])
    with zipfile.ZipFile(io.BytesIO(entry)) as archive:
        pickled = archive.read("archive/data.pkl")
    at = info.offset + entry.index(pickled) + 2  # inside the pickle: the zip's headers and directory are intact
    data[at : at + 8] = bytes(8)
    path.write_bytes(bytes(data))

    assert check_checkpoint_storage(snap) == []  # sizes and records are all in order
    with pytest.raises(SnapshotError) as refused:
        _saved_state(snap)
    assert str(refused.value).startswith(f"{path} (entry of 'model.head.weight', bytes {info.offset}-")
    assert "not a tensor torch can read (" in str(refused.value)


def test_an_entry_whose_local_header_is_garbled_is_named_when_the_load_fails(snap: Path) -> None:
    metadata = pickle.loads((snap / ".metadata").read_bytes())
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "model.head.weight")
    path = snap / info.relative_path
    data = bytearray(path.read_bytes())
    entry = bytes(data[info.offset : info.offset + info.length])
    at = info.offset + entry.index(b"archive/data/0") - 30  # the tensor record's local header: its signature
    assert data[at : at + 4] == b"PK\x03\x04"
    data[at : at + 4] = bytes(4)
    path.write_bytes(bytes(data))

    with pytest.raises(SnapshotError, match=r"entry of 'model\.head\.weight'.*not a tensor torch can read"):
        _saved_state(snap)


def test_chunks_piled_on_one_another_are_refused_before_any_grid_is_marked() -> None:
    # four copies of the first row: their volumes add up to the tensor's, their cells to twice the grid's
    problem = tiling_problem((4, 4), [((0, 0), (1, 4))] * 4)
    assert problem == "has chunks that overlap (and so leave elements in no chunk)"
