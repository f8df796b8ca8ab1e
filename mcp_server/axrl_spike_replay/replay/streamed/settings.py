"""Where a streamed replay keeps its layer boundaries (torch-free: the engine's options and the plan name it)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST_BUDGET = 4 << 30  # boundaries held in host memory before they spill to disk


@dataclass(frozen=True)
class StreamSettings:
    """Host memory for the layer boundaries up to `host_budget_bytes`, then the spill dir made under `spill_dir`
    (None: the temp dir); the spill dir is removed when the replay ends, however it ends. `read_ahead`: one layer read
    ahead while the current one computes."""

    host_budget_bytes: int = DEFAULT_HOST_BUDGET
    spill_dir: str | None = None
    read_ahead: bool = True  # the next layer read on a background thread (the plan leaves it out where it won't fit)
