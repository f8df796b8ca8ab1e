"""A checkpoint tensor's chunks must tile it exactly: every element in exactly one chunk.

DCP loads a tensor by copying whichever saved chunks overlap it; an element no chunk covers is left as it was,
so a model built with random initial values would silently keep them (five replays, five grad norms), and
overlapping chunks make the result depend on the order they are read in. Checked on the metadata alone.

Cost: one chunk (the unsharded case) is O(1); chunks split along one dimension are sorted along it. Any other
layout is laid on the grid its chunks' boundaries cut the tensor into and counted per cell (for the grids
sharding makes, as many cells as chunks), bounded by MAX_GRID_CELLS.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

MAX_GRID_CELLS = 1 << 22  # 4M cells (16 MiB of counts): far beyond a real sharding's chunks per tensor

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def _volume(sizes: Sequence[int]) -> int:
    volume = 1
    for d in sizes:
        volume *= d
    return volume


def tiling_problem(shape: tuple[int, ...], chunks: Sequence[Chunk]) -> str | None:
    """Why `chunks` do not tile a tensor of `shape` exactly (a phrase to follow the tensor's name), or None."""
    numel = _volume(shape)
    if not chunks:
        return None if numel == 0 else f"has no chunks: none of its {numel} elements is in the checkpoint"
    covered = 0
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"has a chunk of {len(sizes)} dimensions at offsets {offsets}; the tensor has {len(shape)}"
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            return f"has a chunk at offsets {offsets} of sizes {sizes}, outside its shape {shape}"
        covered += _volume(sizes)
    if covered < numel:
        return f"has chunks covering {covered} of its {numel} elements: the rest is in no chunk"
    if covered > numel:
        return f"has chunks adding up to {covered} elements for its {numel}: chunks overlap"
    if len(chunks) == 1 or numel == 0:
        return None  # inside the tensor and as large as it: the whole tensor
    split = [d for d in range(len(shape)) if len({(o[d], s[d]) for o, s in chunks}) > 1]
    if len(split) == 1:  # sharded along one dimension (FSDP's dim 0, a TP split): a sort finds any overlap
        return _overlap_along(split[0], chunks)
    return _overlap(shape, chunks)


def _overlap_along(dim: int, chunks: Sequence[Chunk]) -> str | None:
    """Chunks that differ only along `dim` (and add up to the tensor): where two overlap, if they do."""
    spans = sorted((o[dim], o[dim] + s[dim]) for o, s in chunks)
    for (_, end), (start, _) in itertools.pairwise(spans):
        if start < end:
            at = tuple(start if d == dim else 0 for d in range(len(chunks[0][0])))
            return f"has chunks that overlap at offsets {at} (and so leave elements in no chunk)"
    return None


def _overlap(shape: tuple[int, ...], chunks: Sequence[Chunk]) -> str | None:
    """With chunks inside the tensor whose volumes add up to it, where two overlap (and so where a gap is)."""
    import numpy as np

    cuts = [
        sorted({o[d] for o, _ in chunks} | {o[d] + s[d] for o, s in chunks} | {0, shape[d]}) for d in range(len(shape))
    ]
    cells = _volume([len(c) - 1 for c in cuts])
    if cells > MAX_GRID_CELLS:
        return (
            f"has {len(chunks)} chunks whose boundaries cut it into {cells} cells, more than the {MAX_GRID_CELLS} "
            "that can be checked for overlaps and gaps; refused"
        )
    where = [{value: i for i, value in enumerate(c)} for c in cuts]
    boxes = [
        tuple(slice(where[d][o], where[d][o + s]) for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)))
        for offsets, sizes in chunks
    ]
    # a tiling covers each cell once, so its chunks' cells add up to the grid's; counting them first also bounds the
    # marking below by the grid (chunks piled on most of it would otherwise cost chunks x cells)
    if sum(_volume([b.stop - b.start for b in box]) for box in boxes) != cells:
        return "has chunks that overlap (and so leave elements in no chunk)"
    counts = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
    for box in boxes:
        counts[box] += 1
    over = np.argwhere(counts > 1)
    if len(over) == 0:
        return None
    at = tuple(cuts[d][int(i)] for d, i in enumerate(over[0]))
    return f"has chunks that overlap at offsets {at} (and so leave elements in no chunk)"
