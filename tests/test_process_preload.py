"""The process server imports a model kind's libraries before it forks rank processes, when asked: per job
(`warm_up(kinds)`, as `run_request` asks from the snapshot's run config) or by AXRL_PRELOAD. Real forkservers in
fresh launchers (a server's imports are fixed when it starts), real gloo groups."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.processes import process_starts

pytestmark = pytest.mark.processes

HF_MODULE = "transformers.models.qwen3_moe.modeling_qwen3_moe"
MEGATRON_MODULE = "megatron.core.transformer.moe.router"

LAUNCHER = """
import json, os, sys
from pathlib import Path
from axrl_spike_replay.processes.process_starts import warm_up
from axrl_spike_replay.processes.rank_processes import spawn_ranks

def report(rank, nproc, out):
    # first thing in the rank's work: what it found imported, and its parent (the server)'s threads
    found = {name: name in sys.modules for name in WATCHED}
    server = os.getppid()
    threads = len(os.listdir(f"/proc/{server}/task"))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"found": found, "server": server, "threads": threads}))

if __name__ == "__main__":
    kinds = tuple(kind for kind in sys.argv[2].split(",") if kind)
    if len(sys.argv) > 3:  # a replay of this snapshot first: the command asks the server for its model kind
        from axrl_spike_replay.cli import main
        assert main(["replay", sys.argv[3], "--nproc", "2", "--workspace", sys.argv[4], "--json"]) == 0
    else:
        warm_up(kinds)
    spawn_ranks(report, 2, sys.argv[1])
    print(json.dumps({"launcher_has": [m for m in WATCHED if m in sys.modules]}))
""".replace("WATCHED", repr((HF_MODULE, MEGATRON_MODULE, "transformers", "megatron.core")))


def _launch(
    tmp_path: Path, kinds: str, environment: dict[str, str] | None = None, replay: tuple[str, ...] = ()
) -> tuple[list[dict], dict, str]:
    out = tmp_path / (kinds or "none")
    out.mkdir()
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    env = {k: v for k, v in os.environ.items() if k not in ("AXRL_START_METHOD", process_starts.PRELOAD_ENV)}
    env.update({"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "mcp_server"), **(environment or {})})
    done = subprocess.run(
        [sys.executable, str(script), str(out), kinds, *replay], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    assert len(ranks) == 2
    return ranks, json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_an_hf_job_s_ranks_find_transformers_imported_and_the_server_runs_one_thread(tmp_path: Path) -> None:
    ranks, launcher, _ = _launch(tmp_path, "hf")
    assert all(rank["found"][HF_MODULE] and rank["found"]["transformers"] for rank in ranks)  # imported before fork
    assert not any(rank["found"]["megatron.core"] for rank in ranks)  # only the kind asked for
    assert all(rank["threads"] == 1 for rank in ranks)  # the imports started no thread in the server
    assert len({rank["server"] for rank in ranks}) == 1
    assert launcher["launcher_has"] == []  # the server imported them, not the launcher


def test_a_replay_asks_the_server_for_its_snapshot_s_model_kind(tmp_path: Path, hf_snapshot: Path) -> None:
    """`replay --nproc 2` of a transformers snapshot in a fresh process: the server it starts imported transformers
    (the ranks started after it find them imported) and no thread."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    ranks, _, _ = _launch(tmp_path, "", replay=(str(hf_snapshot), str(workspace)))
    assert all(rank["found"][HF_MODULE] and not rank["found"]["megatron.core"] for rank in ranks)
    assert all(rank["threads"] == 1 for rank in ranks)


def test_without_a_kind_the_ranks_import_no_model_library(tmp_path: Path) -> None:
    """The control: nothing on the rank's own path imports transformers before its work does."""
    ranks, _, _ = _launch(tmp_path, "")
    assert not any(rank["found"][HF_MODULE] or rank["found"]["transformers"] for rank in ranks)
    assert all(rank["threads"] == 1 for rank in ranks)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed here")
def test_axrl_preload_names_megatron_for_every_job_and_its_ranks_find_megatron_core(tmp_path: Path) -> None:
    ranks, _, stderr = _launch(tmp_path, "", {process_starts.PRELOAD_ENV: "megatron"})
    assert all(rank["found"][MEGATRON_MODULE] and rank["found"][HF_MODULE] for rank in ranks)
    assert "Warning" not in stderr, stderr[-2000:]  # its import-time warnings are not the launcher's to read
    assert all(rank["threads"] == 1 for rank in ranks)


def test_an_unknown_kind_in_axrl_preload_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(process_starts.PRELOAD_ENV, "hf,vllm")
    with pytest.raises(AxrlError, match=r"AXRL_PRELOAD: unknown model kind 'vllm'.*hf, megatron"):
        process_starts.preload_kinds()


def test_a_module_that_is_not_installed_is_left_out_quietly() -> None:
    name = "axrl_no_such_package.core"
    process_starts.import_installed((name, "json"))
    assert name not in sys.modules and "json" in sys.modules


def test_the_preload_list_is_the_base_then_the_kinds_modules_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(process_starts.PRELOAD_ENV, "hf, megatron")
    names = process_starts.preload_modules()
    assert names[: len(process_starts.PRELOAD)] == list(process_starts.PRELOAD)
    assert names[len(process_starts.PRELOAD) :] == [
        "axrl_spike_replay.models.hf_preload",
        "axrl_spike_replay.models.mcore.megatron_preload",
    ]
