"""The read and compute speeds of a streamed row's time estimate (`streamed_plan`), each with how it was had:
measured where the replay would run (`replay.plans.node_speeds`), kept from an earlier measurement, or assumed
(`ASSUMED_*`), with the reason. A plain value module: nothing here imports torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# assumed speeds where none is given (said in the row): a local NVMe read, and a sustained fraction of the peak
ASSUMED_READ_BYTES_PER_S = 2e9
ASSUMED_FLOPS = {"cpu": 5e10, "cuda": 3e14}
MAX_HOW_CHARS = 600  # a speed's how, as another process wrote it


@dataclass(frozen=True)
class Speeds:
    """The read and compute speeds of the row's estimate, each with how it was had (measured, kept, assumed)."""

    read_bytes_per_s: float
    read_how: str
    flops_per_s: float
    compute_how: str
    read_measured: bool = False
    compute_measured: bool = False
    read_cached: bool | None = None  # the measured read came from the page cache (None: unknown, or not measured)

    @classmethod
    def assumed(cls, device: str, why: str = "not measured") -> Speeds:
        """The assumed speeds for `device`, saying `why` they are assumed."""
        flops = ASSUMED_FLOPS.get(device, ASSUMED_FLOPS["cpu"])
        return cls(ASSUMED_READ_BYTES_PER_S, f"assumed ({why})", flops, f"assumed ({why})")

    def with_read(self, bytes_per_s: float, how: str, cached: bool | None) -> Speeds:
        """These speeds with a measured read speed."""
        return dataclasses.replace(self, read_bytes_per_s=bytes_per_s, read_how=how, read_measured=True,
                                   read_cached=cached)  # fmt: skip

    def with_compute(self, flops_per_s: float, how: str, measured: bool = True) -> Speeds:
        """These speeds with another compute speed (measured unless said)."""
        return dataclasses.replace(self, flops_per_s=flops_per_s, compute_how=how, compute_measured=measured)

    def text(self) -> str:
        """Both speeds and how each was had, in words."""
        return (
            f"read {self.read_bytes_per_s / 1e9:.3g} GB/s {self.read_how}; "
            f"compute {self.flops_per_s / 1e12:.3g} TFLOP/s {self.compute_how}"
        )

    @classmethod
    def from_json(cls, doc: Any, device: str) -> Speeds | None:
        """Speeds from `to_json`'s document as another process printed it (untrusted: each speed a positive finite
        number, each text bounded), else None."""
        if not isinstance(doc, dict):
            return None
        speeds = cls.assumed(device)
        for name in ("read_bytes_per_s", "flops_per_s"):
            value = doc.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                return None
        texts = [doc.get("read_how"), doc.get("compute_how")]
        if not all(isinstance(t, str) and 0 < len(t) <= MAX_HOW_CHARS for t in texts):
            return None
        flags = [doc.get("read_measured"), doc.get("compute_measured")]
        cached = doc.get("read_cached")
        if not all(isinstance(f, bool) for f in flags) or not (cached is None or isinstance(cached, bool)):
            return None
        return dataclasses.replace(
            speeds,
            read_bytes_per_s=float(doc["read_bytes_per_s"]),
            read_how=str(texts[0]),
            flops_per_s=float(doc["flops_per_s"]),
            compute_how=str(texts[1]),
            read_measured=bool(flags[0]),
            compute_measured=bool(flags[1]),
            read_cached=cached,
        )

    def to_json(self) -> dict[str, Any]:
        """The speeds as a JSON document."""
        return dataclasses.asdict(self)
