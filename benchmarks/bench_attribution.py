#!/usr/bin/env python3
"""Spike attribution: one forward-mode pass (JVP) per rank batch vs one backward pass per sample, side by side;
and the sharded attribution (FSDP2 over 1 and 2 gloo processes) against the unsharded one.

All attribute the demo's spike (reference run, ratio_outliers, world size 2, 8 samples per rank)
with `attribute_spike`; all first replay the step once for g. `jvp` then runs one dual-number
forward per rank batch; `per_sample_backward` runs one backward per sample (plus one for the router
losses) on the retained graph; `sharded` (no forward-mode AD through FSDP2) forwards and backpropagates one
sample at a time over the processes, its gradient reduce-scattered into the shards. The sharded runs' whole call
includes starting their processes and loading the shards. Runs alternate; medians of 5 after a warm-up.
Contributions must agree.

Usage: .venv/bin/python benchmarks/bench_attribution.py [--runs 5] [--no-sharded]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.analyses.attribution import attribute_spike
from axrl_spike_replay.vocabulary import Method, Shard, Verb
from replay_spike import capture_demo_spike, median


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-sharded", action="store_true", help="leave out the sharded rows")
    args = parser.parse_args()
    runs, layouts = args.runs, ([] if args.no_sharded else [1, 2])
    with tempfile.TemporaryDirectory(prefix="bench-attribution-") as tmp:
        snapshot = capture_demo_spike(Path(tmp))
        keys = ["jvp", "naive", *(f"sharded{n}" for n in layouts)]
        times: dict[str, dict[str, list[float]]] = {m: {"attribution": [], "total": []} for m in keys}
        sharded = {}
        for method in (Method.JVP, Method.PER_SAMPLE_BACKWARD):  # warm-up (imports, allocator)
            attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, method=method)))
        for _ in range(runs):
            fast = attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100, method=Method.JVP)))
            naive = attribute_spike(
                replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100, method=Method.PER_SAMPLE_BACKWARD))
            )
            for n in layouts:
                sharded[n] = attribute_spike(
                    replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard=Shard.ON, nproc=n))
                )
            for key, result in (("jvp", fast), ("naive", naive), *((f"sharded{n}", sharded[n]) for n in layouts)):
                times[key]["attribution"].append(result.timings["attribution"])
                times[key]["total"].append(result.timings["total"])
        by_sample = {(s.rank, s.sample): s.contribution for s in naive.samples}
        worst = max(abs(s.contribution - by_sample[(s.rank, s.sample)]) for s in fast.samples) / fast.grad_norm
    a_fast, a_naive = median(times["jvp"]["attribution"]), median(times["naive"]["attribution"])
    t_fast, t_naive = median(times["jvp"]["total"]), median(times["naive"]["total"])
    print(
        f"demo spike: {fast.total_samples} samples ({fast.total_samples // fast.world_size_saved} per rank), "
        f"grad norm {fast.grad_norm:.6g}, sum check {fast.sum_rel_error:.1e}, max |jvp - naive| / ||g|| {worst:.1e}"
    )
    print(
        f"per-sample part: jvp {a_fast * 1e3:7.1f} ms vs one backward per sample {a_naive * 1e3:7.1f} ms "
        f"-> {a_naive / a_fast:.1f}x faster (target >= 3x)"
    )
    print(
        f"whole call (load, replay for g, attribution): {t_fast * 1e3:7.1f} ms vs {t_naive * 1e3:7.1f} ms "
        f"-> {t_naive / t_fast:.1f}x"
    )
    by_fast = {(s.rank, s.sample): s.contribution for s in fast.samples}
    for n in layouts:
        result = sharded[n]
        gap = max(abs(s.contribution - by_fast[(s.rank, s.sample)]) for s in result.samples) / fast.grad_norm
        same = [(s.rank, s.sample) for s in result.samples] == [(s.rank, s.sample) for s in fast.samples]
        a_sh, t_sh = median(times[f"sharded{n}"]["attribution"]), median(times[f"sharded{n}"]["total"])
        print(
            f"sharded over {n}: per-sample part {a_sh * 1e3:7.1f} ms ({a_sh / a_fast:.1f}x the jvp's, "
            f"{a_sh / a_naive:.2f}x one backward per sample whole), whole call {t_sh * 1e3:7.1f} ms "
            f"({t_sh / t_fast:.1f}x the unsharded jvp's); grad norm rel diff "
            f"{abs(result.grad_norm - fast.grad_norm) / fast.grad_norm:.1e}, max |sharded - jvp| / ||g|| {gap:.1e}, "
            f"same ranking {same}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
