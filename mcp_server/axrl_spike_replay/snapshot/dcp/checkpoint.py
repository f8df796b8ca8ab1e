"""The snapshot's weights: torch.distributed.checkpoint (DCP), read without trusting its pickles.

DCP's own reader unpickles `.metadata` with plain `pickle.load`; snapshots come from shared
storage, so the metadata is read here with an unpickler that admits only DCP's metadata classes,
after bounding its size, and its structure is checked before any field is used. Every size it
declares is checked against the `.distcp` files on disk (`check_checkpoint_storage`) before DCP
allocates anything. Tensor data (`*.distcp`) is read by DCP with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError, UnsafeFileError
from axrl_spike_replay.snapshot.dcp.checkpoint_bytes import bytes_entry_problems
from axrl_spike_replay.snapshot.dcp.checkpoint_entries import entry_problems, torch_reason, unreadable_entry
from axrl_spike_replay.snapshot.dcp.checkpoint_tiling import tiling_problem
from axrl_spike_replay.snapshot.layout import DCP_METADATA
from axrl_spike_replay.snapshot.safe_load import human_bytes, inside_its_tree

if TYPE_CHECKING:
    import torch

MAX_DCP_METADATA_BYTES = 64 * 1024 * 1024  # `.metadata` of a many-shard 100B-parameter model is a few MB
MAX_TENSOR_DIMS = 16  # dimensions of one checkpoint tensor

_DCP_METADATA_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "TensorProperties",
    "ChunkStorageMetadata",
    "BytesStorageMetadata",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
# Megatron's torch_dist backend also pickles every rank's save plan into `.metadata` (`all_local_plans`, reused by
# its fully parallel save): plain dataclasses and an enum of DCP's planner, checked against megatron-core 0.16.1.
_DCP_PLANNER_CLASSES = {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}


class _Record:
    """Stand-in for a DCP metadata class when only sizes and dtypes are wanted: keeps the pickled state.

    Importing torch.distributed.checkpoint costs most of a second; `summarize_checkpoint` avoids it.
    """

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            self.__dict__.update(state[0] or {})  # (dict, slots) as dataclasses with slots pickle
            self.__dict__.update(state[1])
        else:
            self.state = state  # TensorProperties pickles a tuple starting with the dtype


_RECORDS = {
    name: type(name, (_Record,), {}) for name in (*_DCP_METADATA_CLASSES, *_DCP_PLANNER_CLASSES, "_StorageInfo")
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, records: bool = False) -> None:
        super().__init__(file)
        self.records = records

    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = (
            (module == "torch.distributed.checkpoint.metadata" and name in _DCP_METADATA_CLASSES)
            or (module == "torch.distributed.checkpoint.planner" and name in _DCP_PLANNER_CLASSES)
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "pathlib" and name in {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"})
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise UnsafeFileError(f"unsupported global {module}.{name}")
        if self.records and module.startswith("torch.distributed.checkpoint."):
            return _RECORDS[name]
        if module == "torch.serialization":
            return _layout
        return super().find_class(module, name)


def _layout(name: Any) -> Any:
    """The torch layout `torch.serialization._get_layout` gives for `name` (KeyError for any other name), found
    by name: torch's own builds its table from every attribute of `torch` on first use, most of a millisecond."""
    import torch

    if not isinstance(name, str):
        return torch.serialization._get_layout(name)  # its own error for a name that is not a string
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.layout) or str(value) != name:
        raise KeyError(name)
    return value


def read_checkpoint_metadata(checkpoint_dir: str | Path, *, records: bool = False) -> Any:
    """DCP `Metadata` of a checkpoint directory, unpickled with an allowlist, its structure checked.

    `records=True` gives light stand-ins of DCP's classes (same attributes) without importing DCP.
    """
    path = Path(checkpoint_dir) / DCP_METADATA
    inside_its_tree(path)  # never read through a symlink out of the checkpoint dir
    if not path.is_file():
        raise SnapshotError(f"{path}: checkpoint metadata not found (no distributed checkpoint here)")
    try:
        stat = path.stat()
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not records:  # DCP's own classes, handed to DCP's loader (which sets fields on them): read afresh
        return _read_metadata(path, records)
    # the stand-ins serve several checks of one inspect: the file as it is now (same inode, size, times) gives the
    # same answer, so one reading serves them all; the object is shared and only read
    return _read_records(str(path), (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns))


