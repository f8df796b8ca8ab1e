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
