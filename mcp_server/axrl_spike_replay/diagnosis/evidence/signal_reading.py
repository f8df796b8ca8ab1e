"""Which stored signal is the odd one out, and on which ranks: a reading of the per-rank signal check
(`experiment.step_evidence.SignalCheck`) that names no fault, only disagreement and its witnesses.

Each stored signal S (old, rollout, ref log-probs; the recorded routes) is judged per rank by how far it is from
the replay at the snapshot's weights, in units where 1 is clearly off: `level = max(mean |Δ| / 0.3 nats,
share of loss tokens with |Δ| > ln 2 / 5 %)`. Log-prob signals take the better of the two forwards (the run's
routing, `current`, and the model's own routing, `own`): a stored signal computed under either routing is then
judged fairly, and a rank where only `own` agrees points at the routes, not at S.

S is odd on rank r when its level there is at least 1 and a witness says the replay is right there:

- a rank witness: S agrees (level below a third of r's, and below 1) on some other rank;
- a signal witness: another stored log-prob signal agrees with the replay on rank r (the forward is sound there);
- for routes, the model's own routing makes a stored log-prob signal agree where the recorded routes do not.

Routes that differ on fewer tokens than clearly off (but on ROUTES_FLOOR of it) are odd on a rank when they cost it:
its typical sample is COSTLY_ROUTES nats per token less likely under them than under the model's own routing, and
WITNESS_RATIO times what the recorded routes cost every other rank (a few tokens on the wrong experts of an
expert-sensitive model move the log-probs by nats).

The reference is another model's: the policy is expected to have moved from it, so for it the agreeing stored
signals are no witness; only a rank far beyond the others (whose data the policy does not find far less likely:
there it has drifted furthest), or 0 fills in it alone, single it out (`_odd_drifting`).

An odd signal on every rank with no witness is `spread` (an engine/trainer mismatch looks like that); without any
witness nothing is separated, and the reading says so (`witnesses` empty). Loss tokens where a stored signal is
exactly 0 while the policy's log-prob is far from 0 are `zero_filled`: a padded value, not a log-prob (two stored
signals or more zero there at once: the loss mask covers tokens they were not stored for). A rank whose loss masks stop
before the last token the engine generated (a stored rollout log-prob, attended) on most samples, where another
rank's run to the end, is `truncated`: its loss leaves out tokens the others train on.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from axrl_spike_replay.experiment.step_evidence import PairFigures, RankSignals, SignalCheck

MEAN_OFF = 0.3  # nats of mean |Δ| that count as clearly off
OUTSIDE_OFF = 0.05  # share of loss tokens with the ratio outside [0.5, 2] that counts as clearly off
ROUTES_OFF = 0.2  # share of routed tokens whose expert set differs that counts as clearly off
WITNESS_RATIO = 3.0  # an agreeing rank is at most a third as far off
ZERO_FILLED = 0.02  # share of a rank's loss tokens zero-filled in a stored signal that counts
ROUTES_FLOOR = 0.25  # a route level (a quarter of ROUTES_OFF) below which routes are not judged by what they cost
COSTLY_ROUTES = 1.0  # nats per loss token the recorded routes cost a rank's typical sample that count
DATA_NATS = 1.0  # a rank's typical sample this much less likely per token (mean log π) than the others': other data
TRUNCATED = 0.5  # share of a rank's samples whose loss mask stops before the last generated token that counts
LOGPROB_SIGNALS = ("old", "rollout", "ref")
# signals of another model: the policy is expected to have moved from them (what the KL term bounds), so only
# a rank far beyond the others, or values that are no log-prob at all, single one out
DRIFTING = ("ref",)


def pair_level(p: PairFigures | None) -> float | None:
    """How far off a pair is, 1 = clearly off (see the module doc); None when not compared."""
    if p is None or p.tokens == 0:
        return None
    return max(p.mean_abs / MEAN_OFF, p.outside / OUTSIDE_OFF)


@dataclass
class SignalLevels:
    """One stored signal on one rank: its level against the replay, and against each forward."""

    rank: int
    signal: str
    level: float
    current: float | None  # against the run's routing
    own: float | None  # against the model's own routing (routing replay on)
    pair: PairFigures | None = None  # the better-agreeing pair
    zero_filled: float = 0.0  # share of loss tokens where the stored value is a 0 fill
    current_pair: PairFigures | None = None  # against the run's routing (what the loss and its masks see)


@dataclass
class OddSignal:
    """A stored signal out of line with the replay on some ranks, with what shows the replay is right there."""

    signal: str  # old | rollout | ref | routes
    ranks: list[int]
    levels: dict[int, float]
    spread: bool  # off on every rank
    witnesses: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    samples: list[tuple[int, int]] = field(default_factory=list)  # the worst samples on the odd ranks
    layers: list[int] = field(default_factory=list)  # routes: the MoE layers off on those ranks
    zero_filled: bool = False

    @property
    def separated(self) -> bool:
        return bool(self.witnesses)


@dataclass
class SignalReading:
    levels: dict[str, dict[int, SignalLevels]] = field(default_factory=dict)  # signal -> rank -> levels
    routes: dict[int, float] = field(default_factory=dict)  # rank -> route level (disagreement / ROUTES_OFF)
    odd: list[OddSignal] = field(default_factory=list)
    mask_ranks: dict[int, float] = field(default_factory=dict)  # rank -> share of loss tokens no signal covers
    mask_signals: dict[int, list[str]] = field(default_factory=dict)  # rank -> the signals that are 0 fills there
    likelihood: dict[int, float] = field(default_factory=dict)  # rank -> its typical sample's mean log π (replay)
    likelihood_own: dict[int, float] = field(default_factory=dict)  # ... under the model's own routing
    surprise: dict[int, float] = field(default_factory=dict)  # rank -> nats per token past the policy's entropy
    # rank -> (share of its samples whose loss mask stops before what was generated, mean tokens left out)
    tails: dict[int, tuple[float, float]] = field(default_factory=dict)
    truncated: list[int] = field(default_factory=list)  # ranks whose masks stop short where another rank's do not
    # rank -> signal -> (mean |log π - stored| as stored, the least of the policy's run and own routing; per offset
    # the rank's tokens were moved by, the same figure): where the replay tried the rank's batch at other offsets
    shifted: dict[int, dict[str, tuple[float, dict[str, float]]]] = field(default_factory=dict)

    def odd_signal(self, signal: str) -> OddSignal | None:
        return next((o for o in self.odd if o.signal == signal), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "odd": [
                {
                    "signal": o.signal,
                    "ranks": o.ranks,
                    "spread": o.spread,
                    "levels": {str(r): v for r, v in o.levels.items()},
                    "witnesses": o.witnesses,
                    "layers": o.layers,
                    "zero_filled": o.zero_filled,
                }
                for o in self.odd
            ],
            "levels": {s: {str(r): v.level for r, v in by.items()} for s, by in self.levels.items()},
            "route_levels": {str(r): v for r, v in self.routes.items()},
            "typical_logprob": {str(r): v for r, v in self.likelihood.items()},
            "typical_logprob_own_routing": {str(r): v for r, v in self.likelihood_own.items()},
            "typical_surprise": {str(r): v for r, v in self.surprise.items()},
            "mask_tails": {str(r): {"samples": v[0], "tokens": v[1]} for r, v in self.tails.items()},
            "truncated_masks": self.truncated,
        }


def _levels(rank: RankSignals, signal: str) -> SignalLevels | None:
    cur, own = rank.pairs.get(f"current_vs_{signal}"), rank.pairs.get(f"own_vs_{signal}")
    lc, lo = pair_level(cur), pair_level(own)
    known = [(v, p) for v, p in ((lc, cur), (lo, own)) if v is not None]
    if not known:
        return None
    level, pair = min(known, key=lambda x: x[0])
    filled = (cur.zeros / cur.tokens) if cur is not None and cur.tokens else 0.0
    return SignalLevels(rank.rank, signal, level, lc, lo, pair, filled, cur)


def _route_level(rank: RankSignals) -> float | None:
    d = rank.route_disagreement()
    return None if d is None else d / ROUTES_OFF


def _witnessed(levels: dict[int, float], r: int) -> list[int]:
    """The other ranks where the signal agrees, as the module doc defines it."""
    return [o for o, v in levels.items() if o != r and v < 1.0 and v * WITNESS_RATIO <= levels[r]]


def _worst_samples(pair: PairFigures | None, rank: int, n: int = 3) -> list[tuple[int, int]]:
    if pair is None:
        return []
    scored = [(v, i) for i, v in enumerate(pair.samples_mean_abs) if v is not None and v > math.log(2.0) / 2]
    return [(rank, i) for _, i in sorted(scored, reverse=True)[:n]]


def read_signals(check: SignalCheck) -> SignalReading:
    """The odd stored signals of a signal check (see the module doc)."""
    reading = SignalReading()
    for rank in check.ranks:
        for signal in LOGPROB_SIGNALS:
            lv = _levels(rank, signal)
            if lv is not None:
                reading.levels.setdefault(signal, {})[rank.rank] = lv
        typical = rank.typical_logprob()
        if typical is not None:
            reading.likelihood[rank.rank] = typical
        surprise = rank.typical_surprise()
        if surprise is not None:
            reading.surprise[rank.rank] = surprise
        typical_own = rank.typical_logprob_own()
        if typical_own is not None:
            reading.likelihood_own[rank.rank] = typical_own
        route = _route_level(rank)
        if route is not None:
            reading.routes[rank.rank] = route
        for signal, by_offset in rank.shifted.items():
            pairs = [rank.pairs.get(f"{how}_vs_{signal}") for how in ("current", "own")]
            base = min((p.mean_abs for p in pairs if p is not None and p.tokens), default=None)
            if base is not None and by_offset:
                reading.shifted.setdefault(rank.rank, {})[signal] = (base, dict(by_offset))
        if rank.samples_tail:
            tails = rank.samples_tail
            reading.tails[rank.rank] = (sum(t > 0 for t in tails) / len(tails), sum(tails) / len(tails))
    _mask(reading)
    _truncated(reading)
    for signal in LOGPROB_SIGNALS:
        odd = _odd_logprobs(reading, signal)
        if odd is not None:
            reading.odd.append(odd)
    routes = _odd_routes(reading, check)
    if routes is not None:
        reading.odd.append(routes)
    return reading


def _odd_logprobs(reading: SignalReading, signal: str) -> OddSignal | None:
    by = reading.levels.get(signal, {})
    levels = {r: v.level for r, v in by.items()}
    # a rank whose mask covers tokens no signal was stored for: every signal is off there, the mask explains it
    off = sorted(r for r, v in levels.items() if v >= 1.0 and r not in reading.mask_ranks)
    if not off:
        return None
    if signal in DRIFTING:
        return _odd_drifting(reading, signal, off)
    witnesses: list[str] = []
    for r in off:
        for o in _witnessed(levels, r):
            witnesses.append(f"{signal} agrees with the replay on rank {o} (level {levels[o]:.2f} vs {levels[r]:.2f})")
        for other in LOGPROB_SIGNALS:
            lv = reading.levels.get(other, {}).get(r)
            if other != signal and lv is not None and lv.level < 1.0 and lv.level * WITNESS_RATIO <= levels[r]:
                witnesses.append(f"{other} agrees with the replay on rank {r} (level {lv.level:.2f})")
    spread = len(off) == len(levels) and len(levels) > 1
    if spread:  # off everywhere: only the ranks far beyond the others are singled out
        median = statistics.median(levels.values())
        far = [r for r in off if levels[r] >= WITNESS_RATIO * max(median, 1.0)]
        if far and len(far) < len(off):
            off, spread = far, False
    odd = OddSignal(signal, off, {r: levels[r] for r in off}, spread, witnesses)
    for r in off:
        lv = by[r]
        p = lv.pair
        if p is None:
            continue
        forward = "own routing" if p.pair.startswith("own_") else "the run's routing"
        odd.evidence.append(
            f"rank {r}: stored {signal} log-probs vs the replay ({forward}): mean |Δ| {p.mean_abs:.3g} nats, max "
            f"{p.max_abs:.3g}, {100 * p.outside:.1f} % of {p.tokens} loss tokens outside ratio [0.5, 2]"
        )
        if lv.zero_filled >= ZERO_FILLED:
            odd.zero_filled = True
            odd.evidence.append(
                f"rank {r}: {100 * lv.zero_filled:.1f} % of loss tokens hold a stored {signal} log-prob of exactly 0 "
                "where the policy's is far from 0 (a padded value, not a log-prob)"
            )
        if lv.current is not None and lv.own is not None and lv.own * WITNESS_RATIO <= lv.current:
            odd.evidence.append(f"rank {r}: agrees better under the model's own routing than under the recorded routes")
        odd.samples += _worst_samples(p, r)
    agree = [r for r, v in levels.items() if r not in off]
    if agree:
        odd.evidence.append(
            "agreeing ranks: "
            + ", ".join(f"rank {r} mean |Δ| {p.mean_abs:.3g}" for r in agree if (p := by[r].pair) is not None)
        )
    return odd


def _odd_drifting(reading: SignalReading, signal: str, off: list[int]) -> OddSignal:
    """A signal of another model (the reference): its distance to the replay is the policy's drift wherever the
    stored values are right, alike on every rank. The replay agreeing with the other stored signals on a rank says
    the forward is sound there, not that this signal is wrong, so it is no witness here. A rank is singled out by
    a rank witness (the signal at least WITNESS_RATIO times further off than on every other rank whose mask is
    sound) or by its own 0 fills (a padded value, not a log-prob, in this signal alone). Off on every rank alike:
    `spread`, unseparated (drift, or a reference wrong everywhere; the channel's KL share says what it weighs)."""
    by = reading.levels.get(signal, {})
    levels = {r: v.level for r, v in by.items()}
    sound = {r: v for r, v in levels.items() if r not in reading.mask_ranks}
    singled: list[int] = []
    witnesses: list[str] = []
    for r in off:
        others = [v for o, v in sound.items() if o != r]
        if others and levels[r] >= WITNESS_RATIO * max(others) and not _less_likely(reading, r):
            singled.append(r)
            witnesses.append(
                f"{signal} is {levels[r] / max(max(others), 1e-12):.3g}x further off on rank {r} than on every other "
                f"rank (level {levels[r]:.2f} vs at most {max(others):.2f}): the policy's drift is alike on every rank"
            )
        if by[r].zero_filled >= ZERO_FILLED:
            if r not in singled:
                singled.append(r)
            witnesses.append(
                f"rank {r}: {100 * by[r].zero_filled:.1f} % of loss tokens hold a stored {signal} log-prob of exactly "
                "0 where the policy's is far from 0, and no other stored signal does (a padded value, not a log-prob)"
            )
    if singled:
        odd = OddSignal(signal, sorted(singled), {r: levels[r] for r in singled}, False, witnesses)
    else:
        # off on every sound rank alike (or on a lone sound rank beside mask-broken ones): nothing singles it out
        odd = OddSignal(signal, off, {r: levels[r] for r in off}, True, [])
        odd.evidence.append(
            f"stored {signal} log-probs are off alike on rank {', '.join(str(r) for r in off)}: the policy's "
            f"distance to the {signal} model, not a rank's broken signal (levels "
            + ", ".join(f"rank {r} {v:.2f}" for r, v in sorted(levels.items()))
            + ")"
        )
    for r in odd.ranks:
        p = by[r].pair
        if p is None:
            continue
        odd.evidence.append(
            f"rank {r}: stored {signal} log-probs vs the replay: mean |Δ| {p.mean_abs:.3g} nats, max {p.max_abs:.3g}, "
            f"{100 * p.outside:.1f} % of {p.tokens} loss tokens outside ratio [0.5, 2]"
        )
        if by[r].zero_filled >= ZERO_FILLED:
            odd.zero_filled = True
        odd.samples += _worst_samples(p, r)
    return odd


def route_cost(reading: SignalReading, rank: int) -> float | None:
    """How much less likely the rank's typical sample is under its recorded routes than under the model's own
    routing (nats per loss token; None: not both known)."""
    own, current = reading.likelihood_own.get(rank), reading.likelihood.get(rank)
    return None if own is None or current is None else own - current


def _costly(reading: SignalReading, rank: int) -> bool:
    """Recorded routes that differ on fewer tokens than ROUTES_OFF but make the rank's data COSTLY_ROUTES nats per
    token less likely than its own routing does, WITNESS_RATIO times what they cost on every other rank."""
    cost = route_cost(reading, rank)
    if cost is None or cost < COSTLY_ROUTES or reading.routes.get(rank, 0.0) < ROUTES_FLOOR:
        return False
    others = [c for o in reading.routes if o != rank and (c := route_cost(reading, o)) is not None]
    return bool(others) and all(max(c, 0.0) * WITNESS_RATIO <= cost for c in others)


def _less_likely(reading: SignalReading, rank: int) -> bool:
    """Whether the rank's typical sample is DATA_NATS per token less likely to the policy than the other ranks':
    data the policy finds unlikely is where it has moved furthest from its reference, so a reference further off
    there is that data's, not a broken reference (its 0 fills still single it out)."""
    typical = reading.likelihood
    rest = [v for o, v in typical.items() if o != rank]
    return rank in typical and bool(rest) and statistics.median(rest) - typical[rank] >= DATA_NATS


def _odd_routes(reading: SignalReading, check: SignalCheck) -> OddSignal | None:
    levels = reading.routes
    off = sorted(r for r, v in levels.items() if v >= 1.0 or _costly(reading, r))
    if not off:
        return None
    witnesses = []
    for r in off:
        cost = route_cost(reading, r)
        if cost is not None and _costly(reading, r):
            witnesses.append(
                f"rank {r}'s typical sample is {cost:.3g} nats per loss token less likely under its recorded routes "
                "than under the model's own routing, against at most "
                + ", ".join(f"{route_cost(reading, o) or 0.0:.3g} on rank {o}" for o in levels if o != r)
            )
    for r in off:
        for o in _witnessed(levels, r):
            witnesses.append(
                f"rank {o}'s recorded routes agree with the model's routing ({levels[o] * ROUTES_OFF:.0%})"
            )
        for signal in LOGPROB_SIGNALS:  # the model's own routing makes a stored signal agree where the routes do not
            lv = reading.levels.get(signal, {}).get(r)
            if lv is None or lv.own is None or lv.current is None:
                continue
            if lv.own < 1.0 and lv.own * WITNESS_RATIO <= lv.current and lv.current > 0.1:
                witnesses.append(
                    f"rank {r}: stored {signal} log-probs agree with the model's own routing (level {lv.own:.2f}) "
                    f"better than with the recorded routes (level {lv.current:.2f})"
                )
    spread = len(off) == len(levels) and len(levels) > 1
    odd = OddSignal("routes", off, {r: levels[r] for r in off}, spread, witnesses)
    for r in off:
        rank = check.rank(r)
        if rank is None:
            continue
        layers = [x for x in rank.routes if (x.loss_disagreement or 0.0) >= ROUTES_OFF]
        odd.layers = sorted(set(odd.layers) | {x.layer for x in layers})
        odd.evidence.append(
            f"rank {r}: the model's own routing picks other experts than the recorded routes on "
            + "; ".join(
                f"layer {x.layer}: {_pct(x.loss_disagreement)} of loss tokens, {_pct(x.other_disagreement)} of others"
                for x in rank.routes
            )
        )
    agree = [r for r in levels if r not in off]
    if agree:
        odd.evidence.append(
            "agreeing ranks: "
            + ", ".join(f"rank {r} {levels[r] * ROUTES_OFF:.0%} of routed tokens differ" for r in agree)
        )
    return odd


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _mask(reading: SignalReading) -> None:
    """Ranks where two stored log-prob signals or more are 0 fills on loss tokens: signals stored apart (the
    trainer's old and reference passes, the engine's) padded alike say the loss mask covers tokens they were not
    stored for, not that each is broken. A signal stored over the whole sequence (an engine that scores the prompt
    too) holds values there, so not every signal need be a fill."""
    ranks = set().union(*(by.keys() for by in reading.levels.values())) if reading.levels else set()
    for r in ranks:
        filled = {s: by[r].zero_filled for s, by in reading.levels.items() if r in by}
        filled = {s: v for s, v in filled.items() if v >= ZERO_FILLED}
        if len(filled) >= 2:
            reading.mask_ranks[r] = min(filled.values())
            reading.mask_signals[r] = sorted(filled)


def _truncated(reading: SignalReading) -> None:
    """Ranks whose loss masks stop short of what was generated on most samples (TRUNCATED) where another rank's run
    to the end (a rank witness). Alike on every rank it is the run's own masking (a last turn the loss never
    trains on, say), singled out nowhere."""
    for r, (share, _) in reading.tails.items():
        if share < TRUNCATED:
            continue
        if any(o != r and other * WITNESS_RATIO <= share for o, (other, _) in reading.tails.items()):
            reading.truncated.append(r)


def outside_fraction(reading: SignalReading, signal: str) -> float | None:
    """The share of every rank's loss tokens where π/π_signal (the run's routing) leaves [0.5, 2]: what a
    `ratio_outlier_mask` against that signal masks."""
    pairs = [v.current_pair for v in reading.levels.get(signal, {}).values() if v.current_pair is not None]
    tokens = sum(p.tokens for p in pairs)
    return sum(p.outside * p.tokens for p in pairs) / tokens if tokens else None
