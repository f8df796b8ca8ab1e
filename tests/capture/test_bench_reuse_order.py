"""`bench_diagnosis --reuse` diagnoses the snapshot a fresh capture would: the burst's largest spike (a non-finite
step first), not the earliest burst snapshot. Three snapshots of one kept run, told apart only by their metadata."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import yaml

from axrl_spike_replay.testing.fault_matrix import burst_snapshots

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
SNAPSHOT = FIXTURE / "checkpoints" / "spike_snapshots" / "iter_0000021"
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_diagnosis.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_diagnosis_reuse", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _kept_run(case_dir: Path, ratios: dict[int, float], burst: list[int]) -> tuple[list[Path], dict]:
    taken = []
    for iteration, ratio in ratios.items():
        snapshot = case_dir / FIXTURE.name / "checkpoints" / "spike_snapshots" / f"iter_{iteration:07d}"
        shutil.copytree(SNAPSHOT, snapshot)
        meta = json.loads((snapshot / "axrl_metadata.json").read_text())
        meta.update(iteration=iteration, spike_ratio=ratio, grad_norm=ratio * meta["median_norm"])
        (snapshot / "axrl_metadata.json").write_text(json.dumps(meta))
        config = yaml.safe_load((snapshot / "run_config.yaml").read_text())
        config["train"]["burst"] = burst
        (snapshot / "run_config.yaml").write_text(yaml.safe_dump(config))
        taken.append(snapshot)
    return taken, config


def test_a_kept_capture_is_diagnosed_at_the_same_snapshot_as_a_fresh_one(tmp_path: Path) -> None:
    # the earliest burst step is the mildest; a larger spike outside the burst is the run's own
    taken, config = _kept_run(tmp_path, {20: 6.0, 21: 9.0, 22: 7.0, 25: 50.0}, [20, 21, 22])
    kept = _bench().kept_snapshots(tmp_path)
    fresh = burst_snapshots(SimpleNamespace(config=config, snapshot_dirs=taken), "any")
    assert [p.name for p in kept] == [p.name for p in fresh] == ["iter_0000021", "iter_0000022", "iter_0000020"]


def test_a_non_finite_burst_step_is_first_in_both(tmp_path: Path) -> None:
    taken, config = _kept_run(tmp_path, {20: 6.0, 21: math.nan, 22: 7.0}, [20, 21, 22])
    kept = _bench().kept_snapshots(tmp_path)
    fresh = burst_snapshots(SimpleNamespace(config=config, snapshot_dirs=taken), "any")
    assert [p.name for p in kept] == [p.name for p in fresh] == ["iter_0000021", "iter_0000022", "iter_0000020"]
