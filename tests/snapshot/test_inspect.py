"""An engineer inspects a snapshot: the spike, the layout, per-rank counts and the model size, read from
headers and small tensors; every inconsistency is listed under `problems`."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.dcp.checkpoint import summarize_checkpoint
from axrl_spike_replay.snapshot.inspect import inspect_snapshot
from axrl_spike_replay.snapshot.layout import AXRL_METADATA, SNAPSHOTS_DIR, batch_file
from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot


def test_golden_capture_is_described_exactly(golden_snapshot: Path, cli) -> None:
    run = cli("inspect", golden_snapshot, "--json")
    assert run.code == 0
    doc = run.json()
    assert doc["iteration"] == int(golden_snapshot.name.removeprefix("iter_"))
    assert doc["job_name"] == "fixture-moe" and doc["role"] == "actor"
    assert (doc["world_size"], doc["tp"], doc["pp"], doc["dp"], doc["ep"], doc["etp"]) == (2, 1, 1, 2, 1, 1)
    assert doc["spike_ratio"] == pytest.approx(doc["grad_norm"] / doc["median_norm"], rel=1e-6)
    assert doc["legacy_metadata"] is False and doc["problems"] == []
    summary = summarize_checkpoint(golden_snapshot)
    assert doc["model"] == {"tensors": summary.tensors, "bytes": summary.bytes}
    for rank_doc in doc["ranks"]:
        rank = rank_doc["rank"]
        batch = torch.load(golden_snapshot / batch_file(rank), weights_only=True)
        routes = torch.load(golden_snapshot / f"routing_payload_rank{rank}.pt", weights_only=True)
        assert rank_doc["batch_file"] == str(golden_snapshot / batch_file(rank))
        assert rank_doc["num_samples"] == batch["tokens"].shape[0]
        assert rank_doc["num_loss_tokens"] == int((batch["loss_mask"] != 0).sum())
        routed = (routes["routed_experts"] >= 0).any(-1).sum((0, 1)).tolist()
        assert rank_doc["routing_payload_counts"] == {
            str(layer): n for layer, n in zip(routes["moe_layers"], routed, strict=True)
        }
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]


def test_legacy_snapshot_is_flagged(golden_legacy_snapshot: Path, cli) -> None:
    result = inspect_snapshot(golden_legacy_snapshot)
    assert result.legacy_metadata is True and result.problems == []
    assert result.job_name == "fixture-legacy"
    assert "LEGACY metadata" in cli("inspect", golden_legacy_snapshot).out


def test_readable_summary_leads_with_the_spike(golden_snapshot: Path, cli) -> None:
    out = cli("inspect", golden_snapshot).out
    first = out.splitlines()[0]
    iteration = int(golden_snapshot.name.removeprefix("iter_"))
    assert first.startswith(f"iteration {iteration} of job fixture-moe (actor): grad norm") and "x the median" in first
    assert "routed tokens per MoE layer" in out and "no problems found" in out


def _snapshot(make_output_dir) -> Path:
    return make_output_dir() / SNAPSHOTS_DIR / "iter_0000042"


def test_missing_and_extra_rank_files_are_problems(make_output_dir) -> None:
    snap = _snapshot(make_output_dir)
    (snap / "batch_rank1.pt").unlink()
    shutil.copy(snap / "grad_info_rank0.pt", snap / "grad_info_rank2.pt")
    problems = inspect_snapshot(snap).problems
    assert any("no batch_rank<r>.pt for ranks [1] (world size 2)" in p for p in problems)
    assert any("grad_info_rank<r>.pt files for ranks [2] beyond the world size 2" in p for p in problems)


def test_truncated_and_missing_files_are_problems_naming_them(make_output_dir) -> None:
    snap = _snapshot(make_output_dir)
    data = (snap / "grad_info_rank1.pt").read_bytes()
    (snap / "grad_info_rank1.pt").write_bytes(data[: len(data) // 2])
    (snap / "routing_payload_rank0.pt").unlink()
    (snap / ".metadata").unlink()

    result = inspect_snapshot(snap)

    problems = "\n".join(result.problems)
    assert f"{snap / 'grad_info_rank1.pt'}: truncated or corrupt torch file" in problems
    assert "routing payloads only for ranks [1]" in problems
    assert f"{snap / '.metadata'}: missing" in problems
    assert result.model is None
    assert result.ranks[0].routing_payload_counts is None and result.ranks[1].routing_payload_counts is not None
    assert result.ranks[1].grad_norm is None and result.ranks[1].num_loss_tokens == 36


def test_world_size_disagreeing_with_the_files(make_output_dir) -> None:
    snap = _snapshot(make_output_dir)
    meta = (
        (snap / AXRL_METADATA).read_text().replace('"world_size": 2', '"world_size": 4').replace('"dp": 2', '"dp": 4')
    )
    (snap / AXRL_METADATA).write_text(meta)
    problems = inspect_snapshot(snap).problems
    assert any("no batch_rank<r>.pt for ranks [2, 3] (world size 4)" in p for p in problems)


@pytest.mark.parametrize("zip_format", [True, False], ids=["torch-zip", "raw-pickle"])
def test_a_malicious_pickle_is_refused_and_nothing_in_it_runs(
    make_output_dir, tmp_path: Path, cli, write_malicious_pt, zip_format: bool
) -> None:
    snap = _snapshot(make_output_dir)
    marker = tmp_path / "pwned"
    write_malicious_pt(snap / "batch_rank0.pt", marker, zip_format=zip_format)

    result = inspect_snapshot(snap)
    run = cli("inspect", snap, "--json")

    assert not marker.exists()
    (problem,) = [p for p in result.problems if "batch_rank0.pt" in p]
    assert problem.startswith(f"{snap / 'batch_rank0.pt'}: refused to load") and "nothing in it was run" in problem
    assert run.code == 0 and any("refused to load" in p for p in run.json()["problems"])
    assert not marker.exists()


def test_not_a_snapshot_is_an_error_without_traceback(tmp_path: Path, cli) -> None:
    with pytest.raises(SnapshotError, match="not a spike snapshot"):
        inspect_snapshot(tmp_path)
    run = cli("inspect", tmp_path / "missing")
    assert run.code == 2 and "snapshot directory not found" in run.err and "Traceback" not in run.err


def _resident_fraction(path: Path) -> float | None:
    """Fraction of `path`'s pages in the page cache, by mincore(2) over a fresh read-only mapping."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        vec = ctypes.create_string_buffer(pages)
        status = libc.mincore(address, size, vec)
        libc.munmap(address, size)
    finally:
        os.close(fd)
    if status != 0:
        return None
    return sum(b & 1 for b in vec.raw) / pages


