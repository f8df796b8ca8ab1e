"""Each tensor entry of a `.distcp` file checked before DCP reads it, by the rule every torch archive we read obeys.

DCP stores a tensor as a `torch.save` archive at (offset, length) of a `.distcp` file and reads it back with
`torch.load`, which inflates a deflated record whole before it compares its size with the tensor's: a 4 MB entry
can commit 4 GiB. The same record in a `.pt` file is refused (`safe_load.archive_problem`); here each entry's zip
directory is read in place (one read of the entry's tail, where torch writes it) and held to that same rule. An
entry DCP would pass through a stream transform (its zstd extension) is refused too: what it inflates to is not
known before it is read. Entries of one file must not share bytes (DCP writes each after the one before): a shared
entry is refused, not read again for each name that points at it. Nothing is allocated but the entries' directories.

A Megatron checkpoint has an entry per layer and expert (hundreds to hundreds of thousands), and `zipfile.ZipFile`
costs ~50 us an entry (a lock, a `ZipInfo` per record, end records found by seeking). So the directory of an entry
laid out exactly as torch writes it (the central directory, then zip64 end record, locator and end record, no
comment, no extra fields, nothing before the archive) is read from the entry's tail with zipfile's own record
formats (`_torch_directory`); anything else is read by `zipfile`. Either way the same rule judges the records.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.snapshot.safe_load import ZipRecord, records_problem, zip_records

TAIL_BYTES = 4096  # torch's end records and central directory for one tensor: ~700 bytes


class _EntryView(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file as a seekable read-only stream (what zipfile needs).

    The entry's last TAIL_BYTES are read once up front; zipfile's reads of the end records and central
    directory are served from them, so a well-formed entry costs one read."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.position = fd, offset, length, 0
        self.tail_start = max(0, length - TAIL_BYTES)
        self.tail = os.pread(fd, length - self.tail_start, offset + self.tail_start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the entry")
        self.position = base + offset
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self.length - self.position))
        if wanted == 0:
            return 0
        if self.position >= self.tail_start:
            at = self.position - self.tail_start
            data = self.tail[at : at + wanted]
        else:
            data = os.pread(self.fd, wanted, self.offset + self.position)
        view[: len(data)] = data
        self.position += len(data)
        return len(data)


def entry_problems(directory: Path, entries: Iterable[tuple[str, Any]], limit: int = 20) -> list[str]:
    """Why tensor entries are refused, at most `limit` of them: `entries` are (tensor name, DCP `_StorageInfo`)
    whose offset and length lie inside their `.distcp` file (the caller checked them against its size)."""
    problems: list[str] = []
    by_file: dict[str, list[tuple[str, Any]]] = {}
    for name, info in entries:
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:
            problems.append(
                f"{directory / info.relative_path}: entry of {shown(name, 120)} is stored through the stream "
                f"transform {shown(list(transforms), 80)}; what it inflates to is not known before it is read, so "
                "it is refused (re-save the checkpoint without DCP's compression extension)"
            )
            continue
        by_file.setdefault(info.relative_path, []).append((name, info))
    for relative, items in by_file.items():
        path = directory / relative
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            problems.append(f"{path}: cannot read ({exc.strerror or exc})")
            continue
        try:
            before: tuple[str, int, int] | None = None  # the entry before, along the file: (name, start, end)
            for name, info in sorted(items, key=lambda item: (item[1].offset, item[1].length)):  # one pass
                start, end = info.offset, info.offset + info.length
                if before is not None and start < before[2]:
                    # DCP writes each entry after the one before: shared bytes would load one tensor's data into
                    # another, and checking each sharer again would repeat one entry's work as often as it is named
                    problems.append(
                        f"{path}: entry of {shown(name, 120)} at bytes {start}-{end} overlaps the entry of "
                        f"{shown(before[0], 120)} at bytes {before[1]}-{before[2]}; each entry has bytes of its own"
                    )
                else:
                    problem = _entry_problem(fd, path, name, info.offset, info.length)
                    if problem:
                        problems.append(problem)
                if before is None or end > before[2]:
                    before = (name, start, end)
                if len(problems) >= limit:
                    return problems
        finally:
            os.close(fd)
    return problems[:limit]


def _entry_problem(fd: int, path: Path, name: str, offset: int, length: int) -> str | None:
    try:
        tail_start = max(0, length - TAIL_BYTES)
        records = _torch_directory(os.pread(fd, length - tail_start, offset + tail_start), tail_start, length)
        if records is None:  # not torch's own layout: zipfile reads it (and raises what it raises)
            with _EntryView(fd, offset, length) as view, zipfile.ZipFile(view) as archive:
                records = zip_records(archive)
        problem = records_problem(records, _LABEL, length)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError, NotImplementedError, struct.error) as exc:
        problem = f"{_LABEL}: not a torch archive, truncated or corrupt ({shown(str(exc), 120, quote=False)})"
    if problem is None:
        return None
    return problem.replace(_LABEL, f"{path} (entry of {shown(name, 120)}, bytes {offset}-{offset + length})", 1)


# The ZIP format's end records, as zipfile's module constants spell them (those are not in its typed API): end of
# central directory, zip64 end locator and zip64 end record, each a signature and its struct.
_END_SIG, _END = b"PK\x05\x06", struct.Struct("<4s4H2LH")
_LOCATOR_SIG, _LOCATOR = b"PK\x06\x07", struct.Struct("<4sLQL")
_END64_SIG, _END64 = b"PK\x06\x06", struct.Struct("<4sQ2H2L4Q")
_CENTRAL_SIG = b"PK\x01\x02"
_MAX_EXTRACT_VERSION = 63  # zipfile raises NotImplementedError beyond it
# zipfile's central directory record (`zipfile.structCentralDir`) with only the fields read here: signature, version
# needed to extract, flags, method, compressed and plain size, name, extra and comment lengths, local header offset
_CENTRAL = struct.Struct("<4s2xBxHH8xLLHHH8xL")
_ENDS = _END64.size + _LOCATOR.size + _END.size  # what torch writes after the central directory
_UTF8_NAME = 0x800  # general purpose flag: the file name is UTF-8 (else cp437)
_ZIP64_MARK = 0xFFFFFFFF  # a 32-bit field whose value lives in a zip64 extra field


def _torch_directory(tail: bytes, tail_start: int, length: int) -> list[ZipRecord] | None:
    """The central directory records of an entry of `length` bytes whose bytes from `tail_start` on are `tail`, if
    it is laid out exactly as torch's writer lays it out (see the module doc); None for any other layout, garbled
    or not, which `zipfile` then reads. Every field that would change how zipfile reads the records (a comment,
    extra fields, bytes before the archive, a directory not where the end records say) sends it there."""
    end = len(tail)
    if end < _ENDS:
        return None
    (sig, disk, disk_dir, count, count_total, dir_size, dir_offset, comment) = _END.unpack_from(tail, end - _END.size)
    if sig != _END_SIG or comment or disk or disk_dir or count != count_total:
        return None
    sig, zip64_disk, zip64_at, disks = _LOCATOR.unpack_from(tail, end - _END.size - _LOCATOR.size)
    if sig != _LOCATOR_SIG or zip64_disk or disks != 1 or zip64_at != length - _ENDS:
        return None
    sig, record_size, _, _, disk, disk_dir, count, count_total, dir_size, dir_offset = _END64.unpack_from(
        tail, end - _ENDS
    )
    if (
        sig != _END64_SIG
        or record_size != _END64.size - 12  # the record's size counts neither its signature nor this field
        or disk
        or disk_dir
        or count != count_total
        or dir_offset + dir_size != length - _ENDS  # nothing between the directory and the end records
        or dir_offset < tail_start
    ):
        return None
    records: list[ZipRecord] = []
    unpack, size = _CENTRAL.unpack_from, _CENTRAL.size
    at, stop = dir_offset - tail_start, end - _ENDS
    while at < stop:
        if at + size > stop:
            return None
        sig, version, flags, method, compressed, plain, name_len, extra_len, comment_len, header_offset = unpack(
            tail, at
        )
        if (
            sig != _CENTRAL_SIG
            or version > _MAX_EXTRACT_VERSION
            or extra_len
            or _ZIP64_MARK in (compressed, plain, header_offset)
        ):
            return None
        name_at = at + size
        at = name_at + name_len + comment_len
        if at > stop:
            return None
        raw = tail[name_at : name_at + name_len]
        try:  # ASCII reads alike in both encodings, and its codec is several times faster than cp437's table
            name = raw.decode("ascii" if raw.isascii() else "utf-8" if flags & _UTF8_NAME else "cp437")
        except UnicodeDecodeError:
            return None
        if "\0" in name:
            name = name[: name.index("\0")]  # as ZipInfo cuts it
        records.append((name, method, plain, compressed, header_offset))
    return records if len(records) == count else None


_LABEL = "\0entry\0"  # stands for the entry's label until a problem needs it (most entries have none)


def archive_records(data: bytes) -> list[ZipRecord]:
    """The directory records of a torch archive held in memory (a checkpoint entry): read from its tail as torch
    lays it out (`_torch_directory`), else by `zipfile`, which raises what it raises for garbled bytes."""
    tail_start = max(0, len(data) - TAIL_BYTES)
    records = _torch_directory(data[tail_start:], tail_start, len(data))
    if records is None:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            records = zip_records(archive)
    return records


def unreadable_entry(directory: Path, entries: Iterable[tuple[str, Any]]) -> str | None:
    """Why the first of `entries` ((tensor name, `_StorageInfo`)) that torch cannot read as a tensor fails, in words
    naming its file and bytes; None when each one reads. What a failed DCP load calls to say which entry it could not
    read, which DCP's error does not: first every entry's local zip headers and pickle (parsed on the meta device, no
    tensor data read), then, when those all pass, each entry's data, one entry at a time."""
    items = sorted(entries, key=lambda item: (item[1].relative_path, item[1].offset))  # one pass along each file
    return _first_failure(directory, items, data=False) or _first_failure(directory, items, data=True)


