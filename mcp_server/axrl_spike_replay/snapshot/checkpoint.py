"""The snapshot's weights: torch.distributed.checkpoint (DCP), read without trusting its pickles.

DCP's own reader unpickles `.metadata` with plain `pickle.load`; snapshots come from shared
storage, so the metadata is read here with an unpickler that admits only DCP's metadata classes.
Tensor data (`*.distcp`) is read by DCP with `weights_only=True`.
"""

from __future__ import annotations

import io
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.errors import SnapshotError, UnsafeFileError
from axrl_spike_replay.snapshot.layout import DCP_METADATA

if TYPE_CHECKING:
    import torch

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


_RECORDS = {name: type(name, (_Record,), {}) for name in (*_DCP_METADATA_CLASSES, "_StorageInfo")}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, records: bool = False) -> None:
        super().__init__(file)
        self.records = records

    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = (
            (module == "torch.distributed.checkpoint.metadata" and name in _DCP_METADATA_CLASSES)
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
        return super().find_class(module, name)


def read_checkpoint_metadata(checkpoint_dir: str | Path, *, records: bool = False) -> Any:
    """DCP `Metadata` of a checkpoint directory, unpickled with an allowlist.

    `records=True` gives light stand-ins of DCP's classes (same attributes) without importing DCP.
    """
    path = Path(checkpoint_dir) / DCP_METADATA
    if not path.is_file():
        raise SnapshotError(f"{path}: checkpoint metadata not found (no distributed checkpoint here)")
    try:
        return _MetadataUnpickler(io.BytesIO(path.read_bytes()), records).load()
    except UnsafeFileError as exc:
        raise UnsafeFileError(f"{path}: refused to load: {exc}; nothing in it was run") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise SnapshotError(f"{path}: truncated or corrupt checkpoint metadata ({exc})") from None


@dataclass(frozen=True)
class CheckpointSummary:
    tensors: int
    bytes: int
    shapes: dict[str, tuple[tuple[int, ...], str]]


def summarize_checkpoint(checkpoint_dir: str | Path) -> CheckpointSummary:
    """Tensor count, total bytes and {name: (shape, dtype)} from the checkpoint's own metadata."""
    metadata = read_checkpoint_metadata(checkpoint_dir, records=True)
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    total = 0
    for name, item in metadata.state_dict_metadata.items():
        if type(item).__name__ == "TensorStorageMetadata":
            size = tuple(int(d) for d in item.size)
            props = item.properties
            dtype = props.dtype if hasattr(props, "dtype") else props.state[0]
            numel = 1
            for d in size:
                numel *= d
            total += numel * dtype.itemsize
            shapes[name] = (size, str(dtype).removeprefix("torch."))
    return CheckpointSummary(tensors=len(shapes), bytes=total, shapes=shapes)


def _safe_reader(checkpoint_dir: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = Path(checkpoint_dir)
    available = set(read_checkpoint_metadata(directory).state_dict_metadata)
    missing = [name for name in state_dict if f"{prefix}{name}" not in available]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise SnapshotError(f"{directory}: checkpoint lacks {len(missing)} model tensors ({shown})")
    wrapped = {f"{prefix}{name}": tensor for name, tensor in state_dict.items()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(wrapped, storage_reader=_safe_reader(directory), no_dist=True)
    except SnapshotError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP raises CheckpointException, a BaseException
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        reason = lines[-1] if isinstance(exc, CheckpointException) else lines[0]  # the underlying error comes last
        raise SnapshotError(f"{directory}: cannot load checkpoint tensors ({reason})") from None
    for name, tensor in wrapped.items():
        state_dict[name.removeprefix(prefix)] = tensor
