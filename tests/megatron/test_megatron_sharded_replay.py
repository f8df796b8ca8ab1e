"""Route 1 sharded end to end: the snapshot megatron-core's own training loop wrote (EP=2, two gloo processes)
replays with the transformers policy sharded by FSDP2 over two gloo processes, each reading its rows straight
from the Megatron checkpoint, from the library and from the CLI. It reaches `reproduced` with the grad norm the
whole-model replay gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from megatron_helpers import cli_json

from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.vocabulary import Shard

pytestmark = pytest.mark.slow

# Both replays compute in float32 on CPU; sharded, each process holds its rows of every gradient and the shards'
# squared norms are summed across processes: another summation order, allowed a few ulps. Measured: the two norms
# equal (both 6.1e-10 from the recorded one); 1e-6 is the engine's bar for a full-fidelity CPU replay.
SHARDED_RTOL = 1e-6


def test_a_sharded_replay_reproduces_the_whole_model_replay(
    megatron_capture: Path, megatron_route1_replay: ReplayResult
) -> None:
    whole = megatron_route1_replay  # shard auto: the tiny model fits, so whole
    sharded = run_replay(replay_request(What(megatron_capture), how=How(shard=Shard.ON)))
    assert whole.verdict == sharded.verdict == "reproduced", (sharded.grad_norm, sharded.recorded_grad_norm)
    assert sharded.sharded and not whole.sharded
    assert (sharded.fidelity, sharded.world_size_used) == ("full", 2)
    assert whole.grad_norm is not None and sharded.grad_norm is not None
    assert abs(sharded.grad_norm - whole.grad_norm) / whole.grad_norm < SHARDED_RTOL
    assert {m["rank"] for m in sharded.rank_metrics} == {0, 1}


def test_the_cli_replays_a_megatron_snapshot_sharded(megatron_capture: Path, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    argv = ["replay", str(megatron_capture), "--shard", "on", "--workspace", str(workspace)]
    doc = cli_json([*argv, "--json"], cwd=tmp_path)  # the CLI's main in this process
    assert (doc["verdict"], doc["fidelity"], doc["world_size_used"], doc["sharded"]) == ("reproduced", "full", 2, True)
    assert doc["rel_diff"] < SHARDED_RTOL
    (result,) = workspace.glob("tmp/spike-replay/*/*/replay_result.json")
    assert "--shard on" in (result.parent / "command.txt").read_text()
    assert json.loads(result.read_text())["sharded"] is True
