"""Streamed replay (one decoder layer at a time, every saved rank in one process) vs the whole and sharded replays.

The qwen3_moe of `bench_sharded_replay.py` (338 M parameters at its defaults: hidden 1024, 8 layers of 20 experts,
vocab 32 000, float32) is recorded at saved world size 4 by `axrl_spike_replay.testing.hf_snapshot` (the trainer's
own rank step; DCP weights), once per layer count asked (`--layers 8 16 32`: a longer model of the same width).
Each replay runs in a fresh process, side by side in one run:

- streamed (`shard: streamed`): one process, each layer read from the checkpoint in the forward and again in the
  backward, boundaries in host memory;
- whole (`shard: off`, one process holding every saved rank: the same sum, the whole model and its gradient held);
- sharded (`shard: on`, 4 processes, FSDP2), at the first layer count only.

Peak RSS is the replay process's `ru_maxrss` (the largest child's for the sharded run). Printed per row: wall, peak,
grad norm and its rel_diff to the whole replay's. Then the issue's figures:

- streamed peak <= 1.3 x (one layer's parameters and gradient + the embedding and head with theirs + one
  micro-batch's activations inside one layer + the step's boundaries) + the process floor (imports only, measured);
  the activations and boundaries are the replay plan's (`replay.streamed.streamed_plan`), the rest counted from the
  model's shapes;
- grad norm equal to the whole replay's (<= 1e-6 relative), wall streamed / whole (target <= 3x);
- a sweep of 4 configs streamed (one shared forward, a backward each) against 4 streamed replays of one config each,
  by wall and by CPU time (on a shared host the wall is mostly the host's load at the time);
- across layer counts: the streamed peak less its boundaries stays flat (<= 1.15x the first count's), while the
  whole replay's grows with the layers.

Usage: .venv/bin/python benchmarks/bench_streamed_replay.py [--workdir DIR] [--layers 8 16 32] [--hidden 1024]
       [--experts 20] [--vocab 32000] [--no-sweep] [--no-sharded] [--sweep-only] [--timeout SECONDS]
       [--response N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from axrl_spike_replay.testing.hf_snapshot import BATCH, PROMPT, RESPONSE
from bench_sharded_replay import CONFIG, FLOOR, parameters

CONFIGS = [{"mismatch_token_clip_max": 2}, {"kl_coef": 0.1}, {"advantage_clip": 0.5}, {"log_ratio_clip": 0.2}]

REPLAY = """
import json, resource, sys, time
def main():
    from axrl_spike_replay.investigation.request import How, What, Where, replay_request
    from axrl_spike_replay.replay.engine import run_replay
    from axrl_spike_replay.replay.sweep import run_sweep
    snapshot, nproc, shard, configs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    where = Where(timeout_s=float(sys.argv[5]) if len(sys.argv) > 5 else None)
    how = How(nproc=None if nproc == "-" else int(nproc), shard=shard)
    t = time.perf_counter()
    if len(configs) > 1:
        results = run_sweep(replay_request(What(snapshot, verb="sweep", configs=tuple(configs)), where, how))
        norm, verdict = results.baseline.grad_norm, results.baseline.verdict
        norms = [r.grad_norm for r in results.results]
    else:
        result = run_replay(replay_request(What(snapshot, mitigations=configs[0] if configs else {}), where, how))
        norm, verdict = result.baseline_grad_norm or result.grad_norm, result.verdict
        norms = [result.grad_norm] if configs else []
    wall = time.perf_counter() - t
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(u.ru_utime + u.ru_stime for u in used)
    print(json.dumps({"wall": wall, "self_mib": own, "children_mib": children, "grad_norm": norm, "verdict": verdict,
                      "norms": norms, "cpu": cpu}))
if __name__ == "__main__":
    main()
