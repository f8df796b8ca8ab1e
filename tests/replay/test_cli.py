"""The CLI verbs as people and scripts use them: replay, sweep, attribute."""

from __future__ import annotations

import json
import multiprocessing
import re
from pathlib import Path

import pytest

from axrl_spike_replay.cli import main
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay


def test_replay_json_prints_the_result_file(spike_snapshot: Path, workspace: Path, capsys) -> None:
    status = main(["replay", str(spike_snapshot), "--nproc", "1", "--workspace", str(workspace), "--json"])
    out, err = capsys.readouterr()
    assert status == 0
    doc = json.loads(out)  # exactly one JSON document on stdout
    assert doc["fidelity"] == "full" and doc["verdict"] == "reproduced"  # one process replays both saved ranks
    assert json.loads((Path(doc["output_dir"]) / "replay_result.json").read_text()) == doc
    assert "fidelity full" in err  # progress goes to stderr


def test_replay_for_people_labels_a_replay_on_fewer_processes(spike_snapshot: Path, workspace: Path, capsys) -> None:
    args = ["replay", str(spike_snapshot), "--nproc", "1", "--workspace", str(workspace)]
    assert main([*args, "--mitigation", "mismatch_token_clip_max=2", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "full (1 process(es) replay the 2 saved ranks, several each in turn)" in out
    assert "mismatch_token_clip_max=2.0" in out and "cleared" in out
    [change] = [line for line in out.splitlines() if line.strip().startswith("vs baseline")]
    assert re.fullmatch(r"  vs baseline   grad norm \S+ -> \S+ \([+-]\d+\.\d%\)", change), change
    assert "2 runs, spread 0" in out
    [run] = (workspace / "tmp" / "spike-replay" / "fixture-moe").iterdir()
    command = (run / "command.txt").read_text()
    assert "--mitigation mismatch_token_clip_max=2.0" in command and "--repeat 2" in command


def test_sweep_prints_a_table_of_configs(spike_snapshot: Path, workspace: Path, tmp_path: Path, capsys) -> None:
    configs = tmp_path / "set.yaml"
    configs.write_text("- {mismatch_token_clip_max: 2}\n- {advantage_clip: 0.5, dual_clip_c: 3}\n")
    argv = [
        "sweep",
        str(spike_snapshot),
        "--nproc",
        "1",
        "--workspace",
        str(workspace),
        "--mitigation-set",
        str(configs),
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert any(line.startswith("baseline") and "reproduced" in line for line in lines)
    [tis] = [line.split() for line in lines if line.startswith("mismatch_token_clip_max=2")]
    assert tis[-1] == "cleared" and tis[-2].endswith("%")
    assert f"({tis[-2]} vs baseline" in err  # the progress line and the table say the change alike, in percent
    assert any(line.startswith("advantage_clip=0.5+dual_clip_c=3") for line in lines)
    assert "several each in turn" in out and "REDUCED" not in out


def test_sweep_json_with_one_config_per_mitigation_option(spike_snapshot: Path, workspace: Path, capsys) -> None:
    argv = ["sweep", str(spike_snapshot), "--nproc", "1", "--workspace", str(workspace), "--json"]
    argv += ["--mitigation", "advantage_clip=0.5", "--mitigation", "ratio_outlier_mask=sequence kl_coef=0"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["baseline"]["config_id"] == "baseline"
    assert doc["results"][0]["mitigations"] == {"advantage_clip": 0.5}
    assert set(doc["results"][1]["mitigations"]) == {"ratio_outlier_mask", "kl_coef"}
    for r in doc["results"]:
        assert {"grad_norm", "spike_ratio", "change_vs_baseline", "verdict"} <= set(r)


def test_attribute_lists_the_top_samples(spike_snapshot: Path, workspace: Path, capsys) -> None:
    assert main(["attribute", str(spike_snapshot), "--top", "3", "--workspace", str(workspace), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["samples"]) == 3 and doc["grad_norm"] > 0
    assert main(["attribute", str(spike_snapshot), "--top", "2", "--workspace", str(workspace)]) == 0
    out = capsys.readouterr().out
    assert "contribution" in out and "top 2 of" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "{snap}", "--mitigation", "bogus=1"], "valid mitigations:"),
        (["replay", "{snap}", "--nproc", "5"], "larger than the saved world size 2"),
        (["replay", "{ws}/nowhere"], "snapshot directory not found"),
        (["sweep", "{snap}", "--mitigation-set", "{ws}/missing.yaml"], "cannot read mitigation set"),
        (["attribute", "{snap}", "--top", "0"], "--top must be an integer >= 1"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    spike_snapshot: Path, workspace: Path, capsys, argv: list[str], message: str
) -> None:
    argv = [a.format(snap=spike_snapshot, ws=workspace) for a in argv] + ["--workspace", str(workspace)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert message in err and "Traceback" not in err and out == ""
    assert not (workspace / "tmp").exists()


@pytest.mark.parametrize(("nproc", "spawns"), [(1, False), (2, True)])
def test_a_one_process_replay_runs_in_the_calling_process(spike_snapshot: Path, nproc: int, spawns: bool) -> None:
    children_seen: list[int] = []  # child processes of this replay alive whenever a progress line arrives
    before = {child.pid for child in multiprocessing.active_children()}  # the session's warm pools, if up

    def progress(line: str) -> None:
        children_seen.append(len({child.pid for child in multiprocessing.active_children()} - before))

    result = run_replay(replay_request(What(spike_snapshot), how=How(nproc=nproc), progress=progress))
    assert result.verdict == "reproduced" and children_seen
    assert any(children_seen) is spawns, children_seen


def test_a_clear_threshold_of_the_users_judges_the_replay_on_the_command_line(
    spike_snapshot: Path, workspace: Path, capsys
) -> None:
    # mismatch_token_clip_max=2 clears this spike under the detector's threshold 5 (ratio to median about 1.4);
    # under the user's stricter 1.0 it is still a spike, at under half the baseline's norm: partial
    args = ["replay", str(spike_snapshot), "--nproc", "1", "--workspace", str(workspace)]
    args += ["--mitigation", "mismatch_token_clip_max=2", "--clear-threshold", "1.0"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "partial" and doc["threshold"] == 1.0
    assert 1.0 <= doc["spike_ratio"] < 5.0
    basis = doc["verdict_basis"]
    assert basis["threshold_source"] == "clear_threshold" and basis["detector_threshold"] == 5.0
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "(your clear threshold 1)" in out and "verdict       partial" in out


@pytest.mark.parametrize("value", ["0", "-2", "nan", "inf"])
def test_a_clear_threshold_that_is_no_spike_ratio_is_refused_by_name(
    spike_snapshot: Path, workspace: Path, capsys, value: str
) -> None:
    status = main(["replay", str(spike_snapshot), "--workspace", str(workspace), "--clear-threshold", value])
    err = capsys.readouterr().err
    assert status == 2 and "--clear-threshold must be a finite spike ratio > 0" in err  # spelled as the option
    assert "`" not in err and "Traceback" not in err
    assert not (workspace / "tmp").exists()  # refused before anything ran


def test_the_cli_renders_the_typed_result_and_its_json_round_trips_byte_for_byte(
    spike_snapshot: Path, workspace: Path, capsys
) -> None:
    from axrl_spike_replay.cli.replay_commands import render_replay
    from axrl_spike_replay.experiment.result import ReplayResult
    from axrl_spike_replay.experiment.verdict import BaselineBasis
    from axrl_spike_replay.jsonable import to_jsonable
    from axrl_spike_replay.snapshot.consistency import Consistency

    assert main(["replay", str(spike_snapshot), "--nproc", "1", "--workspace", str(workspace), "--json"]) == 0
    text = (Path(json.loads(capsys.readouterr().out)["output_dir"]) / "replay_result.json").read_text()
    doc = json.loads(text)
    result = ReplayResult.from_json(doc)
    assert isinstance(result.consistency, Consistency) and result.consistency.checked == doc["consistency"]["checked"]
    assert isinstance(result.verdict_basis, BaselineBasis) and result.verdict_basis.tolerance == doc["tolerance"]
    assert json.dumps(to_jsonable(result), indent=2) + "\n" == text  # the result file, key for key, from the typed one

    shown = render_replay(result).splitlines()
    own = "agrees with itself" if doc["consistency"]["self_consistent"] else "DISAGREES with itself"
    assert any(line.startswith(f"  snapshot      {own}; ") for line in shown)
    [checks] = [line for line in shown if line.startswith("  checks        ")]
    assert checks.startswith(f"  checks        {len(doc['consistency']['checked'])} checks: ")
    problems = [line for line in shown if line.startswith("  problem       [")]
    assert problems == [f"  problem       [{p['name']}] {p['message']}" for p in doc["consistency"]["problems"]]


def test_a_mitigated_results_footprint_and_precision_are_typed_and_written_as_before(
    spike_snapshot: Path, workspace: Path, capsys
) -> None:
    from axrl_spike_replay.cli.replay_commands import render_replay
    from axrl_spike_replay.experiment.result import Footprint, ReplayResult
    from axrl_spike_replay.experiment.verdict import MitigatedBasis
    from axrl_spike_replay.jsonable import to_jsonable
    from axrl_spike_replay.training.precision import PrecisionPolicy

    args = ["replay", str(spike_snapshot), "--nproc", "1", "--workspace", str(workspace), "--json"]
    assert main([*args, "--mitigation", "mismatch_token_clip_max=2"]) == 0
    text = (Path(json.loads(capsys.readouterr().out)["output_dir"]) / "replay_result.json").read_text()
    doc = json.loads(text)
    result = ReplayResult.from_json(doc)
    assert isinstance(result.footprint, Footprint) and isinstance(result.precision, PrecisionPolicy)
    assert isinstance(result.verdict_basis, MitigatedBasis) and list(doc["verdict_basis"]) == list(
        vars(result.verdict_basis)
    )
    assert list(doc["footprint"]) == list(vars(result.footprint))  # the keys the file has always held, in order
    assert isinstance(doc["footprint"]["loss_tokens"], int) and result.footprint.loss_tokens > 0
    assert list(doc["precision"]) == ["param_dtype", "reduce_dtype", "output_dtype", "source"]
    assert json.dumps(to_jsonable(result), indent=2) + "\n" == text
    f = result.footprint
    assert f.token_fraction == (f.masked_tokens + f.changed_tokens) / f.loss_tokens
    [line] = [line for line in render_replay(result).splitlines() if line.startswith("  footprint     ")]
    assert f"({f.masked_tokens} masked, {f.changed_tokens} changed of {f.loss_tokens})" in line


def test_a_sweep_prints_a_refused_config_in_its_row_with_the_reason(
    spike_snapshot: Path, workspace: Path, tmp_path: Path, cli
) -> None:
    """A config the checks refuse (a value out of range, a rank the snapshot lacks) is a row of the table, with its
    reason under it; the others run. From --mitigation items and from a mitigation-set file alike."""
    run = cli("sweep", spike_snapshot, "--nproc", "1", "--workspace", workspace, "--mitigation", "advantage_clip=-1",
              "--mitigation", "advantage_clip=1", "--mitigation", "drop_ranks=5")  # fmt: skip
    assert run.code == 0, run.err
    rows: dict[str, list[str]] = {}
    for line in run.out.splitlines():  # the table's rows come first, the reasons under it
        if line.strip():
            rows.setdefault(line.split()[0], line.split())
    assert rows["advantage_clip=-1"][-1] == "failed" and rows["drop_ranks=5"][-1] == "failed"
    assert rows["advantage_clip=1"][-1] != "failed" and len(rows["advantage_clip=1"]) == 5  # it ran: its figures
    assert "advantage_clip=-1 failed: refused: mitigation advantage_clip: must be > 0, got '-1'" in run.out
    assert "drop_ranks=5 failed: refused: drop_ranks: rank 5 is not in the snapshot (saved ranks 0..1)" in run.out

    configs = tmp_path / "set.yaml"
    configs.write_text("- {kl_coef: 0.5}\n- {kl_coef: -1}\n", encoding="utf-8")
    run = cli("sweep", spike_snapshot, "--nproc", "1", "--workspace", workspace, "--mitigation-set", configs, "--json")
    assert run.code == 0, run.err
    ran, refused = json.loads(run.out)["results"]
    assert ran["verdict"] != "failed" and refused["error"] == "refused: mitigation kl_coef: must be >= 0, got -1"

    configs.write_text("- {kl_coef: -1}\n", encoding="utf-8")  # the only config refused: the sweep is an error
    run = cli("sweep", spike_snapshot, "--nproc", "1", "--workspace", workspace, "--mitigation-set", configs)
    assert run.code != 0 and "mitigation kl_coef: must be >= 0, got -1" in run.err and "Traceback" not in run.err