def test_inspect_reads_headers_and_small_tensors_not_the_large_ones(tmp_path: Path) -> None:
    """A batch file with a 64 MiB activation tensor: after inspect, almost none of it is in memory."""
    spec = SyntheticSpec(world_size=1, extra_tensors={"hidden_states": (4, 16, 262_144)})
    snap = write_synthetic_snapshot(tmp_path / "run1~big__actor" / SNAPSHOTS_DIR, spec)
    big = snap / "batch_rank0.pt"
    fd = os.open(big, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evict the file from the page cache
    finally:
        os.close(fd)
    before = _resident_fraction(big)
    if before is None or before > 0.05:
        pytest.skip("cannot observe or evict page-cache residency here")

    result = inspect_snapshot(snap)

    assert result.problems == [] and result.ranks[0].num_loss_tokens == 10 * 3 + 6
    assert _resident_fraction(big) < 0.05  # the 64 MiB tensor was never read


def test_inspect_reads_the_checkpoint_metadata_without_importing_dcp(tmp_path) -> None:
    """Inspect stays cheap: the checkpoint's own metadata is read without torch.distributed.checkpoint."""
    import subprocess
    import sys
    from pathlib import Path

    golden = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
    snapshot = sorted((golden / "checkpoints" / "spike_snapshots").glob("iter_*"))[0]
    code = (
        "import sys\n"
        "from axrl_spike_replay.snapshot.inspect import inspect_snapshot\n"
        f"info = inspect_snapshot({str(snapshot)!r})\n"
        "assert info.model.tensors == 27 and not info.problems, info\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_one_inspect_reads_each_file_and_listing_once(golden_snapshot: Path, monkeypatch) -> None:
    """The consistency checks reuse what inspect read in the same call: the metadata, the rank files' listing,
    each rank's grad info; every `.pt` is loaded once."""
    from axrl_spike_replay.snapshot import consistency, inspect, layout, metadata, rank_data, safe_load

    counts: dict[str, list[str]] = {"metadata": [], "listing": [], "load_pt": []}

    def counted(name: str, real):
        def call(*args, **kwargs):
            counts[name].append(str(args[0]))
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(inspect, "read_metadata", counted("metadata", metadata.read_metadata))
    monkeypatch.setattr(consistency, "read_metadata", counted("metadata", metadata.read_metadata))
    monkeypatch.setattr(inspect, "rank_files", counted("listing", layout.rank_files))
    monkeypatch.setattr(consistency, "rank_files", counted("listing", layout.rank_files))
    monkeypatch.setattr(inspect, "load_pt", counted("load_pt", safe_load.load_pt))
    monkeypatch.setattr(rank_data, "load_pt", counted("load_pt", safe_load.load_pt))

    result = inspect_snapshot(golden_snapshot)

    assert result.problems == [] and result.consistency is not None and result.consistency.problems == []
    assert len(counts["metadata"]) == 1 and len(counts["listing"]) == 1
    pt_files = sorted(str(p) for p in golden_snapshot.glob("*.pt"))
    assert sorted(counts["load_pt"]) == pt_files  # each once


def test_a_nan_spike_is_inspected_without_false_norm_problems(tmp_path: Path) -> None:
    """The guard's own record of a NaN step (grad norm NaN on every rank, spike ratio inf) agrees with itself."""
    snap = write_synthetic_snapshot(tmp_path / "spike_snapshots", SyntheticSpec(iteration=21, grad_norm=float("nan")))
    meta_file = snap / AXRL_METADATA
    meta_file.write_text(re.sub(r'"spike_ratio": [^,}]+', '"spike_ratio": Infinity', meta_file.read_text()))

    result = inspect_snapshot(snap)

    assert result.grad_norm != result.grad_norm  # NaN, the spike itself
    assert not [p for p in result.problems if "grad_norm" in p or "spike_ratio" in p], result.problems
