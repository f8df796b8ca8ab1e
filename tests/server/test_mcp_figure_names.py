"""Through MCP the renamed figures read as in the files: attribute_spike answers with the attribution.json it
wrote, its figure named for both sides (`max_abs_log_ratio_current_vs_base` against `log_ratio_base`), and
diagnose_spike still reads an attribution.json written under the old name."""

from __future__ import annotations

import json
from pathlib import Path

from server_helpers import SpikeOutputs, call, ok


def test_attribute_spike_answers_with_the_file_it_wrote_and_an_old_file_still_reads(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    snapshot = str(spike_outputs.snapshot)
    answer = ok(call(workspace, "attribute_spike", {"snapshot": snapshot, "top": 2}))
    written = json.loads((Path(answer["output_dir"]) / "attribution.json").read_text())
    assert answer == written
    assert answer["log_ratio_base"] in ("old", "rollout")
    assert all("max_abs_log_ratio_current_vs_base" in s and "max_abs_log_ratio" not in s for s in answer["samples"])

    old = dict(written, samples=[])
    for s in written["samples"]:
        row = {k: v for k, v in s.items() if k != "max_abs_log_ratio_current_vs_base"}
        old["samples"].append({**row, "max_abs_log_ratio": s["max_abs_log_ratio_current_vs_base"]})
    old_file = workspace / "old-attribution.json"
    old_file.write_text(json.dumps(old))
    arguments = {"snapshot": snapshot, "attribution": str(old_file), "model": "never"}
    diagnosis = ok(call(workspace, "diagnose_spike", arguments))
    top = diagnosis["attribution_top"]
    assert [(r["rank"], r["sample"], r["max_abs_log_ratio_current_vs_base"]) for r in top] == [
        (s["rank"], s["sample"], s["max_abs_log_ratio_current_vs_base"]) for s in written["samples"]
    ]
    assert {r["log_ratio_base"] for r in top} == {written["log_ratio_base"]}


def test_replay_answers_with_the_rank_metrics_it_wrote_named_for_their_base(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    snapshot = str(spike_outputs.snapshot)
    answer = ok(call(workspace, "replay", {"snapshot": snapshot, "mitigations": {"is_base_logprobs": "old"}}))
    written = json.loads((Path(answer["output_dir"]) / "replay_result.json").read_text())
    assert answer["rank_metrics"] == written["rank_metrics"] and len(written["rank_metrics"]) == 2
    for metrics in written["rank_metrics"]:
        assert {"max_abs_log_ratio_current_vs_old", "kl_current_vs_ref"} <= set(metrics)
        assert not {"max_abs_log_ratio", "kl", "max_abs_log_ratio_current_vs_rollout"} & set(metrics)
