"""The `.pt` archive check: files torch wrote pass, and a record edited to be compressed, oversized or a huge
pickle is refused by name before anything is loaded."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.safe_load import _check_archive, load_pt


def _central_directory(path: Path) -> tuple[int, int]:
    """(offset, size) of the central directory of an archive torch wrote."""
    data = path.read_bytes()
    size, offset = struct.unpack_from("<QQ", data, len(data) - 98 + 40)  # the zip64 end record's last two fields
    return offset, size


@pytest.mark.parametrize(
    "value",
    [
        {"grad_norm": 1.5, "param_grad_norms": {"w": 1.0}},
        {"tokens": torch.arange(12).reshape(3, 4), "loss_mask": torch.ones(3, 4)},
        {f"t{i}": torch.zeros(2) for i in range(400)},  # a central directory longer than the tail read at once
    ],
    ids=["no-tensors", "batch", "many-records"],
)
def test_torch_files_pass_the_archive_check(tmp_path: Path, value) -> None:
    path = tmp_path / "x.pt"
    torch.save(value, path)
    _check_archive(path, path.stat().st_size)  # every record stored and inside the file


def _edit_entry(path: Path, record: str, field: str, value: int) -> None:
    """Set `field` of `record`'s central directory entry in a torch-written archive."""
    data = bytearray(path.read_bytes())
    at, size = _central_directory(path)
    end = at + size
    where = {
        "extract_version": (6, "<H"),
        "compress_type": (10, "<H"),
        "compress_size": (20, "<L"),
        "file_size": (24, "<L"),
    }[field]
    while at < end:
        name_len, extra_len, comment_len = struct.unpack_from("<3H", data, at + 28)
        name = bytes(data[at + 46 : at + 46 + name_len]).decode()
        if name.endswith(record):
            struct.pack_into(where[1], data, at + where[0], value)
            path.write_bytes(bytes(data))
            return
        at += 46 + name_len + extra_len + comment_len
    raise AssertionError(f"no record {record}")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("compress_type", zipfile.ZIP_DEFLATED, "is compressed"),
        ("file_size", 2**31, "beyond the file's"),
        ("compress_size", 7, "beyond the file's"),  # sizes that disagree
    ],
)
def test_a_torch_shaped_archive_with_a_bad_record_is_refused(tmp_path: Path, field: str, value: int, message: str):
    path = tmp_path / "grad_info_rank0.pt"
    torch.save({"grad_norm": 1.0, "t": torch.ones(4)}, path)
    _edit_entry(path, "data/0", field, value)
    with pytest.raises(SnapshotError, match=f"{path}: record .*data/0.* {message}"):
        load_pt(path)


def test_a_torch_shaped_archive_with_a_huge_pickle_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "grad_info_rank0.pt"
    torch.save({"grad_norm": 1.0}, path)
    size = path.stat().st_size
    _edit_entry(path, "data.pkl", "file_size", 20 * 1024 * 1024)
    _edit_entry(path, "data.pkl", "compress_size", 20 * 1024 * 1024)
    with pytest.raises(SnapshotError, match="beyond the file's"):  # the file is smaller than its pickle claims
        _check_archive(path, size)
    with pytest.raises(SnapshotError, match=r"its pickle is 20\.0 MiB, more than the 16\.0 MiB limit"):
        _check_archive(path, 64 * 1024 * 1024)  # as if the file were large enough to hold it


def test_a_zip_version_zipfile_cannot_read_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "grad_info_rank0.pt"
    torch.save({"grad_norm": 1.0, "t": torch.ones(4)}, path)
    _edit_entry(path, "data/0", "extract_version", 64)  # "zip file version 6.4": zipfile raises NotImplementedError
    with pytest.raises(SnapshotError, match=r"grad_info_rank0\.pt: truncated or corrupt torch file"):
        load_pt(path)
