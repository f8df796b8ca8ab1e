"""The MCP tools on a transformers MoE snapshot (the session's tiny qwen3_moe, saved world size 2), through the
in-process client as an agent calls them: inspect and analyze read its routing payload, the baseline replay is
bit-identical to the recorded step at full fidelity, a sweep judges a loss-level and a routing config (`first`
resolved to the model's layer), and attribution sums to the grad norm. One server serves every call, so the sweep
and the attribution reuse the replay's warm processes and weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mcp import Client
from server_helpers import ok, with_client

from axrl_spike_replay.server import create_server
from axrl_spike_replay.testing.hf_snapshot import BURST

JOB = "hf-qwen3_moe"  # the snapshot's job name


def _calls(workspace: Path, calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each tool call's structured result, in order, from one server session."""

    async def body(client: Client) -> list[dict[str, Any]]:
        return [ok(await client.call_tool(tool, arguments)) for tool, arguments in calls]

    return with_client(create_server(workspace), body)


def test_the_tools_read_replay_sweep_and_attribute_an_hf_snapshot(hf_snapshot: Path, workspace: Path) -> None:
    snapshot = str(hf_snapshot)
    configs = [{"kl_coef": 0}, {"current_routing_layers": "first"}]
    seen, batch, replay, sweep, attribution = _calls(
        workspace,
        [
            ("inspect_snapshot", {"snapshot": snapshot}),
            ("analyze_batch", {"snapshot": snapshot, "top": 3}),
            ("replay", {"snapshot": snapshot}),
            ("sweep", {"snapshot": snapshot, "configs": configs}),
            ("attribute_spike", {"snapshot": snapshot, "top": 2}),
        ],
    )

    assert (seen["job_name"], seen["world_size"], seen["problems"]) == (JOB, 2, [])
    assert [r["routing_payload_counts"] for r in seen["ranks"]] == [{"0": 160, "1": 160}] * 2  # per MoE layer
    assert batch["routing"]["moe_layers"] == [0, 1] and batch["routing"]["num_experts_seen"] == 8
    worst = batch["outliers"]["tokens_by_abs_log_ratio_old_vs_rollout"]
    assert {(t["rank"], t["sample"]) for t in worst} <= set(BURST)  # the samples whose rollout logprobs are off

    assert replay["fidelity"] == "full" and replay["world_size_used"] == 2
    assert replay["grad_norm"] == replay["recorded_grad_norm"] and replay["verdict"] == "reproduced"
    assert replay["top_params"][0]["name"].startswith(("model.", "lm_head."))  # transformers' own names
    result_file = Path(replay["output_dir"]) / "replay_result.json"
    assert json.loads(result_file.read_text())["grad_norm"] == replay["grad_norm"]

    assert sweep["fidelity"] == "full" and sweep["baseline"]["grad_norm"] == replay["grad_norm"]
    kl, first = sweep["results"]
    assert kl["mitigations"] == {"kl_coef": 0.0} and first["mitigations"] == {"current_routing_layers": "first"}
    assert first["resolved_mitigations"] == {"current_routing_layers": [0]}
    for row in (kl, first):
        assert row["grad_norm"] != replay["grad_norm"], row["config_id"]
        written = json.loads((Path(sweep["output_dir"]) / row["config_id"] / "replay_result.json").read_text())
        assert written["resolved_mitigations"] == row["resolved_mitigations"]

    assert attribution["total_samples"] == 8 and len(attribution["samples"]) == 2
    assert attribution["sum_rel_error"] <= 1e-4
    assert abs(attribution["grad_norm"] - replay["grad_norm"]) <= 1e-5 * replay["grad_norm"]
