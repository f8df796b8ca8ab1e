"""Every attempt against a task is logged, over MCP: a sweep runs around a config its check refuses (a value out of
range, a lever this snapshot cannot take), reports it in its place with the reason and logs it under Failed
attempts; a sweep whose every config is refused is an error naming each; a hypothesis replay is its own row even
when it leaves the grad norm as the baseline had it; a replay this snapshot refuses is logged as a failed attempt."""

from __future__ import annotations

from pathlib import Path

from server_helpers import JOB, SpikeOutputs, call, error_text, ok


def _open(workspace: Path, spike_outputs: SpikeOutputs) -> str:
    ok(call(workspace, "task_open", {"job": JOB, "snapshot": str(spike_outputs.snapshot)}))
    return str(spike_outputs.snapshot)


def test_a_sweep_runs_around_its_refused_configs_and_logs_each(spike_outputs: SpikeOutputs, workspace: Path) -> None:
    snapshot = _open(workspace, spike_outputs)
    configs = [{"advantage_clip": -1}, {"advantage_clip": 0.5}, {"recompute": "old_logprobs:rank5"}]
    sweep = ok(call(workspace, "sweep", {"snapshot": snapshot, "configs": configs, "nproc": 1, "plot": False}))
    value, clip, lever = sweep["results"]  # in the configs' order, the refused ones in their places
    assert clip["verdict"] != "failed" and clip["grad_norm"] is not None and clip["error"] is None
    assert value["verdict"] == "failed" and value["mitigations"] == {"advantage_clip": -1.0}
    assert value["error"] == "refused: mitigation advantage_clip: must be > 0, got -1"  # the argument and its value
    assert lever["verdict"] == "failed" and lever["grad_norm"] is None
    assert "recompute names rank 5, not in the snapshot (saved ranks 0..1)" in lever["error"]
    for refused in (value, lever):  # each has its result file beside the others
        assert (Path(sweep["output_dir"]) / refused["config_id"] / "replay_result.json").is_file()

    task = ok(call(workspace, "task_show", {"job": JOB}))
    assert [e["change"] for e in task["experiments"]] == ["baseline", "advantage_clip=0.5"]
    reasons = [f["reason"] for f in task["failed"]]
    assert reasons == [value["error"], lever["error"]]


def test_a_sweep_whose_every_config_is_refused_is_an_error_naming_each(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    snapshot = _open(workspace, spike_outputs)
    values = [{"advantage_clip": -1}, {"kl_coef": -2}]
    text = error_text(call(workspace, "sweep", {"snapshot": snapshot, "configs": values, "plot": False}))
    assert "every config of the sweep is refused" in text
    assert "config 1: mitigation advantage_clip: must be > 0, got -1" in text and "config 2: mitigation kl_coef" in text
    assert not (workspace / "tmp").exists()  # refused before anything ran

    levers = [{"recompute": "old_logprobs:rank5"}, {"drop_ranks": "7"}]
    text = error_text(call(workspace, "sweep", {"snapshot": snapshot, "configs": levers, "plot": False}))
    assert "every config of the sweep is refused" in text and "rank 5" in text and "7" in text
    assert not (workspace / "tmp").exists()
    [failed] = ok(call(workspace, "task_show", {"job": JOB}))["failed"]  # the attempt, refused by the snapshot
    assert failed["reason"].startswith("refused: every config of the sweep is refused")
    assert "drop_ranks=7" in failed["command"]


def test_a_hypothesis_replay_is_logged_even_when_its_norm_is_the_baseline_s(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    snapshot = _open(workspace, spike_outputs)
    base = ok(call(workspace, "replay", {"snapshot": snapshot, "nproc": 1}))
    same = ok(call(workspace, "replay", {"snapshot": snapshot, "nproc": 1, "mitigations": {"loss_scale": "1@1"}}))
    assert same["grad_norm"] == base["grad_norm"]  # a scale of 1 changes nothing: not a repeat of the baseline
    rows = ok(call(workspace, "task_show", {"job": JOB}))["experiments"]
    assert [(r["change"], r["verdict"]) for r in rows] == [
        ("baseline", base["verdict"]),
        ("hypothesis loss_scale=1@1", same["verdict"]),
    ]
    assert rows[1]["finding"] == same["finding"] and rows[1]["hypothesis"] == {
        "loss_scale": {"ranks": [1], "value": 1.0}
    }


def test_a_replay_this_snapshot_refuses_is_logged_as_a_failed_attempt(
    spike_outputs: SpikeOutputs, workspace: Path
) -> None:
    snapshot = _open(workspace, spike_outputs)
    text = error_text(call(workspace, "replay", {"snapshot": snapshot, "mitigations": {"drop_ranks": "4"}}))
    assert "drop_ranks: rank 4 is not in the snapshot (saved ranks 0..1)" in text
    [failed] = ok(call(workspace, "task_show", {"job": JOB}))["failed"]
    assert failed["reason"] == "refused: drop_ranks: rank 4 is not in the snapshot (saved ranks 0..1)"
    assert failed["command"].endswith("--mitigation drop_ranks=4") and failed["result_path"] is None
