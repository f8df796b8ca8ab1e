#!/usr/bin/env python3
"""A sweep of 8 loss-level mitigations in one run vs 8 separate `replay` commands, side by side.

Both replay the demo's spike (reference run, ratio_outliers, world size 2) at full fidelity with the
CLI (`python -m axrl_spike_replay`). The sweep loads the weights once and forwards each rank batch
once for all 8 configs plus the baseline; each separate command starts Python, spawns its rank
processes, loads the weights and forwards (baseline + its mitigation). The grad norms must agree.
Also shown: the same comparison inside one Python process (library calls), which isolates the
shared weights/forward from process start-up.

Usage: .venv/bin/python benchmarks/bench_sweep.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from axrl_spike_replay.experiment.mitigation.mitigations import mitigation_args, parse_config
from axrl_spike_replay.investigation.request import What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.sweep import run_sweep
from axrl_spike_replay.vocabulary import Verb
from replay_spike import capture_demo_spike, timed

CONFIGS = [
    {"mismatch_token_clip_max": 2.0},
    {"ratio_outlier_mask": True},
    {"advantage_clip": 1.0},
    {"log_ratio_clip": 1.0},
    {"is_base_logprobs": "old"},
    {"dual_clip_c": 3.0},
    {"loss_agg_mode": "seq-mean-token-mean"},
    {"balance_negative_advantages": True},
]


def cli(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "axrl_spike_replay", *args, "--json"], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        root = Path(tmp)
        snapshot = str(capture_demo_spike(root))
        ws = root / "ws"
        ws.mkdir()
        set_file = root / "set.yaml"
        set_file.write_text(yaml.safe_dump([parse_config(c) for c in CONFIGS]))
        common = ("--workspace", str(ws))

        sweep_s, sweep = timed(lambda: cli("sweep", snapshot, "--mitigation-set", str(set_file), *common))
        separate: list[dict] = []
        separate_s, _ = timed(
            lambda: [
                separate.append(cli("replay", snapshot, *common, *[f"--mitigation={a}" for a in mitigation_args(c)]))
                for c in map(parse_config, CONFIGS)
            ]
        )
        for one, shared in zip(separate, sweep["results"], strict=True):
            assert one["grad_norm"] == shared["grad_norm"], (one["config_id"], one["grad_norm"], shared["grad_norm"])

        lib_sweep_s, _ = timed(
            lambda: run_sweep(replay_request(What(Path(snapshot), verb=Verb.SWEEP, configs=tuple(CONFIGS))))
        )
        lib_separate_s, _ = timed(
            lambda: [run_replay(replay_request(What(Path(snapshot), mitigations=c))) for c in CONFIGS]
        )

    print(
        f"snapshot: demo spike, fidelity {sweep['fidelity']}, baseline grad norm {sweep['baseline']['grad_norm']:.6g}"
    )
    print(
        f"CLI:     1 sweep (8 configs + baseline) {sweep_s:6.2f} s   vs 8 replay commands {separate_s:6.2f} s"
        f"   -> {separate_s / sweep_s:.1f}x faster (target >= 4x); grad norms identical"
    )
    print(
        f"library: run_sweep                      {lib_sweep_s:6.2f} s   vs 8 run_replay calls {lib_separate_s:6.2f} s"
        f"   -> {lib_separate_s / lib_sweep_s:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
