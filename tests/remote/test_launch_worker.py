"""The worker's side of a launch: rank and world from torchrun's environment, the request from argv[1], rank 0's
result written atomically (other ranks write nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.processes.launch_worker import worker_context, write_result
from axrl_spike_replay.remote.launchers.launch_job import request_document

TORCHRUN_ENV = {
    "RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "gpu-017",
    "MASTER_PORT": "29500",
}


def request(tmp_path: Path) -> Path:
    path = tmp_path / "request.json"
    doc = request_document("axrl-0123456789ab", str(tmp_path / "out" / "result.json"), {"snapshot": "/s/iter_1"})
    path.write_text(json.dumps(doc))
    return path


def test_rank0_writes_the_result_atomically_and_the_others_write_nothing(tmp_path: Path) -> None:
    path = request(tmp_path)
    ctx = worker_context(["worker", str(path)], TORCHRUN_ENV)
    assert (ctx.rank, ctx.world_size, ctx.local_world_size, ctx.master_addr, ctx.master_port) == (
        0, 4, 2, "gpu-017", 29500,
    )  # fmt: skip
    assert ctx.payload == {"snapshot": "/s/iter_1"} and ctx.launch_id == "axrl-0123456789ab"
    other = worker_context(["worker", str(path)], {**TORCHRUN_ENV, "RANK": "3", "GROUP_RANK": "1"})
    assert write_result(other, {"grad_norm": 2.0}) is None and not (tmp_path / "out").exists()
    written = write_result(ctx, {"grad_norm": 1.5})
    assert written == tmp_path / "out" / "result.json" and json.loads(written.read_text()) == {"grad_norm": 1.5}
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["result.json"]  # no temp file left beside it


@pytest.mark.parametrize(
    ("argv", "env", "text", "says"),
    [
        (None, {k: v for k, v in TORCHRUN_ENV.items() if k != "RANK"}, None, "RANK not set: this module is a torchrun"),
        ([], TORCHRUN_ENV, None, "no request file"),
        (None, {**TORCHRUN_ENV, "WORLD_SIZE": "four"}, None, "WORLD_SIZE='four' in the environment"),
        (None, TORCHRUN_ENV, '{"format": "other"}', "not a launch request"),
        (None, TORCHRUN_ENV, "[" * 200, "cannot read it (nests deeper"),
    ],
)
def test_a_worker_started_wrongly_says_what_is_missing(
    tmp_path: Path, argv: list[str] | None, env: dict, text: str | None, says: str
) -> None:
    path = request(tmp_path)
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        worker_context(["worker", *([str(path)] if argv is None else argv)], env)
