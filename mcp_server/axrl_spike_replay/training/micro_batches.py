"""A rank's step as the trainer split it: its micro-batches, and how their losses add up to the rank's.

A trainer does not backpropagate a rank's whole batch at once: it splits it into micro-batches, computes each
one's loss, scales it and accumulates the gradients. Where the loss is normalised per micro-batch (each one's own
token or sequence count), the rank's gradient depends on the split: the mean of per-micro-batch token means is
not the token mean of the whole batch when the micro-batches hold different token counts.

The split (the run config's `micro_batches:` section, `split`):
- `recorded`: the batch file's own `{"micro_batches": [...]}` (`snapshot/fields.py` keeps their rows and widths
  in `MICRO_BATCH_ROWS` / `MICRO_BATCH_WIDTHS`); one micro-batch when the file has none (our own capture).
- `size`: consecutive chunks of `size` sequences (verl's `ppo_micro_batch_size_per_gpu`, Megatron's
  `micro_batch_size`); the batch must divide evenly, as verl asserts.
- `token_budget`: verl's dynamic batch size (`use_dynamic_bsz`, `ppo_max_token_len_per_gpu`): its
  `rearrange_micro_batches` rule, ported (`verl.utils.seqlen_balancing` 0.9.1): at least
  ceil(tokens / budget) micro-batches (or `count`, the number verl agreed over the DP ranks), sequences
  partitioned by Karmarkar-Karp over verl's attention workload, more micro-batches until every one fits
  the budget, then ordered by workload with the small ones at both ends (`balance`).
- `whole`: one micro-batch.

The scale (`scale`) each micro-batch's loss is multiplied by before its backward:
- `sum` (1): verl 0.9.1's engines (FSDP: each micro-batch's `ppo_loss` is already normalised by the step's
  global counts and backpropagated as it is; Megatron: multiplied by the micro-batch count, which Megatron's
  schedule divides back out), and Megatron-core with `calculate_per_token_loss` (token sums, divided by the
  step's token count: `normalization: global`, `token-mean`). The default under conventions verl and trl (TRL's
  loss of a micro-batch is already divided by its accumulation steps), and under `normalization: global`.
- `mean` (1 / number of micro-batches): Megatron-core's schedule dividing each micro-batch's own loss by
  `num_microbatches`. The default under convention axrl with `normalization: per_rank`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from axrl_spike_replay.display import shown, shown_names
from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.snapshot.fields import MICRO_BATCH_ROWS, MICRO_BATCH_WIDTHS

SECTION = "micro_batches"  # the run config's section
SPLITS = ("recorded", "size", "token_budget", "whole")
SCALES = ("sum", "mean")
SPLIT_FIELDS = (MICRO_BATCH_ROWS, MICRO_BATCH_WIDTHS)


@dataclass(frozen=True)
class MicroBatchSpec:
    """How the trainer split a rank's batch and scaled each micro-batch's loss (see the module docstring)."""

    split: str = "recorded"
    size: int | None = None  # split size: sequences per micro-batch
    max_token_len: int | None = None  # split token_budget: tokens per micro-batch at most
    count: int | None = None  # split token_budget: micro-batches at least (verl's count agreed over DP ranks)
    balance: bool = True  # split token_budget: verl's use_dynamic_bsz_balance ordering
    scale: str | None = None  # None: the trainer's (`scale_for`)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"{SECTION}.split must be one of {SPLITS}, got {shown(self.split, 60)}")
        if self.scale is not None and self.scale not in SCALES:
            raise ConfigError(f"{SECTION}.scale must be one of {SCALES}, got {shown(self.scale, 60)}")
        for name in ("size", "max_token_len", "count"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{SECTION}.{name} must be an integer >= 1, got {shown(value, 60)}")
        if not isinstance(self.balance, bool):
            raise ConfigError(f"{SECTION}.balance must be true or false, got {shown(self.balance, 60)}")
        needs = {"size": "size", "token_budget": "max_token_len"}.get(self.split)
        if needs is not None and getattr(self, needs) is None:
            raise ConfigError(f"{SECTION}.split {self.split} needs {SECTION}.{needs}")

    def scale_for(self, convention: str, normalization: str) -> str:
        """The scale in force: the recorded one, else the trainer's: `sum` under convention verl (its engines never
        rescale a micro-batch's `ppo_loss`), under convention trl (its loss of a micro-batch already holds TRL's
        division by the accumulation steps, `training.trl_convention`) or normalization global, `mean`
        (Megatron-core's schedule) otherwise."""
        if self.scale is not None:
            return self.scale
        return "sum" if convention in ("verl", "trl") or normalization == "global" else "mean"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, doc: Any) -> MicroBatchSpec:
        """The spec of a run config's `micro_batches:` section (None or absent: the recorded split)."""
        if doc is None:
            return cls()
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{SECTION} must be a mapping, got {type(doc).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in doc if k not in known)
        if unknown:
            raise ConfigError(f"{SECTION}: unknown keys {shown_names(unknown)} (known: {sorted(known)})")
        return cls(**{str(k): v for k, v in doc.items()})


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a rank's batch: its rows (in the trainer's order), token width and loss scale."""

    rows: tuple[int, ...]
    width: int
    scale: float


def sequence_lengths(batch: Mapping[str, Any]) -> list[int]:
    """Each sequence's token count as verl's balancing reads it: the attention mask's sum, else the full width."""
    tokens = batch["tokens"]
    attention = batch.get("attention_mask")
    if isinstance(attention, torch.Tensor) and attention.shape == tokens.shape:
        return [int(v) for v in attention.ne(0).sum(dim=-1).tolist()]
    return [int(tokens.shape[1])] * int(tokens.shape[0])


