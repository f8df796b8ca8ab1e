"""Load `.pt` files from shared storage safely: always `weights_only=True`, errors that name the file."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import SnapshotError, UnsafeFileError


def load_pt(path: str | Path, *, meta: bool = False, mmap: bool = True) -> Any:
    """Load a `.pt` file with `weights_only=True`.

    `meta=True` gives meta tensors (shapes and dtypes, no data read); otherwise the file is
    memory-mapped so only the tensors that are touched are read. A file whose pickle asks for
    anything beyond tensors and plain containers raises UnsafeFileError; nothing in it runs.
    """
    import torch

    file = Path(path)
    if not file.is_file():
        raise SnapshotError(f"{file}: file not found")
    kwargs: dict[str, Any] = {"weights_only": True}
    if meta:
        kwargs["map_location"] = "meta"
    else:
        kwargs["map_location"] = "cpu"
    use_mmap = mmap and zipfile.is_zipfile(file)
    try:
        return torch.load(file, mmap=use_mmap, **kwargs)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "weights_only" in text.lower() or "unsupported global" in text.lower():
            first = text.strip().splitlines()[0] if text.strip() else "unsupported content"
            detail = _unsupported_global(text) or first
            raise UnsafeFileError(
                f"{file}: refused to load: it holds a pickled object beyond plain tensors and "
                f"containers ({detail}); nothing in it was run"
            ) from None
        raise SnapshotError(f"{file}: not a readable torch file ({text.strip() or 'unpickling failed'})") from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SnapshotError(f"{file}: truncated or corrupt torch file ({message})") from None


def _unsupported_global(text: str) -> str | None:
    for line in text.splitlines():
        if "GLOBAL" in line or "Unsupported global" in line:
            return line.strip()
    return None
