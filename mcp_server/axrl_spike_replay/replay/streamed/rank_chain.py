"""A piece's gradient summed over processes that each stream a contiguous block of the saved ranks, in the whole
replay's order: a chain, process 0 to the last.

The whole replay adds every pass's gradient into the step's sum in the order of the saved ranks and their
micro-batches. Split over processes (process p streams saved ranks `blocks[p]`, in order), process p > 0 starts each
piece's sum from the running sum of processes 0 .. p-1 (received from p-1) before adding its own first pass, and
hands its sum on to p+1 when the piece is done; the last process holds the step's sum, added in exactly the whole
replay's order, and measures it. The compute runs side by side: each process waits only for the previous one's sum
of the same piece, so the processes run a layer or so apart, a pipeline.

What every process must decide alike comes from the last: a grad norm the clean gradient's search compares with the
spike bar (`share`, one float64 broadcast). Where every process needs the summed piece itself (each process's
samples dotted with it, an attribution), the last broadcasts it once measured (`everywhere`: `spread`), and the
processes run in step, piece by piece. A tied embedding's head half, summed to the last with the head, goes back to
the first (`hand_back`, sent without waiting) to start the embedding piece's sum, so the embedding's passes add on
to the head's in the one process's order.

A message is a header (how many tensors, then for each: its index in the piece, dtype code, dims, shape and strides:
int64) and the tensors present (None entries are not sent), on the gradients' device (gloo on CPU, NCCL on CUDA).
A received sum takes the sender's strides: a gradient autograd made transposed stays so, and its norm, a float32
reduction in memory order, is the one process's bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


class RankChain:
    """Process `process` of `processes` in the chain (a process group of that size is initialised); `everywhere`:
    every process gets each piece's reduced sum (`spread`)."""

    def __init__(
        self, process: int, processes: int, device: str | torch.device = "cpu", everywhere: bool = False
    ) -> None:
        self.process, self.processes, self.device = process, processes, torch.device(device)
        self.everywhere = everywhere
        self._pending: list[tuple[object, torch.Tensor]] = []  # sends not waited for, and their buffers

    @property
    def first(self) -> bool:
        return self.process == 0

    @property
    def last(self) -> bool:
        return self.process == self.processes - 1

    def receive(self, count: int) -> list[torch.Tensor | None]:
        """The running sum of a piece of `count` tensors from the previous process (all None on the first)."""
        if self.first:
            return [None] * count
        return self._receive(count, self.process - 1)

    def send(self, total: Sequence[torch.Tensor | None]) -> None:
        """Hand a piece's running sum on to the next process (nothing on the last)."""
        if self.last:
            return
        self._send(total, self.process + 1)

    def share(self, value: float) -> float:
        """The last process's `value` in every process (a collective: every process calls it at the same point)."""
        import torch.distributed as dist

        held = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.broadcast(held, src=self.processes - 1)
        return float(held.item())

    def spread(self, reduced: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The last process's reduced piece in every process (a collective; `reduced` is read on the last only)."""
        import torch.distributed as dist

        last = self.processes - 1
        if self.last:
            header = _header(reduced, self.device)
            dist.broadcast(torch.tensor([header.numel()], dtype=torch.int64, device=self.device), src=last)
            dist.broadcast(header, src=last)
            for tensor in reduced:
                if tensor is not None:
                    dist.broadcast(tensor.contiguous(), src=last)
            return list(reduced)
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=last)
        header = torch.zeros(int(size.item()), dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=last)
        out: list[torch.Tensor | None] = [None] * len(reduced)
        for index, tensor in _empties(header.tolist(), len(reduced), self.device):
            dist.broadcast(tensor, src=last)
            out[index] = _laid_out(tensor, header.tolist(), index)
        return out

    def hand_back(self, total: Sequence[torch.Tensor | None]) -> None:
        """On the last process: send `total` (a tied embedding's head half, summed) to the first, without waiting
        (the first takes it with `take_back` once its layers are done; `settle` waits for the send)."""
        import torch.distributed as dist

        if not self.last or self.first:
            return
        header = _header(total, self.device)
        for tensor in [torch.tensor([header.numel()], dtype=torch.int64, device=self.device), header]:
            self._pending.append((dist.isend(tensor, dst=0), tensor))
        for tensor in total:
            if tensor is not None:
                buffer = tensor.contiguous()
                self._pending.append((dist.isend(buffer, dst=0), buffer))

    def take_back(self, count: int) -> list[torch.Tensor | None]:
        """On the first process: what the last handed back (`hand_back`)."""
        if not self.first or self.last:
            return [None] * count
        return self._receive(count, self.processes - 1)

    def settle(self) -> None:
        """Wait for the sends not waited for yet (at a backward's end: the first has taken them by then)."""
        for work, _ in self._pending:
            work.wait()  # type: ignore[attr-defined]
        self._pending = []

    def _receive(self, count: int, src: int) -> list[torch.Tensor | None]:
        import torch.distributed as dist

        out: list[torch.Tensor | None] = [None] * count
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.recv(size, src=src)
        header = torch.zeros(int(size.item()), dtype=torch.int64, device=self.device)
        dist.recv(header, src=src)
        values = header.tolist()
        for index, tensor in _empties(values, count, self.device):
            dist.recv(tensor, src=src)
            out[index] = _laid_out(tensor, values, index)
        return out

    def _send(self, total: Sequence[torch.Tensor | None], dst: int) -> None:
        import torch.distributed as dist

        header = _header(total, self.device)
        dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=self.device), dst=dst)
        dist.send(header, dst=dst)
        for tensor in total:
            if tensor is not None:
                dist.send(tensor.contiguous(), dst=dst)


def _header(total: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """How many tensors, then for each present one: its index, dtype code, dims, shape and strides (int64)."""
    present = [(i, t) for i, t in enumerate(total) if t is not None]
    values = [len(present)]
    for index, tensor in present:
        values += [index, _DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape, *tensor.stride()]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _entries(values: list[int]) -> list[tuple[int, int, list[int], list[int]]]:
    """(index, dtype code, shape, strides) of each tensor a header names."""
    entries, at = [], 1
    for _ in range(values[0]):
        index, code, dims = values[at], values[at + 1], values[at + 2]
        entries.append((index, code, values[at + 3 : at + 3 + dims], values[at + 3 + dims : at + 3 + 2 * dims]))
        at += 3 + 2 * dims
    return entries


def _empties(values: list[int], count: int, device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """A contiguous tensor to receive each one a header names, by its index in the piece."""
    out = []
    for index, code, shape, _ in _entries(values):
        if not 0 <= index < count:
            raise ValueError(f"chain message names tensor {index} of a piece of {count}")
        out.append((index, torch.empty(shape, dtype=_DTYPES[code], device=device)))
    return out


def _laid_out(tensor: torch.Tensor, values: list[int], index: int) -> torch.Tensor:
    """`tensor` in the sender's strides: a norm reduces in memory order."""
    stride = next(s for i, _, _, s in _entries(values) if i == index)
    if tensor.stride() == tuple(stride):
        return tensor
    return torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, device=tensor.device).copy_(tensor)
