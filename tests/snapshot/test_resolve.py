"""An engineer knows a job name and finds its role output dirs and logs under the output roots."""

from __future__ import annotations

from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.snapshot.discovery import resolve_job


def _role_dir(root: Path, name: str, logs: list[str]) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    for log in logs:
        (directory / log).parent.mkdir(parents=True, exist_ok=True)
        (directory / log).write_text("iteration 1/ 10 | grad norm: 1.0 |\n")
    return directory


def test_finds_every_role_of_a_job_with_its_logs_across_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    actor = _role_dir(root_a, "20250101~moe-grpo__actor", ["logs/train.log", "logs/rank1/worker.log"])
    critic = _role_dir(root_b, "20250101~moe-grpo__critic", ["critic.log"])
    _role_dir(root_a, "20250101~other-job__actor", ["train.log"])
    _role_dir(root_a, "20250101~moe-grpo-v2__actor", ["train.log"])  # a different job, same prefix
    monkeypatch.setenv("AXRL_OUTPUT_ROOTS", f"{root_b}:")

    found = resolve_job("moe-grpo", [root_a])

    assert [(r.role, Path(r.output_dir)) for r in found.roles] == [("actor", actor), ("critic", critic)]
    assert found.roles[0].logs == [str(actor / "logs/rank1/worker.log"), str(actor / "logs/train.log")]
    assert found.roles[1].logs == [str(critic / "critic.log")]
    assert found.roots == [str(root_a), str(root_b)]


def test_the_golden_capture_resolves_with_its_training_log(golden_outputs: Path, cli) -> None:
    run = cli("resolve", "fixture-moe", "--root", golden_outputs, "--json")
    assert run.code == 0
    doc = run.json()
    assert doc["job"] == "fixture-moe"
    assert [r["role"] for r in doc["roles"]] == ["actor"]
    assert doc["roles"][0]["logs"] == [str(golden_outputs / "fx~fixture-moe__actor" / "logs" / "train.log")]
    assert set(doc["roles"][0]) >= {"role", "output_dir", "logs"}


def test_an_unknown_job_names_the_roots_it_searched(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AXRL_OUTPUT_ROOTS", raising=False)
    with pytest.raises(AxrlError, match="no output directories for job 'ghost'") as err:
        resolve_job("ghost", [tmp_path, tmp_path / "nowhere"])
    assert str(tmp_path) in str(err.value) and "nowhere (missing)" in str(err.value)

    run = cli("resolve", "ghost", "--root", tmp_path)
    assert run.code == 2 and run.out == ""
    assert "ghost" in run.err and str(tmp_path) in run.err and "Traceback" not in run.err


def test_a_run_name_given_as_the_job_names_the_jobs_the_roots_hold(golden_outputs: Path) -> None:
    with pytest.raises(AxrlError, match="no output directories for job 'fx~fixture-moe'") as err:
        resolve_job("fx~fixture-moe", [golden_outputs])
    assert "'fixture-moe'" in str(err.value) and "'<run>~<job>__<role>' is job <job>" in str(err.value)


def test_readable_summary_lists_roles_and_logs(golden_outputs: Path, cli) -> None:
    run = cli("resolve", "fixture-legacy", "--root", golden_outputs)
    assert run.code == 0
    assert "job fixture-legacy: 1 output dir(s)" in run.out
    assert "train.log" in run.out
