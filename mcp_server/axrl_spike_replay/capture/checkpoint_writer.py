"""A snapshot's model weights as a DCP checkpoint, the format Megatron's torch_dist backend writes, recording no path
of the writer's.

DCP's file-system writer records the path it writes to as the checkpoint id in `.metadata`. A snapshot is written
to a hidden staging directory and renamed into place, then preserved (hardlinked) or copied to other machines, so
that id would be the writer's temporary absolute path: wrong everywhere the snapshot is read, and a path of the
writer's machine carried into every copy. The id recorded here is the checkpoint's own directory name.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def save_model_checkpoint(
    state: dict[str, torch.Tensor], directory: str | Path, *, name: str | None = None, distributed: bool = False
) -> None:
    """Save `state` (tensors, or DTensors under torch.distributed) as a DCP checkpoint in `directory`, recording
    `name` (default: the directory's own name) as its checkpoint id. `distributed`: every rank calls this."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save(state, storage_writer=_writer(Path(directory), name or Path(directory).name), no_dist=not distributed)


def _writer(directory: Path, name: str) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.metadata import StorageMeta

    class NamedWriter(FileSystemWriter):
        def storage_meta(self) -> StorageMeta | None:
            return StorageMeta(checkpoint_id=name, save_id=self.save_id)

    return NamedWriter(str(directory))