@functools.lru_cache(maxsize=8)
def _read_records(name: str, _identity: tuple[int, int, int, int]) -> Any:
    return _read_metadata(Path(name), True)


def _read_metadata(path: Path, records: bool) -> Any:
    try:
        size = path.stat().st_size
        if size > MAX_DCP_METADATA_BYTES:
            raise SnapshotError(
                f"{path}: {human_bytes(size)}, more than the {human_bytes(MAX_DCP_METADATA_BYTES)} limit"
            )
        with open(path, "rb") as handle:
            data = handle.read(MAX_DCP_METADATA_BYTES + 1)
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with _no_collection():
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data), records).load()
        except UnsafeFileError as exc:
            raise UnsafeFileError(f"{path}: refused to load: {exc}; nothing in it was run") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError, KeyError) as exc:
            raise SnapshotError(f"{path}: truncated or corrupt checkpoint metadata ({shown(str(exc), 200)})") from None
        except (MemoryError, RecursionError, OverflowError) as exc:
            raise SnapshotError(
                f"{path}: checkpoint metadata too large or deep to read ({type(exc).__name__})"
            ) from None
        _check_structure(metadata, path)
    return metadata


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """The garbage collector off while a pass makes an object or two per checkpoint entry (a `.metadata` may name
    hundreds of thousands): each collection it triggers would walk torch's whole heap, several times the pass's own
    work. Nothing made here holds a reference cycle."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _check_structure(metadata: Any, path: Path) -> None:
    """SnapshotError unless `metadata` has the shape of DCP's Metadata (the fields this tool uses)."""
    if type(metadata).__name__ != "Metadata":
        raise SnapshotError(f"{path}: not DCP checkpoint metadata (it holds a {type(metadata).__name__})")
    items = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(items, dict) or not isinstance(storage, dict):
        raise SnapshotError(f"{path}: checkpoint metadata lacks its state_dict_metadata and storage_data tables")
    for name, item in items.items():
        if not isinstance(name, str):
            raise SnapshotError(f"{path}: a checkpoint entry name is a {type(name).__name__}, not a string")
        if type(item).__name__ == "TensorStorageMetadata":
            _tensor_shape(getattr(item, "size", None), path, name)
            _dtype(item, path, name)
            chunks = getattr(item, "chunks", None)
            if not isinstance(chunks, list):
                raise SnapshotError(f"{path}: tensor {shown(name, 120)} has no list of chunks")
            for chunk in chunks:
                _tensor_shape(getattr(chunk, "sizes", None), path, name)
                _tensor_shape(getattr(chunk, "offsets", None), path, name)
        elif type(item).__name__ != "BytesStorageMetadata":
            raise SnapshotError(f"{path}: entry {shown(name, 120)} is a {type(item).__name__}")
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        relative = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(fqn, str) or not isinstance(relative, str):
            raise SnapshotError(f"{path}: a storage entry lacks its tensor name or file name")
        if "/" in relative or "\\" in relative or relative in ("", ".", ".."):
            raise SnapshotError(f"{path}: storage file {shown(relative, 120)} is not a file name inside the checkpoint")
        for value, what in ((offset, "offset"), (length, "length")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SnapshotError(f"{path}: storage of {shown(fqn, 120)} has a bad {what} {shown(value, 40)}")


def _tensor_shape(size: Any, path: Path, name: str) -> tuple[int, ...]:
    if not isinstance(size, (tuple, list)) or len(size) > MAX_TENSOR_DIMS:
        raise SnapshotError(f"{path}: tensor {shown(name, 120)} has no valid shape ({shown(size, 80)})")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in size):
        raise SnapshotError(f"{path}: tensor {shown(name, 120)} has a bad shape {shown(tuple(size), 80)}")
    return tuple(size)


def _dtype(item: Any, path: Path, name: str) -> torch.dtype:
    import torch

    props = getattr(item, "properties", None)
    dtype = getattr(props, "dtype", None)
    if dtype is None:
        state = getattr(props, "state", None)
        dtype = state[0] if isinstance(state, tuple) and state else None
    if not isinstance(dtype, torch.dtype):
        raise SnapshotError(f"{path}: tensor {shown(name, 120)} has no dtype")
    return dtype