def workload(length: int) -> int:
    """verl's `calculate_workload`: 24576 * seqlen + seqlen^2 (a 7B model's dense FLOPs, relative)."""
    return 24576 * length + length * length


class _Set:
    def __init__(self) -> None:
        self.sum = 0
        self.items: list[tuple[int, int]] = []

    def add(self, idx: int, val: int) -> None:
        self.items.append((idx, val))
        self.sum += val

    def merge(self, other: _Set) -> None:
        for idx, val in other.items:
            self.add(idx, val)

    def __lt__(self, other: _Set) -> bool:
        if self.sum != other.sum:
            return self.sum < other.sum
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:
    def __init__(self, items: list[tuple[int, int]], k: int) -> None:
        self.k = k
        self.sets = [_Set() for _ in range(k)]
        for i, (idx, value) in enumerate(items):
            self.sets[i].add(idx, value)
        self.sets = sorted(self.sets, reverse=True)

    def merge(self, other: _State) -> None:
        for i in range(self.k):
            self.sets[i].merge(other.sets[self.k - 1 - i])
        self.sets = sorted(self.sets, reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: _State) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0] > other.sets[0]


def balanced_partitions(values: Sequence[int], k: int) -> list[list[int]]:
    """verl's `get_seqlen_balanced_partitions(values, k, equal_size=False)`: Karmarkar-Karp's largest differencing
    into `k` non-empty parts, each part's indices sorted (the same tie-breaking as verl's, so the same parts)."""
    if len(values) < k:
        raise ValueError(f"{len(values)} items cannot fill {k} micro-batches")
    states: list[_State] = []
    for value, idx in sorted((v, i) for i, v in enumerate(values)):
        heapq.heappush(states, _State([(idx, value)], k))
    while len(states) > 1:
        first, second = heapq.heappop(states), heapq.heappop(states)
        first.merge(second)
        heapq.heappush(states, first)
    parts = [sorted(idx for idx, _ in s.items) for s in states[0].sets]
    if any(not part for part in parts):
        raise ValueError(f"a balanced partition into {k} left one empty")
    return parts


