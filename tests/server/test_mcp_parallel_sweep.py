"""An agent's sweep spread over two pools (`parallel_configs=2`) gives the same verdicts, figures and result files
as the same sweep on one pool, on a warm server and on one started with `--no-warm`; a bad value is a tool error
naming `parallel_configs`, in the request builder's words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from server_helpers import SpikeOutputs, call, error_text, ok, with_client

from axrl_spike_replay.server import create_server
from result_files import result_files, stable

CONFIGS = [{"advantage_clip": 0.5}, {"loss_agg_mode": "seq-mean-token-mean"}]


def _sweep(workspace: Path, snapshot: Path, pools: int, *, warm: bool) -> tuple[dict[str, Any], list[str]]:
    """One sweep of CONFIGS (one process per pool) on a fresh server: its structured result and progress lines."""
    lines: list[str] = []

    async def body(client: Client) -> Any:
        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            lines.append(message or "")

        arguments = {"snapshot": str(snapshot), "configs": CONFIGS, "nproc": 1, "parallel_configs": pools}
        return await client.call_tool("sweep", {**arguments, "plot": False}, progress_callback=on_progress)

    return ok(with_client(create_server(workspace, warm=warm), body)), lines


@pytest.mark.slow  # three sweeps, two of them starting a second replay process
def test_a_sweep_on_two_pools_gives_the_one_pool_results_warm_and_cold(
    spike_outputs: SpikeOutputs, tmp_path: Path
) -> None:
    runs = {}
    for pools, warm in ((1, True), (2, True), (2, False)):
        workspace = tmp_path / f"ws-{pools}-{'warm' if warm else 'cold'}"
        workspace.mkdir()
        runs[pools, warm] = _sweep(workspace, spike_outputs.snapshot, pools, warm=warm)
    one, _ = runs[1, True]
    assert not any("pools of" in line for line in runs[1, True][1]), runs[1, True][1]
    for key in ((2, True), (2, False)):
        two, lines = runs[key]
        assert any("on 2 pools" in line for line in lines), (key, lines)
        assert [r["config_id"] for r in two["results"]] == [r["config_id"] for r in one["results"]]
        assert stable(two) == stable(one), key  # bit-identical grad norms, verdicts and figures
        assert result_files(two["output_dir"]) == result_files(one["output_dir"]), key


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"parallel_configs": 0}, "`parallel_configs` must be an integer >= 1, got 0"),
        ({"parallel_configs": "x"}, "parallel_configs\n  Input should be a valid integer"),
        (
            {"parallel_configs": 2, "backend": "command"},
            "`parallel_configs` spreads a sweep's configs over pools of the built-in torch engine run here",
        ),
        (
            {"parallel_configs": 2, "target": "gpu-node-7"},
            "`parallel_configs` spreads a sweep's configs over pools of the built-in torch engine run here",
        ),
    ],
)
def test_a_bad_parallel_configs_is_a_tool_error_naming_it(
    arguments: dict[str, Any], expected: str, spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    text = error_text(
        call(workspace, "sweep", {"snapshot": str(spike_outputs.snapshot), "configs": CONFIGS, **arguments})
    )
    assert expected in text, text
    assert not (workspace / "tmp").exists()  # refused before anything ran or was written