def _numel(size: tuple[int, ...]) -> int:
    numel = 1
    for d in size:
        numel *= d
    return numel


@dataclass(frozen=True)
class CheckpointSummary:
    tensors: int
    bytes: int
    shapes: dict[str, tuple[tuple[int, ...], str]]


def summarize_checkpoint(checkpoint_dir: str | Path) -> CheckpointSummary:
    """Tensor count, total bytes and {name: (shape, dtype)} from the checkpoint's own metadata.

    The sizes are as declared: `check_checkpoint_storage` bounds them by the data files on disk.
    """
    metadata = read_checkpoint_metadata(checkpoint_dir, records=True)
    path = Path(checkpoint_dir) / DCP_METADATA
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    total = 0
    for name, item in metadata.state_dict_metadata.items():
        if type(item).__name__ == "TensorStorageMetadata":
            size = _tensor_shape(item.size, path, name)
            dtype = _dtype(item, path, name)
            total += _numel(size) * dtype.itemsize
            shapes[name] = (size, str(dtype).removeprefix("torch."))
    return CheckpointSummary(tensors=len(shapes), bytes=total, shapes=shapes)


def check_checkpoint_storage(checkpoint_dir: str | Path) -> list[str]:
    """What the checkpoint's `.metadata` declares beyond its data files: empty when every size is backed.

    Each storage entry must lie inside its `.distcp` file, and each tensor entry there must be a torch archive
    whose records are stored, not deflated (`checkpoint_entries`); each bytes entry (a Megatron `_extra_state`)
    must load weights-only and hold only what the allow-list admits (`checkpoint_bytes`, tensors on the meta
    device); each tensor's chunks must tile it exactly
    (`checkpoint_tiling`), each with its storage entry, and its bytes must fit in the storage entries recorded
    for it. Missing data files are left to the caller (they are reported as missing); nothing is allocated or
    read but file sizes and the entries' zip directories.
    """
    directory = Path(checkpoint_dir)
    metadata = read_checkpoint_metadata(directory, records=True)
    # inspect, the weights check and the load each ask: the same files (same inodes, sizes, times) give the same
    # answer, so the entries' directories are read once
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    identity = tuple((name, *_identity(directory / name)) for name in [DCP_METADATA, *files])
    return list(_storage_problems(str(directory), identity))