def token_budget_rows(
    lengths: Sequence[int], max_token_len: int, count: int | None, balance: bool, where: str
) -> list[list[int]]:
    """verl 0.9.1's `rearrange_micro_batches` on one rank (no forced groups): the rows of each micro-batch.
    SnapshotError naming `where` when a sequence is longer than the budget, or the budget cannot be met."""
    if not lengths:
        raise SnapshotError(f"{where}: the batch holds no sequences to split")
    longest = max(lengths)
    if longest > max_token_len:
        raise SnapshotError(
            f"{where}: a sequence of {longest} tokens breaks {SECTION}.max_token_len {max_token_len} "
            "(verl's dynamic batch size never splits a sequence)"
        )
    n = min(len(lengths), -(-sum(lengths) // max_token_len))
    if count is not None:
        n = max(n, count)
    if n > len(lengths):
        raise SnapshotError(
            f"{where}: {SECTION}.count {count} is more micro-batches than the batch's {len(lengths)} sequences"
        )
    loads = [workload(length) for length in lengths]
    while True:
        parts = balanced_partitions(loads, n)
        if all(sum(lengths[i] for i in part) <= max_token_len for part in parts):
            break
        n += 1
        if n > len(lengths):  # cannot happen with every sequence within the budget; kept as verl keeps it
            raise SnapshotError(f"{where}: {SECTION}.max_token_len {max_token_len} cannot be met")
    if balance:
        parts.sort(key=lambda part: (sum(loads[i] for i in part), part[0]), reverse=True)
        parts = parts[::2][::-1] + parts[1::2]
    return parts


def _recorded_rows(batch: Mapping[str, Any], size: int, where: str) -> list[tuple[list[int], int]]:
    rows = batch.get(MICRO_BATCH_ROWS)
    width = int(batch["tokens"].shape[1])
    if rows is None:
        return [(list(range(size)), width)]
    widths = batch.get(MICRO_BATCH_WIDTHS)
    counts = [int(v) for v in rows.tolist()] if isinstance(rows, torch.Tensor) and rows.dim() == 1 else None
    if counts is None or any(c < 1 for c in counts) or sum(counts) != size:
        raise SnapshotError(
            f"{where}: {MICRO_BATCH_ROWS} {shown(counts if counts is not None else rows, 80)} does not tile the "
            f"batch's {size} sequences (each micro-batch needs >= 1 sequence, and they must add up to the batch)"
        )
    own = [int(v) for v in widths.tolist()] if isinstance(widths, torch.Tensor) and widths.dim() == 1 else None
    if own is None or len(own) != len(counts) or any(not 0 < w <= width for w in own):
        own = [width] * len(counts)
    out, start = [], 0
    for c, w in zip(counts, own, strict=True):
        out.append((list(range(start, start + c)), w))
        start += c
    return out


def split_rows(batch: Mapping[str, Any], spec: MicroBatchSpec, where: str) -> list[tuple[list[int], int]]:
    """(rows, token width) of each micro-batch of a rank's canonical batch, in the trainer's order.
    SnapshotError naming `where` (the batch file) and the field when the split does not fit the batch."""
    size, width = int(batch["tokens"].shape[0]), int(batch["tokens"].shape[1])
    if spec.split == "recorded":
        return _recorded_rows(batch, size, where)
    if spec.split == "whole":
        return [(list(range(size)), width)]
    if spec.split == "size":
        assert spec.size is not None
        if size % spec.size:
            raise SnapshotError(
                f"{where}: {SECTION}.size {spec.size} does not tile the batch's {size} sequences (verl and Megatron "
                "need the batch to divide into whole micro-batches)"
            )
        return [(list(range(i, i + spec.size)), width) for i in range(0, size, spec.size)]
    assert spec.max_token_len is not None
    parts = token_budget_rows(sequence_lengths(batch), spec.max_token_len, spec.count, spec.balance, where)
    return [(part, width) for part in parts]


def plan_micro_batches(
    batch: Mapping[str, Any], spec: MicroBatchSpec, loss: Mapping[str, Any], where: str | Path
) -> list[MicroBatch]:
    """The micro-batches a rank's step is replayed in, each with its loss scale (`scale_for` the run config's
    `loss` section's convention and normalisation)."""
    parts = split_rows(batch, spec, str(where))
    convention = str(loss.get("convention", "axrl"))
    normalization = str(loss.get("normalization", "per_rank"))
    scale = 1.0 if spec.scale_for(convention, normalization) == "sum" else 1.0 / len(parts)
    return [MicroBatch(tuple(rows), width, scale) for rows, width in parts]


def take(batch: Mapping[str, Any], mb: MicroBatch) -> dict[str, Any]:
    """The micro-batch's own batch: per-sequence tensors cut to its rows (and per-token ones to its width); counts
    and non-tensors as they are; the split's own fields left out. A single micro-batch of all rows is the batch."""
    size, width = int(batch["tokens"].shape[0]), int(batch["tokens"].shape[1])
    if mb.rows == tuple(range(size)) and mb.width == width:
        return {k: v for k, v in batch.items() if k not in SPLIT_FIELDS}
    index = torch.tensor(mb.rows, dtype=torch.long)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in SPLIT_FIELDS:
            continue
        if isinstance(value, torch.Tensor) and not value.is_nested and value.dim() >= 1 and value.shape[0] == size:
            value = value.index_select(0, index.to(value.device))
            if value.dim() >= 2 and value.shape[1] == width and mb.width < width:
                value = value[:, : mb.width]
        out[key] = value
    return out


def take_routing(control: Any, mb: MicroBatch, size: int) -> Any:
    """A forward's `RoutingControl` cut to the micro-batch (its recorded routes and replayed tokens)."""
    changes: dict[str, Any] = {}
    for name in ("routes", "replay_tokens"):
        value = getattr(control, name)
        if isinstance(value, torch.Tensor) and value.shape[0] == size:
            value = value.index_select(0, torch.tensor(mb.rows, dtype=torch.long, device=value.device))
            changes[name] = value[:, : mb.width]
    return replace(control, **changes) if changes else control


def stitch(
    parts: Sequence[torch.Tensor], plan: Sequence[MicroBatch], size: int, width: int, fill: float = 0
) -> torch.Tensor:
    """Per-micro-batch [b, w, ...] tensors put back at their rows of a [size, width, ...] one (`fill` where none);
    differentiable: gradients of the whole reach each part."""
    first = parts[0]
    out = torch.full((size, width, *first.shape[2:]), fill, dtype=first.dtype, device=first.device)
    for part, mb in zip(parts, plan, strict=True):
        index = torch.tensor(mb.rows, dtype=torch.long, device=first.device)
        out[index, : part.shape[1]] = part
    return out
