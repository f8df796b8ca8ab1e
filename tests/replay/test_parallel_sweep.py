"""A sweep spread over two pools gives the same results and the same result files as one pool running every
config one after another."""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from result_files import result_files, stable

CONFIGS = [
    {"mismatch_token_clip_max": 2},
    {"ratio_outlier_mask": True},
    {"advantage_clip": 0.5},
    {"routing_replay": "off"},
    {"loss_agg_mode": "seq-mean-token-sum"},
]


@pytest.mark.slow  # two sweeps, one of them with a spawned replay process
def test_a_sweep_on_two_pools_matches_the_sweep_on_one(spike_snapshot: Path, tmp_path: Path) -> None:
    runs = {}
    lines: list[str] = []
    for pools in (1, 2):
        ws = tmp_path / f"ws{pools}"
        ws.mkdir()
        request = replay_request(
            What(spike_snapshot, verb="sweep", configs=CONFIGS),
            how=How(nproc=1, parallel_configs=pools),
            workspace=ws,
            progress=lines.append if pools == 2 else None,
        )
        runs[pools] = run_request(request)
    one, two = runs[1], runs[2]
    assert any("on 2 pools" in line for line in lines), lines
    assert [r.config_id for r in two.results] == [r.config_id for r in one.results]
    assert stable(two.to_json()) == stable(one.to_json())  # bit-identical grad norms, verdicts and figures
    assert two.results[-1].cosine_to_clean == one.results[-1].cosine_to_clean is not None
    assert result_files(two.output_dir) == result_files(one.output_dir)
