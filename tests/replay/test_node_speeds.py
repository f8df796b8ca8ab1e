"""The streamed row's estimated time: at this machine's measured read and compute speeds when planned here (a
bounded read of the snapshot's checkpoint, a matmul; kept in the workspace so a second plan reuses them), at the
assumed ones, said as such, where nothing is measured (a node described, a config-only snapshot's read, no GPU).

Snapshots are recorded in this run (`testing.hf_snapshot`, `testing.config_only_snapshot`); nothing here compares
with figures recorded elsewhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.investigation.planning import NODE_SPEEDS, plan_for
from axrl_spike_replay.replay.plans.read_speed import checkpoint_data_file, measure_read
from axrl_spike_replay.replay.streamed.speeds import ASSUMED_FLOPS, ASSUMED_READ_BYTES_PER_S, Speeds
from axrl_spike_replay.replay.streamed.streamed_plan import StreamedRow
from axrl_spike_replay.testing.config_only_snapshot import DEEPSEEK_V3, write_config_only_snapshot
from axrl_spike_replay.workspace.paths import TMP_DIR


def _consistent(row: StreamedRow) -> None:
    """The row's time is its own bytes at its read speed plus its FLOPs at its compute speed."""
    assert row.read_bytes_per_s > 0 and row.flops_per_s > 0
    expected = row.bytes_read / row.read_bytes_per_s + row.flops / row.flops_per_s
    assert row.seconds == pytest.approx(expected, rel=1e-12)
    assert f"read {row.read_bytes_per_s / 1e9:.3g} GB/s" in row.speeds
    assert f"compute {row.flops_per_s / 1e12:.3g} TFLOP/s" in row.speeds


@pytest.fixture(scope="module")
def hf_snapshot_here(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        return record_hf_snapshot(tmp_path_factory.mktemp("hf"), "qwen3_moe", world_size=2)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_a_plan_here_measures_its_speeds_and_a_second_plan_reuses_them(hf_snapshot_here: Path, tmp_path: Path) -> None:
    first = plan_for(hf_snapshot_here, workspace=tmp_path).streamed
    assert first is not None and first.read_measured and first.compute_measured
    _consistent(first)
    data = checkpoint_data_file(hf_snapshot_here)
    assert data is not None and data.suffix == ".distcp"
    assert f"of {data.name}" in first.speeds and "matmul on cpu, 1 thread" in first.speeds
    assert "assumed" not in first.speeds and first.read_cached is not None
    assert ("from the page cache" in first.speeds) == first.read_cached
    cache = tmp_path / TMP_DIR / NODE_SPEEDS
    kept = json.loads(cache.read_text())
    assert [e["bytes_per_s"] for e in kept["read"].values()] == [first.read_bytes_per_s]
    assert [e["flops_per_s"] for e in kept["compute"].values()] == [first.flops_per_s]
    written = cache.stat().st_mtime_ns

    second = plan_for(hf_snapshot_here, workspace=tmp_path).streamed
    assert second is not None and second.read_measured and second.compute_measured
    # the same figures to the last bit (a second measurement would differ), said as kept, the file not rewritten
    assert (second.read_bytes_per_s, second.flops_per_s) == (first.read_bytes_per_s, first.flops_per_s)
    assert second.speeds.count("kept from") == 2 and cache.stat().st_mtime_ns == written
    _consistent(second)

    # the row's time follows the speeds kept: a tenth of the compute speed, the compute part ten times longer
    for entry in kept["compute"].values():
        entry["flops_per_s"] /= 10
    cache.write_text(json.dumps(kept))
    slower = plan_for(hf_snapshot_here, workspace=tmp_path).streamed
    assert slower is not None and slower.flops_per_s == pytest.approx(first.flops_per_s / 10, rel=1e-12)
    _consistent(slower)
    assert slower.seconds > second.seconds


def test_an_unreadable_cache_is_measured_again(hf_snapshot_here: Path, tmp_path: Path) -> None:
    cache = tmp_path / TMP_DIR / NODE_SPEEDS
    cache.parent.mkdir(parents=True)
    cache.write_text('{"read": {"x": {"bytes_per_s": "fast"}}, "compute": [1]')
    row = plan_for(hf_snapshot_here, workspace=tmp_path).streamed
    assert row is not None and row.read_measured and row.compute_measured and "kept from" not in row.speeds
    assert json.loads(cache.read_text())["compute"]


def test_the_config_only_deepseek_v3_plan_on_a_described_8xh200_node_says_its_speeds_are_assumed(
    tmp_path: Path,
) -> None:
    snap = write_config_only_snapshot(
        tmp_path / "ds",
        "deepseek_v3",
        DEEPSEEK_V3,
        world_size=128,
        batch=4,
        seq=8192,
        attention="flash_attention_2",
        micro_batches=4,
    )
    plan = plan_for(snap, gpus=8, gpu_memory_gib=141, workspace=tmp_path)
    row = plan.streamed
    assert row is not None and plan.streams and not row.read_measured and not row.compute_measured
    assert (row.read_bytes_per_s, row.flops_per_s) == (ASSUMED_READ_BYTES_PER_S, ASSUMED_FLOPS["cuda"])
    assert row.speeds == (
        "read 2 GB/s assumed (not measured on the node described); "
        "compute 300 TFLOP/s assumed (not measured on the node described)"
    )
    _consistent(row)
    assert not (tmp_path / TMP_DIR / NODE_SPEEDS).exists()  # nothing measured, nothing kept


def test_a_config_only_snapshot_planned_here_measures_the_compute_and_assumes_the_read(tmp_path: Path) -> None:
    snap = write_config_only_snapshot(tmp_path / "ds", "deepseek_v3", DEEPSEEK_V3, world_size=2, batch=1, seq=64)
    row = plan_for(snap, workspace=tmp_path, shard="streamed").streamed
    assert row is not None and not row.read_measured and row.compute_measured
    assert "read 2 GB/s assumed (no checkpoint data file in the snapshot to read)" in row.speeds
    assert "bfloat16 matmul on cpu" in row.speeds  # DeepSeek-V3's dtype
    _consistent(row)
    cuda = plan_for(snap, workspace=tmp_path, device="cuda", shard="streamed").streamed
    assert cuda is not None
    if torch.cuda.is_available():
        assert cuda.compute_measured and "matmul on " + torch.cuda.get_device_name() in cuda.speeds
    else:
        assert not cuda.compute_measured and "300 TFLOP/s assumed (no GPU visible here to measure)" in cuda.speeds
    _consistent(cuda)


def _on_tmpfs(path: Path) -> bool:
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        point, fs = line.split()[1], line.split()[2]
        if str(path).startswith(point.rstrip("/") + "/") and len(point) >= len(best):
            best, kind = point, fs
    return kind == "tmpfs"


def test_the_read_says_whether_it_came_from_the_page_cache(tmp_path: Path) -> None:
    """A file just written, dropped from the page cache first, is read from disk; on a tmpfs (memory, which drops
    nothing) the read is said to be the page cache's."""
    data = os.urandom(3 << 20)
    disk = tmp_path / "__0_0.distcp"
    disk.write_bytes(data)
    read = measure_read(disk, limit=2 << 20)
    assert read.bytes_read == 2 << 20 and read.seconds > 0 and read.file == disk.name
    assert read.cached is _on_tmpfs(tmp_path)
    shm = Path("/dev/shm")
    if not shm.is_dir() or not _on_tmpfs(shm / "x"):
        pytest.skip("no tmpfs at /dev/shm")
    memory = shm / f"axrl-node-speeds-{os.getpid()}.bin"
    try:
        memory.write_bytes(data)
        held = measure_read(memory)
    finally:
        memory.unlink(missing_ok=True)
    assert held.bytes_read == len(data) and held.cached is True and held.resident == 1.0


def test_the_read_probe_takes_no_link_out_of_the_snapshot(tmp_path: Path) -> None:
    """A checkpoint entry that is a symlink to a larger file elsewhere is never the file read: the snapshot's own is."""
    weights = tmp_path / "snapshot" / "weights"
    weights.mkdir(parents=True)
    (weights / "__0_0.distcp").write_bytes(b"w" * 4096)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"o" * 65536)
    (weights / "__1_0.distcp").symlink_to(outside)
    assert checkpoint_data_file(weights) == weights / "__0_0.distcp"
    with pytest.raises(OSError):
        measure_read(weights / "__1_0.distcp")  # and the read itself refuses a link
    assert measure_read(weights / "__0_0.distcp").bytes_read == 4096


