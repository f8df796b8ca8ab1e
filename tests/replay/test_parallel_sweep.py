"""A sweep spread over two pools gives the same results and the same result files as one pool running every
config one after another."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from axrl_spike_replay.investigation.request import replay_request
from axrl_spike_replay.investigation.runs import run_request

CONFIGS = [
    {"mismatch_token_clip_max": 2},
    {"ratio_outlier_mask": True},
    {"advantage_clip": 0.5},
    {"routing_replay": "off"},
    {"loss_agg_mode": "seq-mean-token-sum"},
]
VOLATILE = {"timings", "created_at", "output_dir"}  # when and where it ran, not what it found


def _stable(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _stable(v) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [_stable(v) for v in doc]
    return doc


def _result_files(output_dir: str) -> dict[str, Any]:
    root = Path(output_dir)
    return {str(p.relative_to(root)): _stable(json.loads(p.read_text())) for p in sorted(root.rglob("*.json"))}


@pytest.mark.slow  # two sweeps, one of them with a spawned replay process
def test_a_sweep_on_two_pools_matches_the_sweep_on_one(spike_snapshot: Path, tmp_path: Path) -> None:
    runs = {}
    lines: list[str] = []
    for pools in (1, 2):
        ws = tmp_path / f"ws{pools}"
        ws.mkdir()
        request = replay_request(
            spike_snapshot,
            verb="sweep",
            configs=CONFIGS,
            nproc=1,
            parallel_configs=pools,
            workspace=ws,
            progress=lines.append if pools == 2 else None,
        )
        runs[pools] = run_request(request)
    one, two = runs[1], runs[2]
    assert any("on 2 pools" in line for line in lines), lines
    assert [r.config_id for r in two.results] == [r.config_id for r in one.results]
    assert _stable(two.to_json()) == _stable(one.to_json())  # bit-identical grad norms, verdicts and figures
    assert two.results[-1].cosine_to_clean == one.results[-1].cosine_to_clean is not None
    assert _result_files(two.output_dir) == _result_files(one.output_dir)
