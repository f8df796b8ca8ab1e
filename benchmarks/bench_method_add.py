#!/usr/bin/env python3
"""`method add` end to end (a fresh CLI process) quoting the recorded figures vs recomputing its key signals.

The workspace is the demo's kind: a copy of the golden fixture job (reference run, ratio_outliers, world size 2),
a task opened on its spike snapshot (diagnosed from the static evidence), a baseline replay and a cleared
`mismatch_token_clip_max=2` replay. Ours: `axrl-spike-replay method add ... --replace`. The naive way, as
`method add` did before it quoted the recorded figures: the same command plus the batch analysis and the
attribution replay of the snapshot in the same process. Runs alternate, medians.

Usage: .venv/bin/python benchmarks/bench_method_add.py [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from replay_spike import median, timed

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "outputs" / "fx~fixture-moe__actor"
JOB = "fixture-moe"
NAIVE = """
import sys
from pathlib import Path
from axrl_spike_replay.cli import main
from axrl_spike_replay.analysis.batch_signals import analyze_snapshot
from axrl_spike_replay.experiment.request.request_parts import ReplayRequest, What
from axrl_spike_replay.replay.analyses.attribution import attribute_spike
from axrl_spike_replay.vocabulary import Verb
code = main(sys.argv[2:])
analyze_snapshot(sys.argv[1], top=3)
attribute_spike(ReplayRequest(what=What(Path(sys.argv[1]), verb=Verb.ATTRIBUTE, top=3)))
sys.exit(code)
"""


def workspace_with_a_cleared_replay(root: Path) -> tuple[Path, str]:
    """(snapshot, attempt id of the cleared replay) in the workspace `root`."""
    from axrl_spike_replay.investigation.request import What, replay_request
    from axrl_spike_replay.investigation.runs import run_request
    from axrl_spike_replay.investigation.task_opening import open_task
    from axrl_spike_replay.workspace.task_record.task_state import show_task

    output = root / "outputs" / FIXTURE.name
    shutil.copytree(FIXTURE, output)
    snapshot = sorted((output / "checkpoints" / "spike_snapshots").glob("iter_*"))[-1]
    open_task(root, JOB, snapshot)
    run_request(replay_request(What(snapshot), workspace=root, job=JOB))
    run_request(replay_request(What(snapshot, mitigations={"mismatch_token_clip_max": 2}), workspace=root, job=JOB))
    cleared = [e for e in show_task(root, JOB).experiments if e.verdict == "cleared"]
    return snapshot, cleared[-1].id


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "mcp_server")}
    with tempfile.TemporaryDirectory(prefix="bench-method-add-") as tmp:
        root = Path(tmp)
        snapshot, attempt = workspace_with_a_cleared_replay(root)
        args = ["method", "add", "--workspace", str(root), "--job", JOB, "--attempt", attempt, "--name", "tis-2"]
        args += ["--rationale", "caps each token's importance weight at 2", "--replace"]
        ours = [sys.executable, "-m", "axrl_spike_replay", *args]
        naive = [sys.executable, "-c", NAIVE, str(snapshot), *args]
        seconds: dict[str, list[float]] = {"ours": [], "naive": []}
        for _ in range(runs):
            for label, command in (("ours", ours), ("naive", naive)):
                elapsed, _ = timed(lambda c=command: subprocess.run(c, env=env, check=True, capture_output=True))
                seconds[label].append(elapsed)
        signals = (root / "spike-mitigation-methods" / "tis-2.md").read_text().split("## Key signals")[1]
        quoted = [line for line in signals.split("## Change")[0].splitlines() if line.startswith("- ")]
    fast, slow = median(seconds["ours"]), median(seconds["naive"])
    print(f"method add, fresh process, medians of {runs}: quoting the recorded figures {fast:.2f} s vs recomputing")
    print(f"the key signals (batch analysis + attribution replay) {slow:.2f} s: {slow / fast:.1f}x")
    print(f"key signals quoted ({len(quoted)} lines):")
    print("\n".join(f"  {line}" for line in quoted))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