def _first_failure(directory: Path, items: list[tuple[str, Any]], data: bool) -> str | None:
    import torch

    fds: dict[str, int] = {}
    try:
        for name, info in items:
            path = directory / info.relative_path
            label = f"{path} (entry of {shown(name, 120)}, bytes {info.offset}-{info.offset + info.length})"
            try:
                if info.relative_path not in fds:
                    fds[info.relative_path] = os.open(path, os.O_RDONLY)
                fd = fds[info.relative_path]
                if not data:
                    with _EntryView(fd, info.offset, info.length) as view, zipfile.ZipFile(view) as archive:
                        for record in archive.infolist():
                            archive.open(record).close()  # reads and checks its local header, not its data
                with io.BufferedReader(_EntryView(fd, info.offset, info.length)) as stream:
                    value = torch.load(stream, map_location="cpu" if data else "meta", weights_only=True)
            except Exception as exc:  # zipfile, torch's reader and its unpickler raise many kinds for garbled bytes
                return f"{label}: not a tensor torch can read ({shown(torch_reason(exc), 200, quote=False)})"
            if not isinstance(value, torch.Tensor):
                return f"{label}: holds a {type(value).__name__}, not a tensor"
            del value
    finally:
        for fd in fds.values():
            os.close(fd)
    return None


def torch_reason(exc: BaseException) -> str:
    """The line of a torch loading error that says what is wrong (its weights-only errors wrap it in advice)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    return first.split(". This is an internal miniz error", 1)[0]  # what follows is advice, the same every time
