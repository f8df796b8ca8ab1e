"""A `.distcp` entry's zip directory read from its tail as torch lays it out gives exactly the records `zipfile`
reads, and any entry laid out otherwise (garbled, or written by another zip writer) is left to `zipfile`: the fast
way never reads an entry more leniently than the stdlib. A record torch would inflate is refused either way."""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from axrl_spike_replay.snapshot.dcp import checkpoint_entries
from axrl_spike_replay.snapshot.dcp.checkpoint import check_checkpoint_storage

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _tensor_entries(snapshot: Path) -> list[tuple[str, bytes]]:
    """(tensor name, the entry's bytes) of every tensor entry of the snapshot's checkpoint (the test's own read)."""
    metadata = pickle.loads((snapshot / ".metadata").read_bytes())
    tensors = {name for name, item in metadata.state_dict_metadata.items() if hasattr(item, "chunks")}
    out = []
    for index, info in metadata.storage_data.items():
        if index.fqn in tensors:
            with open(snapshot / info.relative_path, "rb") as handle:
                handle.seek(info.offset)
                out.append((index.fqn, handle.read(info.length)))
    return out


def _zipfile_records(entry: bytes, tmp: Path) -> list[tuple[str, int, int, int, int]] | None:
    """What `zipfile` reads of the entry's directory, or None where it refuses the entry."""
    path = tmp / "entry.zip"
    path.write_bytes(entry)
    try:
        with zipfile.ZipFile(path) as archive:
            return [
                (r.filename, r.compress_type, r.file_size, r.compress_size, r.header_offset) for r in archive.infolist()
            ]
    except Exception:  # zipfile raises many kinds for garbled bytes: all mean "refused"
        return None


def _fast_records(entry: bytes) -> list[tuple[str, int, int, int, int]] | None:
    start = max(0, len(entry) - checkpoint_entries.TAIL_BYTES)
    records = checkpoint_entries._torch_directory(entry[start:], start, len(entry))
    return None if records is None else [tuple(r) for r in records]  # type: ignore[misc]


def test_every_entry_torch_wrote_is_read_the_fast_way_as_zipfile_reads_it(
    golden_snapshot: Path, tmp_path: Path
) -> None:
    entries = _tensor_entries(golden_snapshot)
    assert entries
    for name, entry in entries:
        fast = _fast_records(entry)
        assert fast is not None, f"{name}: torch's own layout not recognised"
        assert fast == _zipfile_records(entry, tmp_path), name


@FUZZ
@given(where=st.integers(0, 700), noise=st.binary(min_size=1, max_size=8))
@example(where=0, noise=b"\x00")  # the end record's signature
@example(where=23, noise=b"\x01")  # the locator's offset of the zip64 end record
@example(where=100, noise=b"\x08")  # a directory record's fields
@example(where=2, noise=b"\x05")  # the end record's comment length
def test_a_garbled_directory_is_never_read_more_leniently_than_zipfile_reads_it(
    golden_snapshot: Path, tmp_path: Path, where: int, noise: bytes
) -> None:
    """Noise written `where` bytes before the end of a real entry (its end records and central directory)."""
    _, entry = max(_tensor_entries(golden_snapshot), key=lambda item: len(item[1]))
    garbled = bytearray(entry)
    at = max(0, len(garbled) - 1 - where)
    garbled[at : at + len(noise)] = noise[: len(garbled) - at]
    fast = _fast_records(bytes(garbled))
    if fast is not None:
        assert fast == _zipfile_records(bytes(garbled), tmp_path)


def test_a_record_marked_deflated_in_torch_s_own_layout_is_refused(golden_snapshot: Path, tmp_path: Path) -> None:
    snapshot = tmp_path / golden_snapshot.name
    shutil.copytree(golden_snapshot, snapshot)
    metadata = pickle.loads((snapshot / ".metadata").read_bytes())
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "model.head.weight")
    path = snapshot / info.relative_path
    data = bytearray(path.read_bytes())
    entry = bytes(data[info.offset : info.offset + info.length])
    central = entry.rindex(b"PK\x01\x02", 0, entry.rindex(b"archive/data/0"))  # the tensor record's directory entry
    data[info.offset + central + 10] = zipfile.ZIP_DEFLATED  # its compression method
    path.write_bytes(bytes(data))
    fast = _fast_records(bytes(data[info.offset : info.offset + info.length]))
    assert fast is not None and ("archive/data/0", zipfile.ZIP_DEFLATED) in [r[:2] for r in fast]  # read the fast way
    problems = check_checkpoint_storage(snapshot)
    assert len(problems) == 1
    assert "(entry of 'model.head.weight', bytes" in problems[0] and "archive/data/0' is compressed" in problems[0]


@pytest.mark.parametrize("kind", ["comment", "extra"])
def test_an_entry_another_zip_writer_laid_out_is_read_by_zipfile(tmp_path: Path, kind: str) -> None:
    """Python's own zip writer (no zip64 end records for a small archive, a comment, an extra field): the fast way
    steps aside, and the rule still reads the records."""
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        info = zipfile.ZipInfo("archive/data.pkl")
        if kind == "extra":
            info.extra = b"\xfe\xca\x00\x00"
        archive.writestr(info, b"x" * 10)
        if kind == "comment":
            archive.comment = b"hello"
    entry = path.read_bytes()
    assert _fast_records(entry) is None
    fd = os.open(path, os.O_RDONLY)
    try:
        assert checkpoint_entries._entry_problem(fd, path, "t", 0, len(entry)) is None
    finally:
        os.close(fd)


def test_the_record_formats_are_zipfile_s_own() -> None:
    ce, zf = checkpoint_entries, vars(zipfile)  # zipfile's module constants (not in its typed API)
    assert (ce._END_SIG, ce._END.format) == (zf["stringEndArchive"], struct.Struct(zf["structEndArchive"]).format)
    assert (ce._LOCATOR_SIG, ce._LOCATOR.format) == (
        zf["stringEndArchive64Locator"],
        struct.Struct(zf["structEndArchive64Locator"]).format,
    )
    assert (ce._END64_SIG, ce._END64.format) == (
        zf["stringEndArchive64"],
        struct.Struct(zf["structEndArchive64"]).format,
    )
    assert (ce._CENTRAL_SIG, ce._CENTRAL.size) == (zf["stringCentralDir"], struct.calcsize(zf["structCentralDir"]))
    assert zf["MAX_EXTRACT_VERSION"] == ce._MAX_EXTRACT_VERSION
