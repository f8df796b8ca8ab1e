"""A piece's gradient summed over processes that each stream a contiguous block of the saved ranks, in the whole
replay's order: a chain, process 0 to the last.

The whole replay adds every pass's gradient into the step's sum in the order of the saved ranks and their
micro-batches. Split over processes (process p streams saved ranks `blocks[p]`, in order), process p > 0 starts each
piece's sum from the running sum of processes 0 .. p-1 (received from p-1) before adding its own first pass, and
hands its sum on to p+1 when the piece is done; the last process holds the step's sum, added in exactly the whole
replay's order, and measures it. The compute runs side by side: each process waits only for the previous one's sum
of the same piece, so the processes run a layer or so apart, a pipeline.

A message is a header (how many tensors, then for each: its index in the piece, dtype code, dims, shape and strides:
int64) and the tensors present (None entries are not sent), on the gradients' device (gloo on CPU, NCCL on CUDA).
A received sum takes the sender's strides: a gradient autograd made transposed stays so, and its norm, a float32
reduction in memory order, is the one process's bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from axrl_spike_replay.errors import ConfigError

if TYPE_CHECKING:
    from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def contiguous_blocks(ranks: Sequence[int], processes: int) -> list[tuple[int, ...]]:
    """`ranks` in order, split into `processes` contiguous blocks of near-equal size (the earlier ones larger)."""
    ordered = sorted(ranks)
    base, extra = divmod(len(ordered), processes)
    blocks, start = [], 0
    for p in range(processes):
        size = base + (1 if p < extra else 0)
        blocks.append(tuple(ordered[start : start + size]))
        start += size
    return blocks


def check_split(configs: Sequence[AppliedConfig], processes: int) -> None:
    """Refuse, naming `nproc`, a split over several processes of a job that asks for the clean gradient (a mitigation
    beside an unmitigated baseline): its search and cosines need the summed gradient in every process, and only the
    last process of a chain holds it."""
    if processes <= 1 or not configs or configs[0].mitigations:
        return
    fixes = [cfg for cfg in configs[1:] if cfg.mitigations and not cfg.is_hypothesis]
    if fixes:
        raise ConfigError(
            f"`nproc`: a streamed replay over {processes} processes does not compute the clean gradient and cosine "
            f"to clean that mitigation {dict(fixes[0].mitigations)} asks for (only the last process holds the "
            "summed gradient); replay mitigations streamed with `nproc` 1",
            "nproc",
        )


class RankChain:
    """Process `process` of `processes` in the chain (a process group of that size is initialised)."""

    def __init__(self, process: int, processes: int, device: str | torch.device = "cpu") -> None:
        self.process, self.processes, self.device = process, processes, torch.device(device)

    @property
    def first(self) -> bool:
        return self.process == 0

    @property
    def last(self) -> bool:
        return self.process == self.processes - 1

    def receive(self, count: int) -> list[torch.Tensor | None]:
        """The running sum of a piece of `count` tensors from the previous process (all None on the first)."""
        import torch.distributed as dist

        out: list[torch.Tensor | None] = [None] * count
        if self.first:
            return out
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.recv(size, src=self.process - 1)
        header = torch.zeros(int(size.item()), dtype=torch.int64, device=self.device)
        dist.recv(header, src=self.process - 1)
        values, at = header.tolist(), 1
        for _ in range(values[0]):
            index, code, dims = values[at], values[at + 1], values[at + 2]
            shape, stride = values[at + 3 : at + 3 + dims], values[at + 3 + dims : at + 3 + 2 * dims]
            at += 3 + 2 * dims
            if not 0 <= index < count:
                raise ValueError(f"chain message names tensor {index} of a piece of {count}")
            tensor = torch.empty(shape, dtype=_DTYPES[code], device=self.device)
            dist.recv(tensor, src=self.process - 1)
            if tensor.stride() != tuple(stride):  # the sender's layout: a norm reduces in memory order
                tensor = torch.empty_strided(shape, stride, dtype=tensor.dtype, device=self.device).copy_(tensor)
            out[index] = tensor
        return out

    def send(self, total: Sequence[torch.Tensor | None]) -> None:
        """Hand a piece's running sum on to the next process (nothing on the last)."""
        import torch.distributed as dist

        if self.last:
            return
        present = [(i, t) for i, t in enumerate(total) if t is not None]
        values = [len(present)]
        for index, tensor in present:
            values += [index, _DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape, *tensor.stride()]
        header = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=self.device), dst=self.process + 1)
        dist.send(header, dst=self.process + 1)
        for _, tensor in present:
            dist.send(tensor.contiguous(), dst=self.process + 1)
