"""A corrupt routing payload (`routing_payload`): recorded routes the model's own routing or the payload's checks single
out on some ranks, or in one layer."""

from __future__ import annotations

import statistics

from axrl_spike_replay.diagnosis.evidence.signal_reading import (
    OddSignal,
)
from axrl_spike_replay.diagnosis.rules.causes import (
    LIKELY,
    LOSS_READS_LITTLE,
    Cause,
    Evidence,
    Experiment,
    is_finite,
    percent_text,
    unit_strength,
)
from axrl_spike_replay.diagnosis.rules.signal_families.signal_parts import (
    REFUTE_STAYS,
    channel_lines,
    drop_ranks,
    kl_levers,
    ranks_text,
    replays_routes,
)


def routing_payload(ev: Evidence) -> Cause | None:
    """The recorded routes of some ranks (or of one layer everywhere) disagree with the model's own routing."""
    if ev.reading is None:
        return _routes_from_layers(ev)
    odd = ev.reading.odd_signal("routes")
    if odd is None:
        return None
    all_ranks = odd.spread or len(odd.ranks) == len(ev.reading.routes)
    strength = 1.0 if odd.separated and not all_ranks else (0.7 if odd.separated else 0.5)
    term, channel = channel_lines(ev, odd.ranks)
    return _routing_cause(ev, odd, strength, odd.evidence + odd.witnesses + channel, term, all_ranks)


def _routing_cause(
    ev: Evidence, odd: OddSignal, strength: float, evidence: list[str], term: str | None, all_ranks: bool
) -> Cause:
    experiments = []
    if replays_routes(ev):
        if all_ranks:
            item = "routes,old_logprobs"
        else:
            item = ",".join(f"routes:rank{r},old_logprobs:rank{r}" for r in odd.ranks)
        experiments.append(
            Experiment(
                f"recompute={item}",
                "those ranks route as the model does, with old log-probs taken under those routes: if the spike "
                "goes, the recorded routes were the broken part (routing_replay=off alone is no test: signals stored "
                "under the recorded routes then disagree with the forward, and the spike grows whatever the payload)",
                True,
                refutes=REFUTE_STAYS,
            )
        )
        if odd.layers:
            experiments.append(
                Experiment(
                    f"current_routing_layers={','.join(str(x) for x in odd.layers)}",
                    f"routes layer {','.join(str(x) for x in odd.layers)} on current scores on every rank",
                    refutes=REFUTE_STAYS,
                )
            )
    if not all_ranks:
        experiments.append(drop_ranks(odd.ranks, "the cause"))
    if term == "kl":  # routes that moved the policy far from a reference taken under other routes
        experiments += kl_levers(ev)
    cause = Cause(
        "routing_payload",
        "corrupt or misaligned routing payload" + ("" if all_ranks else f" on rank {ranks_text(odd.ranks)}"),
        unit_strength(strength),
        evidence,
        {"levels": odd.levels, "layers": odd.layers},
        experiments,
        ranks=[] if all_ranks else odd.ranks,
        term=term,
    )
    if not replays_routes(ev):
        cause.strength = min(cause.strength, LIKELY - 0.05)
        cause.figures[LOSS_READS_LITTLE] = True
        cause.evidence.append("the run does not replay recorded routes: they do not enter its forward")
    return cause


def _routes_from_layers(ev: Evidence) -> Cause | None:
    """Merged route agreement only (an attribution passed in, no signal check): one layer far off."""
    if ev.routes is None or not ev.routes.layers:
        return None
    layers = [x for x in ev.routes.layers if is_finite(x.loss_disagreement)]
    if not layers:
        return None
    worst = max(layers, key=lambda x: x.loss_disagreement or 0.0)
    d = worst.loss_disagreement or 0.0
    rest = [x.loss_disagreement or 0.0 for x in layers if x is not worst]
    typical = statistics.median(rest) if rest else 0.0
    if d < 0.1 or (rest and d < 3 * typical):
        return None
    odd = OddSignal("routes", [], {}, True, layers=[worst.layer])
    evidence = [
        f"the model's own routing differs from the recorded routes in layer {worst.layer} on {percent_text(d)} of loss "
        f"tokens (median of the other layers {percent_text(typical)}), merged over the ranks",
    ]
    return _routing_cause(ev, odd, unit_strength(d / 0.3) * 0.8, evidence, None, True)