"""

RECORD = """
import json, sys
from pathlib import Path
from axrl_spike_replay.testing import hf_snapshot
config = json.loads(sys.argv[2])
hf_snapshot.RESPONSE = int(sys.argv[3])  # response tokens per sample (4 samples of 8 prompt tokens each, per rank)
print(json.dumps(str(hf_snapshot.record_hf_snapshot(Path(sys.argv[1]), "qwen3_moe", world_size=4, config=config))))
"""

PLAN = """
import json, sys
from pathlib import Path
from axrl_spike_replay.models.policy import parse_model_config
from axrl_spike_replay.replay.reading.inputs import read_run_config
from axrl_spike_replay.replay.plans.replay_plan import plan_replay
from axrl_spike_replay.replay.streamed.streamed_plan import model_pieces
plan = plan_replay(sys.argv[1], shard="streamed", capacity=None, measure_speeds=True)  # this host's speeds, measured
pieces = model_pieces(parse_model_config(read_run_config(Path(sys.argv[1]))["model"]))
row = plan.streamed
whole = plan_replay(sys.argv[1], nproc=1, shard="off").chosen  # against this machine's memory
capacity = plan_replay(sys.argv[1], nproc=1, shard="off").capacity
print(json.dumps({"activations": row.activations, "boundaries": row.boundaries, "layer": pieces.largest_layer,
                  "ends": pieces.embedding + pieces.head, "peak": row.device_peak, "runtime": row.runtime,
                  "estimate": row.seconds, "speeds": row.speeds,
                  "whole": f"peak {whole.memory.peak / 2**30:.2f} GiB per process against "
                           f"{capacity.bytes_each / 2**30 if capacity else 0:.2f} GiB usable: "
                           f"{'fits' if whole.fits else 'DOES NOT FIT'}" if whole else "none"}))
"""

CONFIG_ONLY = """
import json, sys
from pathlib import Path
from axrl_spike_replay.testing.config_only_snapshot import write_config_only_snapshot
from axrl_spike_replay.testing.hf_snapshot import BATCH, PROMPT, RESPONSE
config = json.loads(sys.argv[2])
write_config_only_snapshot(Path(sys.argv[1]), "qwen3_moe", config, world_size=4, batch=BATCH, seq=PROMPT + RESPONSE,
                           dtype="float32")
