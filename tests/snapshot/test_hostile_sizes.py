"""Sizes a snapshot's files declare never size the tool's work: a world size of 10^9, a tensor declaring GBs,
a zip bomb or a checkpoint declaring huge tensors is reported by name, with memory bounded by what is on disk."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.completeness import missing_ranks, missing_required, rank_ranges_text
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR
from axrl_spike_replay.snapshot.safe_load import load_pt
from hostile_snapshot import (
    declare_checkpoint_tensor,
    declare_world_size,
    write_broadcast_batch,
    write_compressed_tensor_file,
    write_lying_tensor_file,
)

GIB = 1024**3
MEMORY_LIMIT = 3 * GIB  # address space for a child that inspects a hostile snapshot: torch needs ~0.7 GiB


def _snapshot(make_output_dir) -> Path:
    return make_output_dir() / SNAPSHOTS_DIR / "iter_0000042"


def _inspect_in_a_bounded_child(snapshot: Path) -> dict:
    """inspect_snapshot in a fresh process limited to MEMORY_LIMIT of address space and 60 s."""
    code = (
        "import json, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"
        "from axrl_spike_replay.snapshot.inspect import inspect_snapshot\n"
        "r = inspect_snapshot(sys.argv[1])\n"
        "print(json.dumps({'ranks': [k.rank for k in r.ranks], 'problems': r.problems}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(snapshot)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_missing_ranks_are_ranges_computed_from_the_files_present() -> None:
    assert missing_ranks([0, 1], 10**9) == [(2, 10**9 - 1)]
    assert missing_ranks([0, 2, 5, 7], 8) == [(1, 1), (3, 4), (6, 6)]
    assert rank_ranges_text([(1, 1), (3, 4), (6, 9)]) == "[1, 3, 4, 6-9]"
    many = [(i, i) for i in range(0, 40, 2)]
    assert rank_ranges_text(many).endswith(", ... 12 more]")


def test_a_world_size_of_a_billion_costs_what_the_files_cost(make_output_dir) -> None:
    snap = _snapshot(make_output_dir)
    declare_world_size(snap, 10**9)

    result = _inspect_in_a_bounded_child(snap)

    assert result["ranks"] == [0, 1]  # one row per rank with files, never one per declared rank
    expected = f"no batch_rank<r>.pt for ranks [2-999999999] (world size {10**9})"
    assert any(expected in p for p in result["problems"])
    assert all(len(p) < 1000 for p in result["problems"])
    [incomplete] = [m for m in missing_required(snap) if "batch_rank" in m]
    assert "[2-999999999]" in incomplete


def test_a_world_size_of_a_billion_through_the_cli(make_output_dir, cli) -> None:
    snap = _snapshot(make_output_dir)
    declare_world_size(snap, 10**9)
    run = cli("grads", snap)
    assert run.code == 0 and "no grad info for ranks [2-999999999]" in run.out


def test_a_zip_bomb_grad_info_is_refused_not_expanded(make_output_dir, cli) -> None:
    snap = _snapshot(make_output_dir)
    write_compressed_tensor_file(snap / "grad_info_rank0.pt", "grad_norm", 64 * 1024**2)
    assert (snap / "grad_info_rank0.pt").stat().st_size < 1024**2

    problems = "\n".join(inspect_snapshot(snap).problems)
    run = cli("grads", snap)

    assert f"{snap / 'grad_info_rank0.pt'}: record" in problems and "is compressed" in problems
    assert run.code == 2 and "grad_info_rank0.pt" in run.err and "compressed" in run.err
    assert "Traceback" not in run.err


def test_a_tensor_declaring_more_storage_than_its_file_is_refused_by_name(make_output_dir, cli) -> None:
    snap = _snapshot(make_output_dir)
    write_lying_tensor_file(snap / "grad_info_rank1.pt", "grad_norm", 3 * GIB)

    with pytest.raises(SnapshotError, match=r"grad_info_rank1\.pt: tensor \['grad_norm'\] declares shape .*3\.0 GiB"):
        load_pt(snap / "grad_info_rank1.pt")
    problems = "\n".join(inspect_snapshot(snap).problems)
    assert "grad_info_rank1.pt: tensor ['grad_norm'] declares shape (805306368,)" in problems
    run = cli("grads", snap)
    assert run.code == 2 and "more than the file's" in run.err and "Traceback" not in run.err


def test_a_broadcast_batch_tensor_declaring_terabytes_is_refused(make_output_dir, cli) -> None:
    snap = _snapshot(make_output_dir)
    write_broadcast_batch(snap / "batch_rank0.pt", 10**6, 10**6)

    problems = "\n".join(inspect_snapshot(snap).problems)
    run = cli("analyze", snap)

    assert "batch_rank0.pt: tensor ['tokens'] declares shape (1000000, 1000000) (7.3 TiB)" in problems
    assert run.code == 2 and "batch_rank0.pt" in run.err and "Traceback" not in run.err


def test_a_legacy_pickle_is_refused_before_it_can_declare_any_size(make_output_dir) -> None:
    import torch

    snap = _snapshot(make_output_dir)
    torch.save({"grad_norm": 1.0}, snap / "grad_info_rank0.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(SnapshotError, match=r"not in torch's zip format .* re-save it with torch\.save"):
        load_pt(snap / "grad_info_rank0.pt")


def test_a_checkpoint_declaring_huge_tensors_is_a_problem_naming_it(make_output_dir, cli) -> None:
    snap = _snapshot(make_output_dir)
    declare_checkpoint_tensor(snap, (10**6, 10**6))

    result = inspect_snapshot(snap)
    run = cli("inspect", snap, "--json")

    problems = "\n".join(result.problems)
    assert "tensor 'model.embed.weight' declares shape (1000000, 1000000) (3.6 TiB) but its data files hold" in problems
    assert result.model is not None and result.model.bytes > 10**12  # what it declares, shown as declared
    assert run.code == 0 and any("model.embed.weight" in p for p in run.json()["problems"])


def test_a_world_size_of_a_billion_in_a_child_with_the_old_cost_would_not_fit() -> None:
    """The bound in the child is real: a set of 10^9 ranks does not fit in MEMORY_LIMIT."""
    code = (
        "import resource\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"
        "set(range(10**9))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and "MemoryError" in done.stderr
    assert resource.RLIMIT_AS  # the limit exists on this platform
