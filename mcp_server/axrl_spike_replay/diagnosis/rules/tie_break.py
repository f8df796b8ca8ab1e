"""Causes that tie (same strength, the evidence fitting both) name the comparison that would separate them, and
`diagnose` runs it when it is cheap (the model evidence ran here: a replay of the same snapshot costs seconds).

The comparison is each cause's first experiment replayed beside the baseline (one sweep): the cause whose experiment
clears or moves the spike by `MOVED` or more, while the other's moves it less than half as much, is the one the
spike answers to; it gets back the strength it had before the tie, and both say what the sweep showed. When neither
separates, both stay tied and say so.
"""

from __future__ import annotations

import math
from pathlib import Path

from axrl_spike_replay.diagnosis.rules.causes import Cause

MOVED = 0.01  # the least relative change of the grad norm that counts (experiment.verdict.MEASURABLE_DROP)
DOMINATES = 2.0  # the winner's change at least this many times the other's


def tie_pairs(found: list[Cause]) -> list[tuple[Cause, Cause]]:
    """Each tied pair once (a before b in `found`'s order)."""
    pairs = []
    for i, a in enumerate(found):
        for b in found[i + 1 :]:
            if b.family in a.tied_with and a.experiments and b.experiments:
                pairs.append((a, b))
    return pairs


def name_comparisons(found: list[Cause]) -> list[tuple[Cause, Cause]]:
    """Add to each tied cause the comparison that would separate it from the other; the pairs."""
    pairs = tie_pairs(found)
    for a, b in pairs:
        text = (
            f"the comparison that separates {a.family} from {b.family}: replay `{a.experiments[0].mitigation}` "
            f"against `{b.experiments[0].mitigation}` beside the baseline; the one that clears or moves the spike is "
            "the cause"
        )
        a.evidence.append(text)
        b.evidence.append(text)
    return pairs


def run_comparisons(snapshot: Path, pairs: list[tuple[Cause, Cause]], untied: dict[int, float]) -> list[str]:
    """Replay each pair's comparison (one sweep for every pair) and separate the pairs it separates; `untied`:
    id(cause) -> its strength before the tie. What could not be run, as notes."""
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.experiment.mitigation.mitigations import check_distinct, parse_config, parse_mitigation_args
    from axrl_spike_replay.experiment.request.request_parts import ReplayRequest, What
    from axrl_spike_replay.replay.sweep import run_sweep
    from axrl_spike_replay.vocabulary import Verb

    items = list(dict.fromkeys(e for a, b in pairs for e in (a.experiments[0].mitigation, b.experiments[0].mitigation)))
    if not items:
        return []
    try:
        configs = tuple(parse_config(parse_mitigation_args([e]), f"config {i + 1}") for i, e in enumerate(items))
        check_distinct(configs)  # as the request builder does (it sits above the diagnosis)
        sweep = run_sweep(ReplayRequest(what=What(snapshot, verb=Verb.SWEEP, configs=configs)))
    except AxrlError as exc:
        return [f"the tied causes' comparison ({exc})"]
    base = sweep.baseline.grad_norm
    change: dict[str, float] = {}
    for item, result in zip(items, sweep.results, strict=True):
        if result.grad_norm is not None and base and math.isfinite(base) and math.isfinite(result.grad_norm):
            change[item] = abs(result.grad_norm / base - 1.0)
    for a, b in pairs:
        ea, eb = a.experiments[0].mitigation, b.experiments[0].mitigation
        ca, cb = change.get(ea), change.get(eb)
        if ca is None or cb is None:
            continue
        shown = f"`{ea}` changes the grad norm by {100 * ca:.1f} %, `{eb}` by {100 * cb:.1f} %"
        winner, loser = (
            (a, b)
            if ca >= MOVED and ca >= DOMINATES * cb
            else (b, a)
            if cb >= MOVED and cb >= DOMINATES * ca
            else (None, None)
        )
        if winner is None or loser is None:
            for c in (a, b):
                c.evidence.append(f"ran the comparison: {shown}; it does not separate them")
            continue
        winner.strength = max(winner.strength, untied.get(id(winner), winner.strength))
        winner.tied_with = [f for f in winner.tied_with if f != loser.family]
        winner.evidence.append(f"ran the comparison: {shown}: the spike answers to this cause, not {loser.family}")
        loser.evidence.append(f"ran the comparison: {shown}: the spike answers to {winner.family}, not this cause")
    return []