print(json.dumps({}))
"""

MIB = 1 << 20
TIMEOUT_S = 6 * 3600.0  # each replay's limit: a sweep at the issue's size on a loaded host runs past the default


def _sweep_rows(snapshot: Path, reference: float | None, timeout_s: float) -> None:
    """The sweep of `CONFIGS` streamed against one streamed replay per config: walls, peaks, each config's grad norm
    in both and their largest relative difference."""
    limit = str(timeout_s)
    sweep = _child(REPLAY, str(snapshot), "-", "streamed", json.dumps(CONFIGS), limit)
    _row(f"streamed sweep of {len(CONFIGS)}", sweep, sweep["self_mib"], reference)
    singles = []
    for config in CONFIGS:
        single = _child(REPLAY, str(snapshot), "-", "streamed", json.dumps([config]), limit)
        _row(f"streamed replay {next(iter(config))}", single, single["self_mib"], reference)
        singles.append(single)
    alone = sum(s["wall"] for s in singles)
    cpu = sum(s["cpu"] for s in singles)
    peaks = ", ".join(f"{s['self_mib']:.0f}" for s in singles)
    print(f"sweep of {len(CONFIGS)} streamed {sweep['wall']:.1f} s vs {len(CONFIGS)} streamed replays "
          f"{alone:.1f} s: **{sweep['wall'] / alone:.2f}x**; CPU time (the process's, imports included: a wall on a "
          f"shared host is mostly its load) {sweep['cpu']:.1f} s vs {cpu:.1f} s: **{sweep['cpu'] / cpu:.2f}x**; peak "
          f"RSS sweep {sweep['self_mib']:.0f} MiB, replays {peaks} MiB", flush=True)  # fmt: skip
    pairs = list(zip(sweep["norms"], (s["norms"][0] for s in singles), strict=True))
    for config, (in_sweep, alone_norm) in zip(CONFIGS, pairs, strict=True):
        print(f"  {json.dumps(config)}: grad norm in the sweep {in_sweep!r}, alone {alone_norm!r}, rel_diff "
              f"{abs(in_sweep - alone_norm) / abs(alone_norm):.1e}", flush=True)  # fmt: skip
    base = [s["grad_norm"] for s in singles]
    print(f"  baseline: sweep {sweep['grad_norm']!r}, replays {base!r}", flush=True)


def _child(code: str, *args: str, package: str | None = None) -> dict[str, float]:
    env = None
    if package is not None:  # the package root another version of the code is imported from
        env = {**os.environ, "PYTHONPATH": package + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _snapshot(workdir: Path, config: dict[str, object], response: int) -> Path:
    if not sorted(workdir.glob("iter_*")):
        workdir.mkdir(parents=True, exist_ok=True)
        _child(RECORD, str(workdir), json.dumps(config), str(response))
    return sorted(workdir.glob("iter_*"))[-1]


def _row(label: str, out: dict[str, float], peak: float, whole_norm: float | None) -> None:
    rel = "" if whole_norm is None else f", rel_diff to whole {abs(out['grad_norm'] - whole_norm) / whole_norm:.1e}"
    print(
        f"{label:>28}: wall {out['wall']:7.1f} s, peak RSS {peak:7.0f} MiB, grad norm {out['grad_norm']:.9g}{rel}, "
        f"{out['verdict']}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where the snapshots are written (kept; reused when there)")
    parser.add_argument("--layers", type=int, nargs="*", default=[CONFIG["num_hidden_layers"]])
    parser.add_argument("--hidden", type=int, default=CONFIG["hidden_size"])
    parser.add_argument("--experts", type=int, default=CONFIG["num_experts"])
    parser.add_argument("--vocab", type=int, default=CONFIG["vocab_size"])
    parser.add_argument("--no-sweep", action="store_true", help="leave out the sweep rows")
    parser.add_argument("--no-sharded", action="store_true", help="leave out the sharded row")
    parser.add_argument(
        "--response", type=int, default=RESPONSE, help=f"response tokens per sample (default {RESPONSE})"
    )
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep rows (at the first layer count)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, metavar="SECONDS", help="each replay's `timeout_s`")
    parser.add_argument("--no-whole", nargs="*", type=int, default=[], help="layer counts with no whole row")
    parser.add_argument(
        "--plan-only",
        nargs="*",
        type=int,
        default=[],
        help="layer counts too large to record here: the plan's whole and streamed rows of a config-only snapshot",
    )
    parser.add_argument(
        "--before", default=None, help="package root of an earlier version: its streamed row too, in the same run"
    )
    args = parser.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="axrl-bench-streamed-"))
    floor = _child(FLOOR)["self_mib"]
    print(f"process floor (imports only): {floor:.0f} MiB")
    flat: dict[int, tuple[float, float | None]] = {}
    for i, layers in enumerate(args.layers):
        config = {
            **CONFIG,
            "num_hidden_layers": layers,
            "hidden_size": args.hidden,
            "num_experts": args.experts,
            "vocab_size": args.vocab,
        }
        name = f"layers{layers}" if args.response == RESPONSE else f"layers{layers}-response{args.response}"
        snapshot = _snapshot(root / name, config, args.response)
        count = parameters(config)
        size = sum(p.stat().st_size for p in snapshot.glob("*.distcp"))
        tokens = BATCH * (PROMPT + args.response)
        described = (
            f"qwen3_moe {layers} layers, hidden {args.hidden}, {args.experts} experts, vocab {args.vocab}, "
            f"{tokens} tokens per rank ({BATCH} samples of {PROMPT} + {args.response})"
        )
        print(f"\n{described}: {count / 1e6:.0f} M parameters (float32), weights {size / MIB:.0f} MiB, world size 4")
        if args.sweep_only:
            _sweep_rows(snapshot, None, args.timeout)
            continue
        plan = _child(PLAN, str(snapshot))
        print(f"plan, whole on 1 process against this host: {plan['whole']}")
        if layers in args.no_whole:
            print(f"whole (1 process): not run at {layers} layers (the host's free memory; the plan's row above)")
            whole = None
        else:
            whole = _child(REPLAY, str(snapshot), "1", "off", "[]")
            _row("whole (1 process)", whole, whole["self_mib"], None)
        reference = whole["grad_norm"] if whole else None
        before = None
        if args.before:
            before = _child(REPLAY, str(snapshot), "-", "streamed", "[]", package=args.before)
            _row("streamed (before)", before, before["self_mib"], reference)
        streamed = _child(REPLAY, str(snapshot), "-", "streamed", "[]")
        _row("streamed", streamed, streamed["self_mib"], reference)
        if i == 0 and not args.no_sharded:
            sharded = _child(REPLAY, str(snapshot), "4", "on", "[]")
            _row("sharded (4 processes)", sharded, sharded["children_mib"], reference)
        held = 4 * (2 * plan["layer"] + 2 * plan["ends"]) / MIB  # float32 parameters and one gradient
        bound = 1.3 * (held + (plan["activations"] + plan["boundaries"]) / MIB) + floor
        peak = streamed["self_mib"]
        print(
            f"streamed peak {peak:.0f} MiB vs 1.3 x (layer + embedding and head, with gradients {held:.0f} + one "
            f"micro-batch in one layer {plan['activations'] / MIB:.0f} + boundaries {plan['boundaries'] / MIB:.0f}) "
            f"+ floor {floor:.0f} = {bound:.0f} MiB: **{peak / bound:.2f}x** of the bound "
            f"({'met' if peak <= bound else 'NOT met'}); plan's device peak {plan['peak'] / MIB:.0f} MiB"
        )
        print(f"plan's streamed time {plan['estimate']:.1f} s ({plan['speeds']}) vs the streamed wall "
              f"{streamed['wall']:.1f} s: wall / estimate {streamed['wall'] / plan['estimate']:.2f}x")  # fmt: skip
        if whole is not None:
            rel = abs(streamed["grad_norm"] - whole["grad_norm"]) / whole["grad_norm"]
            ratio = streamed["wall"] / whole["wall"]
            print(f"grad norm rel_diff streamed vs whole **{rel:.1e}** (target <= 1e-6); wall streamed / whole "
                  f"**{ratio:.2f}x** (target <= 3x)")  # fmt: skip
            if before is not None:
                print(f"wall streamed (before) / whole **{before['wall'] / whole['wall']:.2f}x**; streamed / "
                      f"streamed (before) **{streamed['wall'] / before['wall']:.2f}x**")  # fmt: skip
        flat[layers] = (peak - plan["boundaries"] / MIB, whole["self_mib"] if whole else None)
        if i == 0 and not args.no_sweep:
            _sweep_rows(snapshot, reference, args.timeout)
    for layers in args.plan_only:
        config = {
            **CONFIG,
            "num_hidden_layers": layers,
            "hidden_size": args.hidden,
            "num_experts": args.experts,
            "vocab_size": args.vocab,
        }
        where = root / f"plan{layers}"
        if not where.exists():
            _child(CONFIG_ONLY, str(where), json.dumps(config))
        plan = _child(PLAN, str(where))
        print(
            f"\nqwen3_moe {layers} layers, {parameters(config) / 1e6:.0f} M parameters, config only (no "
            f"snapshot recorded at this length here): plan, whole on 1 process against this host: "
            f"{plan['whole']}; streamed device peak {plan['peak'] / MIB:.0f} MiB (layer and the one read ahead, "
            f"ends, one micro-batch, runtime, boundaries {plan['boundaries'] / MIB:.0f} MiB; less boundaries "
            f"{(plan['peak'] - plan['boundaries']) / MIB:.0f} MiB)"
        )
    if len(flat) > 1:
        first = min(flat)
        first_whole = flat[first][1]
        for layers, (streamed_peak, whole_peak) in sorted(flat.items()):
            grew = "not run" if whole_peak is None else f"{whole_peak:.0f} MiB"
            if whole_peak is not None and first_whole:
                grew += f" ({whole_peak / first_whole:.2f}x)"
            print(f"{layers:3d} layers: streamed peak less boundaries {streamed_peak:.0f} MiB "
                  f"(**{streamed_peak / flat[first][0]:.2f}x** of {first} layers, target <= 1.15x); whole peak "
                  f"{grew}")  # fmt: skip


if __name__ == "__main__":
    main()
