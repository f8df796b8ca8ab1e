"""The step's global loss counts: what a rank normalises by under `normalization: global`.

verl normalises each rank's loss by the counts of the whole data-parallel step (`batch_num_tokens`,
`global_batch_size`) times `dp_size`, so the DP mean of the gradients is the gradient of the global
mean. The trainer records these counts in every rank's grad info; a replay hands them to every rank
it computes, however many processes it runs on, so a reduced replay normalises as the full one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.trainer_formats.verl_batch import (
    VERL_COUNT_KEYS as COUNT_KEYS,  # verl's names for the counts
)

GRAD_INFO_KEY = "global_batch_info"  # the key in grad_info_rank<r>.pt


@dataclass(frozen=True)
class GlobalCounts:
    """The step's counts over all data-parallel ranks, as verl passes them to `agg_loss`."""

    dp_size: int
    batch_num_tokens: float  # loss tokens of the step (after rejection sampling, as the loss sees them)
    global_batch_size: float  # sequences of the step

    def to_doc(self) -> dict[str, Any]:
        return {
            "dp_size": self.dp_size,
            "batch_num_tokens": self.batch_num_tokens,
            "global_batch_size": self.global_batch_size,
        }

    @classmethod
    def from_doc(cls, doc: Any, where: str, entry: str = GRAD_INFO_KEY) -> GlobalCounts:
        """Counts from an untrusted grad-info entry (or, `entry` naming it, another mapping of them); SnapshotError
        naming `where` and the entry when malformed."""
        if not isinstance(doc, dict):
            raise SnapshotError(f"{where}: {entry} must be a mapping, got {type(doc).__name__}")
        values = {}
        for key in COUNT_KEYS:
            value = doc.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SnapshotError(f"{where}: {entry}.{key} must be a finite number, got {shown(value, 60)}")
            if value < 0 or (key == "dp_size" and (value < 1 or value != int(value))):
                raise SnapshotError(f"{where}: {entry}.{key} is out of range ({shown(value, 60)})")
            values[key] = value
        return cls(int(values["dp_size"]), float(values["batch_num_tokens"]), float(values["global_batch_size"]))


def all_reduce_counts(tokens: float, sequences: float, dp_size: int) -> GlobalCounts:
    """This process's counts summed over the process group (itself alone when not distributed)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([tokens, sequences], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return GlobalCounts(dp_size=dp_size, batch_num_tokens=float(tensor[0]), global_batch_size=float(tensor[1]))
