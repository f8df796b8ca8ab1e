"""Summary statistics of a tensor of values, robust to non-finite entries."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_QUANTILES = (0.5, 0.9, 0.99, 0.999)
_QUANTILE_SAMPLE = 1 << 24  # torch.quantile's input limit; larger inputs use an evenly strided sample


def describe(values: torch.Tensor) -> dict[str, Any]:
    """count, non_finite, mean, std, min, max and p50/p90/p99/p999 of the finite values (floats)."""
    import torch

    flat = values.detach().reshape(-1).double()
    finite = flat[torch.isfinite(flat)]
    doc: dict[str, Any] = {"count": int(flat.numel()), "non_finite": int(flat.numel() - finite.numel())}
    if finite.numel() == 0:
        return {**doc, "mean": None, "std": None, "min": None, "max": None}
    doc.update(
        mean=float(finite.mean()),
        std=float(finite.std(unbiased=False)),
        min=float(finite.min()),
        max=float(finite.max()),
    )
    sample = finite
    if sample.numel() > _QUANTILE_SAMPLE:
        sample = sample[:: sample.numel() // _QUANTILE_SAMPLE + 1]
    qs = torch.quantile(sample, torch.tensor(_QUANTILES, dtype=sample.dtype)).tolist()
    for q, value in zip(_QUANTILES, qs, strict=True):
        doc[f"p{str(q * 100).rstrip('0').rstrip('.').replace('.', '')}"] = float(value)
    return doc
