"""`recompute`: replace a stored signal by what the snapshot's weights give, on some ranks (a diagnostic: is that
stored signal the broken part?). Torch-free.

Items, comma-separated (normal form: a sorted list of them):

- `old_logprobs[:rankR]`: the old log-probs become the log-probs of the replay's own forward at the snapshot's
  weights (detached), under the routing that forward uses; the trainer computes them at those weights before the
  step's first update, so a sound snapshot's ratio against them is 1 on every loss token. A spike that goes away
  says the stored old log-probs were stale or misaligned;
- `rollout_logprobs[:rankR]`: the rollout log-probs become the replay's own the same way (what an engine that
  agreed with the trainer would have stored): a spike that goes away says the rollout log-probs carried it;
- `routes[:rankR][:layerL]`: the recorded routes of rank R (every rank without `:rankR`) in MoE layer L (every
  MoE layer without `:layerL`) are replaced by the model's own routing, so the rank routes those tokens as the
  model does; the other layers and ranks keep replaying the recorded routes. Signals the trainer computed under the
  recorded routes (its old log-probs, often its reference log-probs) then disagree with the forward: name
  `old_logprobs` for the same ranks too (`routes:rank1,old_logprobs:rank1`), and read a KL term against such a
  reference with care.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError

SIGNALS = ("old_logprobs", "rollout_logprobs", "routes")
LOGPROB_SIGNALS = ("old_logprobs", "rollout_logprobs")
_ITEM_RE = re.compile(r"^(old_logprobs|rollout_logprobs|routes)(?::rank(\d+))?(?::layer(\d+))?$")
FORMS = (
    "old_logprobs[:rankR], rollout_logprobs[:rankR] or routes[:rankR][:layerL], comma-separated "
    "(e.g. routes:rank1,old_logprobs:rank1)"
)


@dataclass(frozen=True)
class Recompute:
    """The (signal, rank or None for every rank, layer or None for every MoE layer) items to recompute."""

    items: frozenset[tuple[str, int | None, int | None]] = frozenset()

    @property
    def active(self) -> bool:
        return bool(self.items)

    @property
    def routes(self) -> frozenset[tuple[str, int | None, int | None]]:
        """The route items (what changes the forward: configs that differ in them never share one)."""
        return frozenset(i for i in self.items if i[0] == "routes")

    def old_logprobs(self, rank: int) -> bool:
        return self.logprobs("old_logprobs", rank)

    def logprobs(self, signal: str, rank: int) -> bool:
        """Whether the stored log-prob `signal` (old_logprobs, rollout_logprobs) is recomputed on `rank`."""
        return any(s == signal and r in (None, rank) for s, r, _ in self.items)

    @property
    def recomputes_logprobs(self) -> bool:
        return any(s in LOGPROB_SIGNALS for s, _, _ in self.items)

    def route_layers(self, rank: int) -> frozenset[int] | None:
        """The MoE layers rank `rank` routes on the model's own scores: None for every layer, empty for none."""
        layers: set[int] = set()
        for signal, r, layer in self.items:
            if signal == "routes" and r in (None, rank):
                if layer is None:
                    return None
                layers.add(layer)
        return frozenset(layers)

    def ranks(self) -> set[int]:
        return {r for _, r, _ in self.items if r is not None}

    def layers(self) -> set[int]:
        return {layer for _, _, layer in self.items if layer is not None}


def parse_recompute(name: str, raw: Any) -> list[str]:
    """The normal form (sorted item strings) of a `recompute` value; ConfigError naming the bad item."""
    items: Sequence[Any]
    if isinstance(raw, str):
        items = [part.strip() for part in raw.split(",") if part.strip()]
    elif isinstance(raw, (list, tuple)):
        items = [str(part).strip() for part in raw]
    else:
        raise ConfigError(f"mitigation {name}: expected {FORMS}, got {shown(raw)}")
    out = set()
    for item in items:
        match = _ITEM_RE.match(str(item).strip().lower())
        if match is None:
            raise ConfigError(f"mitigation {name}: {shown(item)} is not {FORMS}")
        if match.group(1) in LOGPROB_SIGNALS and match.group(3) is not None:
            raise ConfigError(f"mitigation {name}: {shown(item)}: log-probs have no layer (only routes do)")
        out.add(match.group(0))
    if not out:
        raise ConfigError(f"mitigation {name}: name at least one signal ({FORMS})")
    return sorted(out)


def recompute_of(value: Iterable[str]) -> Recompute:
    """The Recompute of a normal-form value."""
    items = set()
    for item in value:
        match = _ITEM_RE.match(str(item))
        if match is None:  # the normal form always matches
            raise ConfigError(f"recompute: {shown(item)} is not {FORMS}")
        rank, layer = match.group(2), match.group(3)
        items.add((match.group(1), int(rank) if rank else None, int(layer) if layer else None))
    return Recompute(frozenset(items))