def _identity(path: Path) -> tuple[int, ...]:
    """The file as it is now: the name itself and, for a symlink, what it leads to."""
    found: tuple[int, ...] = ()
    for follow in (False, True):
        try:
            stat = path.stat(follow_symlinks=follow)
        except OSError:
            return found
        found += (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    return found


@functools.lru_cache(maxsize=8)
def _storage_problems(name: str, _identity: tuple[Any, ...]) -> tuple[str, ...]:
    with _no_collection():
        return _storage_problems_of(Path(name))


def _storage_problems_of(directory: Path) -> tuple[str, ...]:
    path = directory / DCP_METADATA
    metadata = read_checkpoint_metadata(directory, records=True)
    problems: list[str] = []
    file_sizes: dict[str, int | None] = {}
    stored: dict[str, int] = {}
    entries: set[tuple[str, tuple[int, ...]]] = set()
    readable: list[tuple[str, Any]] = []  # tensor entries inside their files, for the archive check
    objects: list[tuple[str, Any]] = []  # bytes entries inside their files, for the weights-only check
    tensors = {name for name, item in metadata.state_dict_metadata.items() if _is_tensor(item)}
    for index, info in metadata.storage_data.items():
        name = info.relative_path
        if name not in file_sizes:
            file_sizes[name] = _data_file_size(directory / name, problems)
        have = file_sizes[name]
        if have is not None and info.offset + info.length > have:
            problems.append(
                f"{path}: {shown(index.fqn, 120)} is declared at bytes {info.offset}-{info.offset + info.length} "
                f"of {directory / name}, which holds {have}"
            )
        elif have is not None:
            (readable if index.fqn in tensors else objects).append((index.fqn, info))
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
        entries.add((index.fqn, _offsets(getattr(index, "offset", None))))
    for name, item in metadata.state_dict_metadata.items():
        if not _is_tensor(item):
            continue
        problem = _tensor_problem(path, name, item, stored.get(name, 0), entries)
        if problem:
            problems.append(problem)
        if len(problems) >= 20:
            problems.append(f"{path}: more size problems not listed")
            return tuple(problems)
    problems += entry_problems(directory, readable, limit=20 - len(problems))
    if len(problems) < 20:
        problems += bytes_entry_problems(directory, objects, limit=20 - len(problems))
    return tuple(problems)


def _data_file_size(path: Path, problems: list[str]) -> int | None:
    """The size of a `.distcp` file, None when it is missing; a symlink out of the checkpoint dir is a problem (DCP
    would read through it), one between the checkpoint's own files is followed."""
    try:
        target = inside_its_tree(path)
    except SnapshotError as exc:
        problems.append(str(exc))
        return None
    return target.stat().st_size if target.is_file() else None


def _is_tensor(item: Any) -> bool:
    return type(item).__name__ == "TensorStorageMetadata"


def _offsets(value: Any) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else ()


def _tensor_problem(
    path: Path, name: str, item: Any, stored: int, entries: set[tuple[str, tuple[int, ...]]]
) -> str | None:
    """Why one tensor's chunks or declared bytes are refused, or None."""
    shape = tuple(item.size)
    chunks = [(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in item.chunks]
    tiling = tiling_problem(shape, chunks)
    if tiling:
        return f"{path}: tensor {shown(name, 120)} of shape {shape} {tiling}; refused (it would load partly)"
    unstored = next((offsets for offsets, _ in chunks if (name, offsets) not in entries), None)
    if unstored is not None:
        return f"{path}: tensor {shown(name, 120)} has a chunk at offsets {unstored} with no storage entry"
    itemsize = _dtype(item, path, name).itemsize
    declared = _numel(shape) * itemsize  # the chunks tile the tensor: their bytes are the tensor's
    if declared > stored:
        return (
            f"{path}: tensor {shown(name, 120)} declares shape {shape} ({human_bytes(declared)}) but "
            f"its data files hold {human_bytes(stored)} for it"
        )
    return None


def safe_reader(checkpoint_dir: Path) -> Any:
    """DCP's file-system reader with `.metadata` read by the allowlisted unpickler above."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_checkpoint_metadata(checkpoint_dir)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(checkpoint_dir))


def load_model_state(checkpoint_dir: str | Path, state_dict: dict[str, torch.Tensor], prefix: str = "model.") -> None:
    """Fill `state_dict` in place from the checkpoint (keys saved under `prefix`), no process group needed."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    directory = Path(checkpoint_dir)
    oversized = check_checkpoint_storage(directory)
    if oversized:
        raise SnapshotError(oversized[0])
    available = read_checkpoint_metadata(directory, records=True).state_dict_metadata
    missing = [name for name in state_dict if f"{prefix}{name}" not in available]
    if missing:
        listed = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise SnapshotError(f"{directory}: checkpoint lacks {len(missing)} model tensors ({listed})")
    # DCP reads an entry declared as bytes with `torch.load(weights_only=False)`: a model tensor saved as bytes
    # would run whatever its pickle says, so it is refused here, before DCP sees the name
    not_tensors = [name for name in state_dict if not _is_tensor(available[f"{prefix}{name}"])]
    if not_tensors:
        raise SnapshotError(
            f"{directory / DCP_METADATA}: {shown(prefix + not_tensors[0], 120)} is saved as bytes, not a tensor; "
            "refused (DCP would unpickle it without restrictions)"
        )
    wrapped = {f"{prefix}{name}": tensor for name, tensor in state_dict.items()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(wrapped, storage_reader=safe_reader(directory), no_dist=True)
    except SnapshotError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP raises CheckpointException, a BaseException
        metadata = read_checkpoint_metadata(directory, records=True)
        read = [(index.fqn, info) for index, info in metadata.storage_data.items() if index.fqn in wrapped]
        culprit = unreadable_entry(directory, read)  # DCP's error does not say which entry it could not read
        if culprit:
            raise SnapshotError(culprit) from None
        text = str(exc)
        if isinstance(exc, CheckpointException) and "WeightsUnpickler error:" not in text:
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            text = lines[-1] if lines else type(exc).__name__  # the underlying error comes last
        reason = shown(torch_reason(RuntimeError(text)), 300, quote=False)
        raise SnapshotError(f"{directory}: cannot load checkpoint tensors ({reason})") from None
    for name, tensor in wrapped.items():
        state_dict[name.removeprefix(prefix)] = tensor
