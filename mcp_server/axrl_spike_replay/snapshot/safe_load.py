"""Load `.pt` files from shared storage safely: `weights_only=True`, memory-mapped, sizes bounded by the file.

A `.pt` file is a zip archive: a pickle (`data.pkl`) describing tensors, and one stored record per
tensor storage. Every size the file declares is checked against the file itself before anything is
allocated: the archive's records must be stored uncompressed and lie inside the file (a deflated
record could expand a few MB into GBs), the pickle must be small, and every tensor must fit in the
bytes the file holds (a broadcast view can declare 10^10 elements over a 4-byte storage). Tensors
are memory-mapped, so only the ones a verb touches are ever read. Files in torch's legacy (pre-zip)
format cannot be memory-mapped and may declare any storage size: they are refused with a clear error.
A file is read only where it resolves inside its own directory (`containment.file_inside`): a symlink out of a
snapshot is refused by name, never read through. `load_pt_bytes` holds an archive held in memory (a checkpoint's
bytes entry) to the same rule.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError, UnsafeFileError
from axrl_spike_replay.untrusted.containment import file_inside
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError

# Limits on what a rank file may declare (all far above what a trainer writes).
MAX_PT_PICKLE_BYTES = 16 * 1024 * 1024  # data.pkl holds tensor headers and small dicts: kilobytes in practice
MAX_PT_RECORDS = 100_000  # archive entries: one per tensor storage plus a few; a rank file has tens
MAX_PT_NESTING = 32  # containers inside containers (a batch is a dict, or micro_batches of dicts)

_ZIP_MAGIC = b"PK\x03\x04"


def human_bytes(n: int) -> str:
    """Bytes for messages: 4.0 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _check_archive(file: Path, size: int, label: str | None = None) -> None:
    """SnapshotError unless `file` is a torch zip archive whose records are stored, bounded and inside it; messages
    name it `label` (the path it was asked for, where `file` is that path with its links resolved)."""
    label = str(file) if label is None else label
    try:
        with zipfile.ZipFile(file) as archive:  # one read of the end records and the central directory
            problem = archive_problem(archive, label, size)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, struct.error) as exc:
        _refuse_unreadable_archive(file, exc, label)  # NotImplementedError: a zip version or feature zipfile lacks
    if problem:
        raise SnapshotError(problem)


def archive_problem(archive: zipfile.ZipFile, label: str, size: int) -> str | None:
    """Why an open torch archive of `size` bytes is refused (the first reason, worded with `label`), or None.

    The rule for every torch archive we read, a `.pt` file or an entry of a `.distcp` file: at most
    MAX_PT_RECORDS records, each stored uncompressed and inside the archive, and a pickle of at most
    MAX_PT_PICKLE_BYTES. Torch inflates a deflated record whole before it checks the record's size, so a
    few MB could commit GBs; a stored record's size is bounded by the bytes on disk.
    """
    return records_problem(zip_records(archive), label, size)


ZipRecord = tuple[str, int, int, int, int]  # a directory record: name, method, plain size, stored size, header offset


def zip_records(archive: zipfile.ZipFile) -> list[ZipRecord]:
    """The directory records of an open archive, as `records_problem` reads them."""
    return [(r.filename, r.compress_type, r.file_size, r.compress_size, r.header_offset) for r in archive.infolist()]


def records_problem(records: Sequence[ZipRecord], label: str, size: int) -> str | None:
    """`archive_problem`'s rule over an archive's directory records (`ZipRecord`s)."""
    if len(records) > MAX_PT_RECORDS:
        return f"{label}: {len(records)} archive records, more than the {MAX_PT_RECORDS} limit"
    deflated = [record for record in records if record[1] != zipfile.ZIP_STORED]
    if deflated:
        name, _, plain, compressed, _ = max(deflated, key=lambda record: record[2])  # what would cost the most
        return (
            f"{label}: record {shown(name, 120)} is compressed ({plain} bytes from {compressed}); torch stores "
            "records uncompressed, so it is refused rather than expanded"
        )
    for name, _, plain, compressed, header_offset in records:
        if plain != compressed or header_offset + plain > size:
            return (
                f"{label}: record {shown(name, 120)} declares {human_bytes(plain)}, beyond the file's "
                f"{human_bytes(size)}"
            )
        is_pickle = name.endswith("/data.pkl") or name == "data.pkl"
        if is_pickle and plain > MAX_PT_PICKLE_BYTES:
            return (
                f"{label}: its pickle is {human_bytes(plain)}, more than the "
                f"{human_bytes(MAX_PT_PICKLE_BYTES)} limit (rank files hold tensors and small dicts)"
            )
    return None


