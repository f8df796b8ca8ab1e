"""Megatron-core checkpoints and snapshots written by megatron-core's own code, once per test session.

Every test here needs megatron-core (installed by scripts/setup.sh without its CUDA extras); where it is not
installed, or is a release these routes were not checked against, they skip and say why.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from megatron_helpers import REASON, CliRun, cli_json, more_layouts

from axrl_spike_replay.investigation.request import What, replay_request

if TYPE_CHECKING:
    from axrl_spike_replay.experiment.result import ReplayResult


@pytest.fixture(scope="session")
def megatron_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{layout: checkpoint dir} of the tiny Qwen3-MoE GPTModel saved by `dist_checkpointing.save` at TP=1 (one
    process), TP=2 (with ETP=2), EP=2 and PP=2 (two processes each): the same global weights in each.

    Shared by the session: copy a checkpoint before editing it."""
    if REASON is not None:
        pytest.skip(REASON)
    from axrl_spike_replay.testing.megatron_checkpoints import save_layouts, tiny_section

    return save_layouts(tmp_path_factory.mktemp("megatron-checkpoints"), tiny_section())


@pytest.fixture(scope="session")
def megatron_capture(megatron_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The snapshot the Megatron spike guard wrote when megatron-core's own model, trained at EP=2 over two gloo
    processes (Megatron's DDP, the reference checkpoint resharded by `dist_checkpointing.load`), spiked at step 6.

    Shared by the session: copy it before editing it."""
    from megatron_trainer import train

    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

    root = tmp_path_factory.mktemp("megatron-capture") / "checkpoints" / "spike_snapshots"
    payload = (tiny_section(), str(megatron_checkpoints["tp1"]), str(root), 8, 6, 2, "megatron-ep2")
    spawn_ranks(train, 2, payload, timeout_s=600.0, label="megatron training")
    snapshots = sorted(root.glob("iter_*"))
    assert [p.name for p in snapshots] == ["iter_0000006"], "the guard trips at the burst step only"
    return snapshots[0]


@pytest.fixture(scope="session")
def megatron_route1_replay(megatron_capture: Path) -> ReplayResult:
    """The default replay (route 1: the snapshot's checkpoint in the transformers policy) of `megatron_capture`,
    run once for the tests that read it or hold another replay against it. It writes nothing."""
    from axrl_spike_replay.replay.engine import run_replay

    return run_replay(replay_request(What(megatron_capture)))


@pytest.fixture(scope="session")
def megatron_cli_route2(megatron_capture: Path, tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    """`axrl-spike-replay replay SNAPSHOT --backend megatron --workspace WS --json` of `megatron_capture`, run once
    (the CLI's main in this process; its argv names the console script, for a real process's refusal): the CLI
    face's route 2 (test_megatron_faces) and the cold run a warm one must equal (test_megatron_warm). Its workspace
    holds that one run; add nothing to it."""
    workspace = tmp_path_factory.mktemp("megatron-cli-route2") / "ws"
    workspace.mkdir()
    script = Path(sys.executable).parent / "axrl-spike-replay"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "axrl_spike_replay"]
    argv += ["replay", str(megatron_capture), "--backend", "megatron"]
    doc = cli_json([*argv[argv.index("replay") :], "--workspace", str(workspace), "--json"], cwd=workspace)
    return CliRun(workspace, argv, doc)


@pytest.fixture(scope="session")
def deepseek_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"tp1": checkpoint dir} of a tiny DeepSeek-V3 GPTModel (MLA with q/kv LoRA ranks, a dense first layer,
    a shared expert, a sigmoid router with expert bias and group-limited top-k) saved by `dist_checkpointing.save`
    from one process. Shared: copy before editing."""
    if REASON is not None:
        pytest.skip(REASON)
    from axrl_spike_replay.testing.megatron_checkpoints import save_layouts, tiny_section

    return save_layouts(tmp_path_factory.mktemp("deepseek-checkpoints"), tiny_section("deepseek_v3"), ("tp1",))


@pytest.fixture(scope="session")
def deepseek_layouts(
    deepseek_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """`deepseek_checkpoints` and the same weights saved at EP=2 and TP=2 (with ETP=2) by two processes, for the
    matrix's layout tests. Shared: copy before editing."""
    return more_layouts("deepseek_v3", deepseek_checkpoints, tmp_path_factory.mktemp("deepseek-layouts"))


@pytest.fixture(scope="session")
def deepseek_capture(deepseek_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The snapshot the Megatron spike guard wrote when megatron-core's own DeepSeek-V3 model, trained at EP=2 over
    two gloo processes, spiked at step 6. Shared: copy before editing."""
    from megatron_trainer import train

    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

    root = tmp_path_factory.mktemp("deepseek-capture") / "checkpoints" / "spike_snapshots"
    payload = (tiny_section("deepseek_v3"), str(deepseek_checkpoints["tp1"]), str(root), 8, 6, 2, "deepseek-ep2")
    spawn_ranks(train, 2, payload, timeout_s=600.0, label="megatron training")
    snapshots = sorted(root.glob("iter_*"))
    assert [p.name for p in snapshots] == ["iter_0000006"], "the guard trips at the burst step only"
    return snapshots[0]