def test_speeds_another_process_printed_are_used_only_when_they_are_speeds() -> None:
    """A node's measurement comes back as JSON: a speed that is not a positive finite number, or a text past its
    bound, is not used (the plan keeps the assumed speeds and says the node's result was unreadable)."""
    good = Speeds.assumed("cpu").with_read(1e9, "measured, 1 MiB of x from disk", False).with_compute(2e11, "measured")
    assert Speeds.from_json(json.loads(json.dumps(good.to_json())), "cpu") == good
    for bad in ({"read_bytes_per_s": float("inf")}, {"flops_per_s": -1.0}, {"flops_per_s": True},
                {"read_how": "x" * 10_000}, {"read_cached": "yes"}, {"compute_measured": None}):  # fmt: skip
        assert Speeds.from_json({**good.to_json(), **bad}, "cpu") is None, bad
    assert Speeds.from_json(["not", "a", "document"], "cpu") is None


def test_a_cache_that_is_a_link_or_a_fifo_is_measured_again_not_followed_or_waited_on(
    hf_snapshot_here: Path, tmp_path: Path
) -> None:
    """The workspace's speeds cache is read as untrusted: a symlink to speeds kept elsewhere is not followed, and a
    FIFO put in its place is not waited on; the plan measures again and replaces the entry with a file."""
    import threading

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    first = plan_for(hf_snapshot_here, workspace=elsewhere).streamed  # speeds kept in another workspace
    assert first is not None and first.read_measured and (elsewhere / TMP_DIR / NODE_SPEEDS).is_file()
    cache = tmp_path / "ws" / TMP_DIR / NODE_SPEEDS
    cache.parent.mkdir(parents=True)
    cache.symlink_to(elsewhere / TMP_DIR / NODE_SPEEDS)
    linked = plan_for(hf_snapshot_here, workspace=tmp_path / "ws").streamed
    assert linked is not None and linked.read_measured and "kept from" not in linked.speeds
    assert not cache.is_symlink()

    cache.unlink()
    os.mkfifo(cache)
    rows: list[StreamedRow | None] = []
    worker = threading.Thread(
        target=lambda: rows.append(plan_for(hf_snapshot_here, workspace=tmp_path / "ws").streamed)
    )
    worker.start()
    worker.join(timeout=120)
    if worker.is_alive():  # a reader blocked on the FIFO: give it a writer so the test ends, then fail
        with open(cache, "w"):
            pass
        worker.join()
        pytest.fail("the plan waited on a FIFO in the speeds cache's place")
    assert rows and rows[0] is not None and rows[0].read_measured and "kept from" not in rows[0].speeds
    assert cache.is_file() and not cache.is_fifo()