def _refuse_unreadable_archive(file: Path, exc: Exception, label: str) -> NoReturn:
    """The SnapshotError for a file `zipfile` could not open: not a zip at all, or a broken one."""
    if not zipfile.is_zipfile(file):
        with open(file, "rb") as handle:
            head = handle.read(4)
        if head == _ZIP_MAGIC:
            raise SnapshotError(f"{label}: truncated or corrupt torch file (the zip archive is incomplete)") from None
        raise SnapshotError(
            f"{label}: refused to load: not in torch's zip format (a legacy or raw-pickle file cannot be "
            "memory-mapped and may declare any size); nothing in it was run; re-save it with torch.save"
        ) from None
    raise SnapshotError(f"{label}: truncated or corrupt torch file ({_first_line(exc)})") from None


_NO_TENSORS = frozenset({float, int, bool, str, bytes, type(None)})  # leaves that hold no tensor (exact types)


def check_tensors(value: Any, file: str | Path, size: int, where: str = "", depth: int = 0) -> None:
    """SnapshotError unless every tensor in `value` fits in the `size` bytes of `file`.

    A tensor's storage (as declared, for meta tensors) and its logical size (elements x element size)
    must both be at most the file's size, and containers may nest at most MAX_PT_NESTING deep.
    """
    import torch

    if depth > MAX_PT_NESTING:
        raise SnapshotError(f"{file}: containers nest deeper than {MAX_PT_NESTING} levels (at {where or 'top'})")
    local = getattr(value, "_local_tensor", None)
    if isinstance(value, torch.Tensor) and isinstance(local, torch.Tensor):
        # A DTensor: this file holds its local shard; the global shape is checked by whoever merges the shards.
        check_tensors(local, file, size, f"{where} (local shard)", depth + 1)
    elif isinstance(value, torch.Tensor) and value.is_nested:
        # A jagged nested tensor: its flat values and offsets are what the file holds.
        parts = (value.values(), value.offsets()) if value.layout == torch.jagged else tuple(value.unbind())  # pyright: ignore[reportAttributeAccessIssue]
        for i, part in enumerate(parts):
            check_tensors(part, file, size, f"{where}(nested part {i})", depth + 1)
    elif isinstance(value, torch.Tensor):
        label = where or "the top-level tensor"
        storage = value.untyped_storage().nbytes()
        logical = value.numel() * value.element_size()
        if storage > size or logical > size:
            raise SnapshotError(
                f"{file}: tensor {label} declares shape {tuple(value.shape)} ({human_bytes(max(storage, logical))}), "
                f"more than the file's {human_bytes(size)}; refused"
            )
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if type(item) not in _NO_TENSORS or depth >= MAX_PT_NESTING:  # numbers need no label, nor a visit
                check_tensors(item, file, size, f"{where}[{shown(str(key), 80)}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if type(item) not in _NO_TENSORS or depth >= MAX_PT_NESTING:
                check_tensors(item, file, size, f"{where}[{i}]", depth + 1)


def _opened(source: Path | bytes) -> Path | io.BytesIO:
    return source if isinstance(source, Path) else io.BytesIO(source)


def _storage_problem(source: Path | bytes, label: str, size: int) -> str:
    """Why torch could not map a tensor's storage: the tensor whose declared storage exceeds the file."""
    import torch

    try:
        with _only_globals([]):
            declared = torch.load(_opened(source), map_location="meta", weights_only=True)
        check_tensors(declared, label, size)
    except SnapshotError as exc:
        return str(exc)
    except Exception:
        pass
    return f"{label}: a tensor's declared storage runs past its record in the file; refused"


def load_pt(path: str | Path, *, meta: bool = False, allowed_globals: Sequence[Any] = ()) -> Any:
    """Load a `.pt` file with `weights_only=True`, memory-mapped, after bounding what it declares.

    `meta=True` gives meta tensors (shapes and dtypes, no data read); otherwise tensors map the file,
    so only the tensors that are touched are read. A file whose pickle asks for anything beyond
    tensors and plain containers raises UnsafeFileError; nothing in it runs. A file whose records or
    tensors declare more than it holds raises SnapshotError naming the file and the tensor; so does a
    symlink that leads out of the file's directory (`containment.file_inside`).
    `allowed_globals` admits a few more classes for this one load (e.g. DTensor's, for FSDP shards).
    """
    file = Path(path)
    target = inside_its_tree(file)
    if not target.is_file():
        raise SnapshotError(f"{file}: file not found")
    try:
        size = target.stat().st_size
        _check_archive(target, size, str(file))
    except OSError as exc:
        raise SnapshotError(f"{file}: cannot read ({exc.strerror or exc})") from None
    return _load_checked(target, str(file), size, meta, list(allowed_globals))


def inside_its_tree(file: Path, root: Path | None = None) -> Path:
    """`containment.file_inside(file, root)` for a snapshot file: its resolved path, or a SnapshotError naming
    it when it leads out of its tree (the snapshot dir)."""
    try:
        return file_inside(file, root)
    except UntrustedInputError as exc:
        raise SnapshotError(f"{file}: {exc}") from None


def load_pt_bytes(data: bytes, label: str, *, meta: bool = False) -> Any:
    """`load_pt`'s rule for a torch archive held in memory (an entry of a checkpoint file), worded with `label`:
    weights-only, its records stored and inside `data`, every tensor within its bytes. Tensors are copied out of
    `data` (or on the meta device with `meta=True`)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            problem = archive_problem(archive, label, len(data))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, struct.error) as exc:
        problem = f"{label}: refused to load: not a torch archive, truncated or corrupt ({_first_line(exc)})"
    if problem:
        raise SnapshotError(problem)
    return _load_checked(data, label, len(data), meta, [])


def _load_checked(source: Path | bytes, label: str, size: int, meta: bool, allowed: list[Any]) -> Any:
    """torch.load of `source` (a file, mapped, or an archive's `size` bytes) weights-only, with only `allowed`
    beyond torch's own globals; every failure a SnapshotError worded with `label`, a refused global an
    UnsafeFileError."""
    import torch

    mmap = isinstance(source, Path)
    try:
        with _only_globals(allowed):
            loaded = torch.load(_opened(source), mmap=mmap, weights_only=True, map_location="meta" if meta else "cpu")
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "weights_only" in text.lower() or "unsupported global" in text.lower():
            first = text.strip().splitlines()[0] if text.strip() else "unsupported content"
            detail = _unsupported_global(text) or _weights_only_reason(text) or first
            raise UnsafeFileError(
                f"{label}: refused to load: it holds a pickled object beyond plain tensors and "
                f"containers ({shown(detail, 300, quote=False)}); nothing in it was run"
            ) from None
        raise SnapshotError(
            f"{label}: not a readable torch file ({shown(text.strip(), 300, quote=False) or 'unpickling failed'})"
        ) from None
    except RuntimeError as exc:
        if "not resizable" in str(exc) or "out of bounds for storage" in str(exc):
            raise SnapshotError(_storage_problem(source, label, size)) from None
        raise SnapshotError(f"{label}: truncated or corrupt torch file ({_first_line(exc)})") from None
    except (EOFError, ValueError, OverflowError, MemoryError, RecursionError, zipfile.BadZipFile, OSError) as exc:
        raise SnapshotError(f"{label}: truncated or corrupt torch file ({_first_line(exc)})") from None
    check_tensors(loaded, label, size)
    return loaded


@contextmanager
def _only_globals(allowed: list[Any]) -> Iterator[None]:
    """torch's weights_only allowlist holding torch's own entries and `allowed` for one load. Libraries widen it
    for the whole process (importing megatron.core registers PosixPath, SimpleNamespace, numpy arrays, BytesIO,
    ...): a file from shared storage gets only what torch and this module admit, whatever else was imported."""
    import torch

    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals([g for g in before if _is_torchs(g)] + allowed)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def _is_torchs(entry: Any) -> bool:
    """Whether a safe-globals entry (a class or function, or a (class, name) pair) is torch's own (torch registers
    its nested tensors' classes there when `torch.nested` is imported)."""
    target = entry[0] if isinstance(entry, tuple) else entry
    module = getattr(target, "__module__", "") or ""
    return module == "torch" or module.startswith("torch.")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return shown(text.splitlines()[0], 300, quote=False) if text else type(exc).__name__


def _weights_only_reason(text: str) -> str | None:
    """What torch's weights-only unpickler said is wrong (its error wraps the reason in advice), or None."""
    if "WeightsUnpickler error:" not in text:
        return None
    lines = [line.strip() for line in text.split("WeightsUnpickler error:", 1)[1].splitlines() if line.strip()]
    return lines[0] if lines else None


def _unsupported_global(text: str) -> str | None:
    """The line of torch's weights-only error naming the refused global, without its advice to allow it."""
    for line in text.splitlines():
        if "GLOBAL" in line or "Unsupported global" in line:
            return line.split(". Please use `torch.serialization.add_safe_globals", 1)[0].strip()
    return None
