"""Snapshot files that declare sizes they do not hold: what a corrupt or hostile file on shared storage looks like.

Each writer changes one file of a copied snapshot in place. Used by the hardening tests and by
benchmarks/bench_hostile.py (which puts this directory on sys.path).
"""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from pathlib import Path

import torch

_SEED_NUMEL = 2**20 + 1  # a numel whose BININT encoding is easy to find and replace in the pickle


def declare_world_size(snapshot: Path, world_size: int) -> None:
    """Make `axrl_metadata.json` declare `world_size` ranks (all data-parallel)."""
    path = snapshot / "axrl_metadata.json"
    doc = json.loads(path.read_text())
    doc["parallel"].update(world_size=world_size, dp=world_size)
    path.write_text(json.dumps(doc))


def _pickle_with_numel(key: str, numel: int) -> tuple[list[zipfile.ZipInfo], dict[str, bytes], str]:
    """The records of a torch file holding {key: float32 tensor}, its pickle rewritten to declare `numel`."""
    import io

    buffer = io.BytesIO()
    torch.save({key: torch.zeros(_SEED_NUMEL), "param_grad_norms": {}}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        infos = archive.infolist()
        data = {info.filename: archive.read(info.filename) for info in infos}
    pkl = next(name for name in data if name.endswith("data.pkl"))
    seed = b"J" + struct.pack("<i", _SEED_NUMEL)
    assert data[pkl].count(seed) == 2  # the storage's numel and the tensor's shape
    data[pkl] = data[pkl].replace(seed, b"J" + struct.pack("<i", numel))
    record = next(name for name in data if name.endswith("/data/0"))
    return infos, data, record


def write_lying_tensor_file(path: Path, key: str, declared_bytes: int) -> None:
    """A small `.pt` whose pickle declares a float32 tensor `key` of `declared_bytes`, stored with 4 MiB of data."""
    infos, data, _ = _pickle_with_numel(key, declared_bytes // 4)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as out:
        for info in infos:
            out.writestr(info.filename, data[info.filename])


def write_compressed_tensor_file(path: Path, key: str, expanded_bytes: int) -> None:
    """A `.pt` holding a float32 tensor `key` of `expanded_bytes` zeros, deflated to a few MB (a zip bomb)."""
    numel = expanded_bytes // 4
    infos, data, record = _pickle_with_numel(key, numel)
    chunk = bytes(16 * 1024 * 1024)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as out:
        for info in infos:
            if info.filename != record:
                out.writestr(info.filename, data[info.filename])
                continue
            with out.open(info.filename, "w", force_zip64=True) as stream:
                left = numel * 4
                while left:
                    stream.write(chunk[: min(left, len(chunk))])
                    left -= min(left, len(chunk))


def write_broadcast_batch(path: Path, rows: int, cols: int) -> None:
    """A batch whose tokens and mask are [rows, cols] views of a one-element storage (stride 0)."""
    one = torch.ones(1, dtype=torch.long)
    torch.save({"tokens": one.expand(rows, cols), "loss_mask": one.expand(rows, cols)}, path)


def declare_checkpoint_tensor(snapshot: Path, shape: tuple[int, ...], name: str = "model.embed.weight") -> None:
    """Make the checkpoint's `.metadata` declare `name` with `shape` (its data files unchanged)."""
    path = snapshot / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own fixture: trusted here
    item = metadata.state_dict_metadata[name]
    item.size = torch.Size(shape)
    item.chunks[0].sizes = torch.Size(shape)
    path.write_bytes(pickle.dumps(metadata))


def _checkpoint_entry(snapshot: Path, name: str) -> tuple[object, object, object]:
    """(metadata, its storage index, its storage info) of tensor `name`'s single entry (the test's own fixture:
    the `.metadata` is trusted here)."""
    metadata = pickle.loads((snapshot / ".metadata").read_bytes())
    [(index, info)] = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == name]
    return metadata, index, info


def write_distcp_bomb(
    snapshot: Path, expanded_bytes: int, name: str = "model.embed.weight", compresslevel: int | None = None
) -> int:
    """Make tensor `name`'s `.distcp` entry a zip bomb: the same tensor, its values intact, as a view over a storage
    of `expanded_bytes` deflated to a few MB (appended to the data file; `.metadata` points at it). DCP's reader
    would inflate the whole storage and then load the right values. Returns the new entry's length."""
    import io

    metadata, _, info = _checkpoint_entry(snapshot, name)
    distcp = snapshot / info.relative_path
    data = distcp.read_bytes()
    tensor = torch.load(io.BytesIO(data[info.offset : info.offset + info.length]), weights_only=True)
    itemsize = tensor.element_size()
    numel = expanded_bytes // itemsize
    assert tensor.numel() <= _SEED_NUMEL and numel < 2**31  # BININT holds the storage's numel
    seed = torch.zeros(_SEED_NUMEL, dtype=tensor.dtype)
    seed[: tensor.numel()] = tensor.reshape(-1)
    buffer = io.BytesIO()
    torch.save(seed[: tensor.numel()].view(tensor.shape), buffer)  # saves the whole seed storage
    with zipfile.ZipFile(buffer) as archive:
        infos = archive.infolist()
        records = {i.filename: archive.read(i.filename) for i in infos}
    pkl = next(n for n in records if n.endswith("data.pkl"))
    storage = next(n for n in records if "/data/" in n)
    seed_numel = b"J" + struct.pack("<i", _SEED_NUMEL)
    assert records[pkl].count(seed_numel) == 1  # the storage's numel (the view's shape is the tensor's)
    records[pkl] = records[pkl].replace(seed_numel, b"J" + struct.pack("<i", numel))
    entry = io.BytesIO()
    chunk = bytes(16 * 1024 * 1024)
    with zipfile.ZipFile(
        entry, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True, compresslevel=compresslevel
    ) as out:
        for i in infos:
            if i.filename != storage:
                out.writestr(i.filename, records[i.filename])
                continue
            with out.open(i.filename, "w", force_zip64=True) as stream:
                stream.write(records[storage][: tensor.numel() * itemsize])
                left = numel * itemsize - tensor.numel() * itemsize
                while left:
                    stream.write(chunk[: min(left, len(chunk))])
                    left -= min(left, len(chunk))
    payload = entry.getvalue()
    with distcp.open("ab") as handle:
        handle.write(payload)
    info.offset, info.length = len(data), len(payload)
    (snapshot / ".metadata").write_bytes(pickle.dumps(metadata))
    return len(payload)


def set_checkpoint_chunks(snapshot: Path, name: str, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Make the checkpoint's `.metadata` declare `chunks` ((offsets, sizes) each) for tensor `name`; each chunk
    gets a storage entry (the tensor's own entry, so every declared byte is backed; what DCP reads no longer fits)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    metadata, index, info = _checkpoint_entry(snapshot, name)
    item = metadata.state_dict_metadata[name]
    item.chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks]
    if chunks:  # with none, the tensor's entry stays: its bytes are on disk, no chunk says where they go
        del metadata.storage_data[index]
    for i, (offsets, _) in enumerate(chunks):
        metadata.storage_data[MetadataIndex(name, torch.Size(offsets), i)] = info
    (snapshot / ".metadata").write_bytes(pickle.dumps(metadata))


def edit_routing_payload(snapshot: Path, rank: int, change) -> None:
    """Rewrite `routing_payload_rank<rank>.pt` as `change(doc)` leaves it (the test's own fixture: trusted here)."""
    path = snapshot / f"routing_payload_rank{rank}.pt"
    doc = torch.load(path, weights_only=True)
    change(doc)
    torch.save(doc, path)


def edit_safetensors_header(path: Path, change) -> None:
    """Rewrite a `.safetensors` file's JSON header as `change(header)` leaves it; the tensor data stays as it was."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])


def save_bytes_entries(directory: Path, objects: dict[str, bytes]) -> None:
    """A DCP checkpoint of one tensor and a bytes entry per {name: bytes}, stored as they are: how megatron-core's
    save planner stores each ShardedObject (`_extra_state`) it has `torch.save`d itself."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class AsSerialized(DefaultSavePlanner):
        def transform_object(self, write_item: object, object: object) -> object:
            return object  # already serialized, as megatron-core's MCoreSavePlanner hands them over

    state: dict[str, object] = {"embedding.word_embeddings.weight": torch.zeros(64, 16)}
    state.update({name: io.BytesIO(data) for name, data in objects.items()})
    dcp.save(state, checkpoint_id=str(directory), planner=AsSerialized(), no_dist=True)


def torch_saved(value: object, protocol: int = 2) -> bytes:
    """`value` as `torch.save` writes it (DCP and megatron-core save with protocol 2)."""
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer, pickle_protocol=protocol)
    return buffer.getvalue()
