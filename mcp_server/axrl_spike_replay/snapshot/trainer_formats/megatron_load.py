"""Megatron-core's own `dist_checkpointing.load` of a snapshot's checkpoint, held to the snapshot rules (needs
megatron-core; imported only where it runs).

Left to itself, megatron-core 0.16.1 reads a `torch_dist` checkpoint through DCP: `.metadata` with plain
`pickle.load` (its `CachedMetadataFileSystemReader`), every ShardedObject (each layer's `_extra_state`) with DCP's
`DefaultLoadPlanner.load_bytes`, that is `torch.load(weights_only=False)`, and `common.pt` with torch's default
`torch.load`. Each of those would run a pickle from shared storage. `load_megatron_state` hands megatron-core its
own strategies in their place, changing only what reads bytes:
- the sharded strategy is megatron-core's `TorchDistLoadShardedStrategy` with DCP's reader replaced by
  `checkpoint.safe_reader` (`.metadata` through the allow-listed unpickler) and its planner by one whose
  `load_bytes` is `checkpoint_bytes.bytes_entry_value` (weights-only, the allow-list of what an extra state holds);
- the common strategy reads `common.pt` with `megatron_checkpoint.read_common_state` (weights-only).
Nothing is patched: torch and megatron-core are the same for every other caller in the process.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError, SnapshotError
from axrl_spike_replay.snapshot.dcp.checkpoint import safe_reader
from axrl_spike_replay.snapshot.dcp.checkpoint_bytes import bytes_entry_value, entry_label
from axrl_spike_replay.snapshot.trainer_formats.megatron_checkpoint import read_common_state

EXTRA_STATE = "_extra_state"


def load_megatron_state(sharded_state_dict: dict[str, Any], directory: str | Path) -> dict[str, Any]:
    """`dist_checkpointing.load(sharded_state_dict, directory)` with every pickle in the checkpoint read weights-only
    (see the module doc); a refused entry raises its SnapshotError (UnsafeFileError), named by file and entry, on
    the rank that read it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(directory)
    try:
        # the strict modes that list the checkpoint's keys read `.metadata` through megatron's own reader: not used
        loaded: Any = dist_checkpointing.load(
            sharded_state_dict,
            str(path),
            sharded_strategy=_sharded_strategy(path),
            common_strategy=_common_strategy(path),
            strict=StrictHandling.ASSUME_OK_UNEXPECTED,
        )
    except CheckpointException as exc:  # DCP wraps what a rank raised while reading, ours included
        ours = [error for error, _ in exc.failures.values() if isinstance(error, AxrlError)]
        if ours:
            raise ours[0] from None
        raise
    return loaded  # ASSUME_OK_UNEXPECTED: the state dict alone, no lists of mismatched keys


def load_megatron_model(model: Any, directory: str | Path) -> None:
    """Fill a megatron-core model (its `sharded_state_dict()` for this rank's layout) from the checkpoint, through
    `load_megatron_state`. Extra states reach no module: the local spec's layers ignore theirs, and a Transformer
    Engine layer unpickles its own (`set_extra_state`), which would run what a checked tensor's bytes say."""
    state = load_megatron_state(model.sharded_state_dict(), directory)
    model.load_state_dict({k: v for k, v in state.items() if not k.endswith(EXTRA_STATE)}, strict=False)


def _sharded_strategy(directory: Path) -> Any:
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint.state_dict_loader import load_state_dict

    planner = _checked_planner(directory)

    class CheckedTorchDistLoad(mcore_torch.TorchDistLoadShardedStrategy):
        """megatron-core 0.16.1's `TorchDistLoadShardedStrategy.load`, with the safe reader and checked planner."""

        def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
            shaped = [
                t
                for t in mcore_torch.nested_values(sharded_state_dict)
                if isinstance(t, mcore_torch.ShardedTensor) and not t.allow_shape_mismatch
            ]
            mismatch = {
                t.key: t
                for t in mcore_torch.nested_values(sharded_state_dict)
                if isinstance(t, mcore_torch.ShardedTensor) and t.allow_shape_mismatch
            }
            original = sharded_state_dict
            flat, flat_mapping, rename_mapping = mcore_torch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict
            )
            pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(flat, True)
            reader = safe_reader(directory)
            load_state_dict(  # what megatron-core calls (DCP's older entry point, same reader and planner hooks)
                pyt_state_dict,
                reader,
                planner=planner(
                    shapes_validation_sharded_tensors=shaped, allow_shape_mismatch_sharded_tensors=mismatch
                ),
            )
            self.cached_global_metadata = reader.read_metadata()
            state: Any = {k: mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
            state = mcore_torch._replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
            mcore_torch._restore_dict_types(state, original)
            return state

    return CheckedTorchDistLoad()


def _checked_planner(directory: Path) -> Any:
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element  # pyright: ignore[reportPrivateImportUsage]

    class CheckedLoadPlanner(MCoreLoadPlanner):
        """megatron-core's load planner whose bytes entries are read weights-only, within the allow-list."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            info = self.metadata.storage_data[read_item.storage_index] if self.metadata is not None else None
            label = (
                entry_label(directory / info.relative_path, fqn, info.offset, info.length)
                if info is not None
                else f"{directory}: bytes entry {fqn}"
            )
            loaded = bytes_entry_value(value.getvalue(), label)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return CheckedLoadPlanner


def _common_strategy(directory: Path) -> Any:
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class CheckedCommonLoad(TorchCommonLoadStrategy):
        """`common.pt` weights-only; object shards in their own `.pt` files (other backends) are not read."""

        def load_common(self, checkpoint_dir: Any) -> Any:
            return read_common_state(directory)

        def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: Any) -> Any:
            raise SnapshotError(f"{directory}: object shards stored beside the checkpoint are not read")

    return CheckedCommonLoad()
