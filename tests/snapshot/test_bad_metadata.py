"""Malformed metadata, checkpoint metadata and rank files: every verb that reads them gives a clear error naming
the file and what is wrong (exit status 2), never a traceback."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
from axrl_spike_replay.snapshot.layout import AXRL_METADATA, CHECKPOINT_METADATA, SNAPSHOTS_DIR
from axrl_spike_replay.snapshot.listing import list_snapshots
from axrl_spike_replay.snapshot.metadata import read_metadata

BAD_METADATA = {
    "non-utf8": (b'{"job_name": "\xff\xfe"}', "not UTF-8 text"),
    "nested-100k": (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper than 32 levels"),
    "infinite-iteration": (b'{"iteration": Infinity, "grad_norm": 1.0}', "iteration must be an integer"),
    "5000-digit-int": (b'{"iteration": ' + b"9" * 5000 + b', "grad_norm": 1.0}', "an integer of 5000 digits"),
    "parallel-list": (b'{"iteration": 1, "grad_norm": 1.0, "parallel": [2, 1]}', "'parallel' must be an object"),
    "world-size-string": (
        b'{"iteration": 1, "grad_norm": 1.0, "parallel": {"world_size": "2"}}',
        "parallel.world_size must be an integer",
    ),
    "grad-norm-string": (b'{"iteration": 1, "grad_norm": "big"}', "grad_norm must be a number"),
    "detector-window-float": (
        b'{"iteration": 1, "grad_norm": 1.0, "detector": {"window": 2.5}}',
        "detector.window must be an integer",
    ),
    "oversized": (b'{"iteration": 1, "grad_norm": 1.0, "pad": "' + b"x" * (2 * 1024**2) + b'"}', "-byte limit"),
}


def _snapshot(make_output_dir) -> Path:
    return make_output_dir() / SNAPSHOTS_DIR / "iter_0000042"


@pytest.mark.parametrize("case", sorted(BAD_METADATA))
def test_bad_metadata_json_is_a_clear_error_for_every_verb(make_output_dir, cli, case: str) -> None:
    content, message = BAD_METADATA[case]
    snap = _snapshot(make_output_dir)
    (snap / AXRL_METADATA).write_bytes(content)

    with pytest.raises(SnapshotError, match=message):
        read_metadata(snap)
    for verb in ("inspect", "analyze", "grads"):
        run = cli(verb, snap)
        assert run.code == 2, (verb, run.err)
        assert f"{snap / AXRL_METADATA}:" in run.err and message in run.err and "Traceback" not in run.err
    [entry] = [s for s in list_snapshots(snap.parent.parent.parent).snapshots if s.path == str(snap)]
    assert entry.problem is not None and message in entry.problem


def test_the_spike_guard_s_own_non_finite_norms_are_accepted(make_output_dir) -> None:
    """A NaN grad norm is the spike to investigate: the writer saves NaN/Infinity in the norm fields."""
    snap = _snapshot(make_output_dir)
    text = (snap / AXRL_METADATA).read_text()
    (snap / AXRL_METADATA).write_text(text.replace('"grad_norm": 40.0', '"grad_norm": NaN'))
    meta, _ = read_metadata(snap)
    assert meta.grad_norm != meta.grad_norm and meta.iteration == 42


@pytest.mark.parametrize("case", ["infinite-iteration", "parallel-list", "nested-100k"])
def test_bad_legacy_metadata_is_a_clear_error_for_prepare(make_output_dir, cli, tmp_path: Path, case: str) -> None:
    content, message = BAD_METADATA[case]
    snap = _snapshot(make_output_dir)
    (snap / AXRL_METADATA).unlink()
    (snap / CHECKPOINT_METADATA).write_bytes(content.replace(b"{", b'{"job_name": "j", ', 1))

    run = cli("prepare", snap, "--dest", tmp_path / "replay")

    assert run.code == 2 and f"{snap / CHECKPOINT_METADATA}:" in run.err and message in run.err
    assert "Traceback" not in run.err and not (tmp_path / "replay").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (pickle.dumps({"state_dict_metadata": {}}), "not DCP checkpoint metadata (it holds a dict)"),
        (pickle.dumps([1, 2]), "not DCP checkpoint metadata (it holds a list)"),
        (b"\x80\x04junk", "truncated or corrupt checkpoint metadata"),
    ],
)
def test_checkpoint_metadata_that_is_not_dcp_metadata(make_output_dir, cli, content: bytes, message: str) -> None:
    snap = _snapshot(make_output_dir)
    (snap / ".metadata").write_bytes(content)

    result = inspect_snapshot(snap)
    run = cli("inspect", snap)

    assert result.model is None and any(p.startswith(f"{snap / '.metadata'}: {message}") for p in result.problems)
    assert run.code == 0 and message in run.out and "Traceback" not in run.err


def test_a_string_grad_norm_is_a_problem_for_inspect_and_an_error_for_grads(make_output_dir, cli) -> None:
    snap = _snapshot(make_output_dir)
    info = torch.load(snap / "grad_info_rank0.pt", weights_only=True)
    info["grad_norm"] = "huge"
    torch.save(info, snap / "grad_info_rank0.pt")

    problems = inspect_snapshot(snap).problems
    run = cli("grads", snap)

    assert f"{snap / 'grad_info_rank0.pt'}: grad_norm must be a number, got str 'huge'" in problems
    assert run.code == 2 and "grad_info_rank0.pt: grad_norm must be a number" in run.err
    assert "Traceback" not in run.err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"moe_layers": "ab"}, "'moe_layers' must be a list of layer ids"),
        ({"moe_layers": [0, True]}, "'moe_layers' must be a list of layer ids"),
        ({"source": ["rollout"]}, "'source' must be a short string"),
        ({"routed_experts": torch.full((4, 16, 2, 2), 2**40)}, "expert id 1099511627776 in routed_experts"),
    ],
)
def test_a_malformed_routing_payload_is_a_clear_error(make_output_dir, cli, change: dict, message: str) -> None:
    snap = _snapshot(make_output_dir)
    payload = torch.load(snap / "routing_payload_rank1.pt", weights_only=True)
    payload.update(change)
    torch.save(payload, snap / "routing_payload_rank1.pt")

    run = cli("analyze", snap)
    assert run.code == 2 and f"{snap / 'routing_payload_rank1.pt'}:" in run.err and message in run.err
    assert "Traceback" not in run.err
    if "expert id" not in message:  # inspect counts routes without indexing by expert id
        assert any(message in p for p in inspect_snapshot(snap).problems)
