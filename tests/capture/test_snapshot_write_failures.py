"""A snapshot that cannot be written never stops the training loop: on a full disk, an unwritable dir or a failure
on any one rank, every rank gets None at the same point (none waits at a barrier for a peer that left), nothing
of the write is left behind, the failure is logged once, and the next snapshot is written whole.

The failures are real: a tmpfs filled by the write itself (ENOSPC, see tests/disk_full.py), a file-size limit on
one rank's process (RLIMIT_FSIZE: EFBIG from the kernel, as a quota gives), a path through a file (ENOTDIR); the
ranks are spawned processes in one gloo group.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from axrl_spike_replay.capture.detectors import MedianRatioDetector
from axrl_spike_replay.capture.snapshot_writer import RankPayload
from axrl_spike_replay.capture.spike_guard import SpikeGuard
from axrl_spike_replay.processes.rank_processes import spawn_ranks
from axrl_spike_replay.snapshot.metadata import read_metadata
from disk_full import run_on_full_disk


def _guard(root: Path, **kwargs) -> SpikeGuard:
    detector = MedianRatioDetector(window=3, threshold=2.0, warmup=1)
    guard = SpikeGuard(root, job_name="user-job", detector=detector, **kwargs)
    guard.observe(1, 1.0)
    return guard


def _payload(rank: int, tokens: int) -> dict[int, RankPayload]:
    batch = {"tokens": torch.zeros(2, tokens, dtype=torch.int64), "loss_mask": torch.ones(2, tokens)}
    return {rank: RankPayload(batch=batch, grad_info={"grad_norm": 100.0, "param_grad_norms": {}})}


_FULL_DISK = """
import json, sys, torch
from pathlib import Path
from torch import nn
from axrl_spike_replay.capture.detectors import MedianRatioDetector
from axrl_spike_replay.capture.snapshot_writer import RankPayload
from axrl_spike_replay.capture.spike_guard import SpikeGuard

root = Path(sys.argv[1]) / "spike_snapshots"
guard = SpikeGuard(root, detector=MedianRatioDetector(window=3, threshold=2.0, warmup=1))
guard.observe(1, 1.0)
model = nn.Linear(4, 1)

def payload(tokens):
    return {0: RankPayload({"tokens": torch.zeros(2, tokens, dtype=torch.int64)}, {"grad_norm": 100.0})}

too_big = guard.snapshot(guard.observe(2, 100.0), model.state_dict(), payload(64 * 1024))  # 1 MiB on 512 KiB
left = sorted(p.name for p in root.iterdir())
fits = guard.snapshot(guard.observe(3, 100.0), model.state_dict(), payload(8))
print(json.dumps({"too_big": str(too_big) if too_big else None, "left": left, "failures": guard.write_failures,
                  "fits": str(fits) if fits else None, "after": sorted(p.name for p in root.iterdir())}))
"""


def test_a_full_disk_leaves_nothing_behind_and_the_next_snapshot_fits(tmp_path: Path) -> None:
    out = run_on_full_disk(_FULL_DISK, tmp_path / "disk", 512)
    print(f"full disk: {out['failures'][0]}")
    assert out["too_big"] is None and out["left"] == []  # no .iter_N.writing debris: the space is given back
    assert "[Errno 28] No space left on device" in out["failures"][0]
    assert out["fits"] is not None and out["after"] == ["iter_0000003"]


def test_an_unwritable_dir_is_logged_once_and_the_loop_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the snapshots dir should be")
    guard = _guard(blocker / "spike_snapshots", action="skip")
    model = nn.Linear(4, 1)
    with caplog.at_level(logging.DEBUG, logger="axrl_spike_replay.guard"):
        for step in (2, 3):
            decision = guard.observe(step, 100.0)
            assert guard.snapshot(decision, model.state_dict(), _payload(0, 5)) is None
            assert not guard.apply(decision, model)  # the spike is still skipped, as decided
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "NotADirectoryError" in errors[0], errors  # once, not once per spike
    assert len(guard.write_failures) == 2 and blocker.read_text().startswith("a file")


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this field")


def test_a_payload_that_fails_midway_leaves_nothing_and_a_retry_writes_it_whole(tmp_path: Path) -> None:
    guard = _guard(tmp_path)
    model = nn.Linear(4, 1)
    decision = guard.observe(2, 100.0)
    payload = _payload(0, 5)
    payload[1] = RankPayload(batch={"tokens": _Unpicklable()}, grad_info={"grad_norm": 1.0})  # type: ignore[dict-item]
    assert guard.snapshot(decision, model.state_dict(), payload) is None
    assert list(tmp_path.iterdir()) == []  # neither iter_0000002 nor its hidden staging dir
    assert "cannot pickle this field" in guard.write_failures[0]

    path = guard.snapshot(decision, model.state_dict(), _payload(0, 5))
    assert path is not None and read_metadata(path)[0].iteration == 2
    assert [p.name for p in tmp_path.iterdir()] == ["iter_0000002"]


def test_a_name_already_taken_is_never_overwritten_and_never_fails(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    first = _guard(tmp_path)
    second = _guard(tmp_path)  # a restarted run without a run id, at the same step
    paths = [g.snapshot(g.observe(8, 100.0), model.state_dict(), _payload(0, 5)) for g in (first, second, second)]
    assert [p.name for p in paths if p] == ["iter_0000008", "iter_0000008-2", "iter_0000008-3"]
    assert all(read_metadata(p)[0].iteration == 8 for p in paths if p)


def test_a_restarted_run_keeps_its_snapshots_and_rotation_keeps_the_newest_written(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    before = _guard(tmp_path, run_id="run-a", keep_last=2)
    for step in (120, 125):
        before.snapshot(before.observe(step, 100.0), model.state_dict(), _payload(0, 5))
    os.utime(tmp_path / "iter_0000120-run-a", ns=(1, 1))  # written long ago, whatever this filesystem's clock tick
    os.utime(tmp_path / "iter_0000125-run-a", ns=(2, 2))
    after = _guard(tmp_path, run_id="run-b", keep_last=2)  # resumed from a checkpoint of step 100
    written = after.snapshot(after.observe(110, 100.0), model.state_dict(), _payload(0, 5))
    assert written is not None and written.name == "iter_0000110-run-b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000110-run-b", "iter_0000125-run-a"]


def test_a_bad_run_id_is_refused_when_the_guard_is_made(tmp_path: Path) -> None:
    from axrl_spike_replay.errors import ConfigError

    for bad in ("../up", "", "a b", "x" * 49):
        with pytest.raises(ConfigError, match="run_id"):
            SpikeGuard(tmp_path, run_id=bad)


def _fp16_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler, scale: float) -> float:
    optimizer.zero_grad()
    scaler.scale((model(torch.ones(2, 4)) * scale).pow(2).mean()).backward()
    scaler.unscale_(optimizer)  # before the norm, as verl and torch's AMP recipe do
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))


def test_a_skipped_fp16_step_closes_the_scaler_s_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = SpikeGuard(tmp_path, detector=MedianRatioDetector(window=4, threshold=5.0, warmup=2))
    applied, scale_before_inf = [], 0.0
    for step, scale in enumerate((1.0, 1.0, 1.0, 100.0, 1.0, float("inf"), 1.0), start=1):
        norm = _fp16_step(model, optimizer, scaler, scale)  # the next step's unscale_ is where the bug showed
        decision = guard.observe(step, norm)
        if guard.apply(decision, model, optimizer, scaler):
            scaler.step(optimizer)
            scaler.update()
            applied.append(step)
        if step == 5:
            scale_before_inf = scaler.get_scale()
    assert applied == [1, 2, 3, 5, 7]
    assert scaler.get_scale() == scale_before_inf * 0.5  # the inf step backed the scale off, as scaler.step would


def _two_ranks_one_failing(rank: int, world_size: int, out: str) -> None:
    import resource
    import signal

    root = Path(out) / "spike_snapshots"
    guard = _guard(root)
    model = nn.Linear(4, 1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    seen: dict[str, object] = {}

    def limited(on_rank: int, limit: int, run):
        if rank == on_rank:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            return run()
        finally:
            if rank == on_rank:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    # rank 1 cannot write its batch (512 KiB past a 64 KiB limit): every rank must learn it from the agreement
    first = limited(
        1, 64 * 1024, lambda: guard.snapshot(guard.observe(2, 100.0), model.state_dict(), _payload(rank, 32 * 1024))
    )
    seen["rank1_fails"] = [str(first) if first else None, sorted(os.listdir(root))]
    torch.distributed.barrier()  # every rank has looked before rank 0 opens the next snapshot's staging dir
    # rank 0 cannot complete the dir (its run_config past its limit) after every rank wrote its files
    config = {"note": "x" * 200_000}
    second = limited(
        0,
        64 * 1024,
        lambda: guard.snapshot(guard.observe(3, 100.0), model.state_dict(), _payload(rank, 5), run_config=config),
    )
    seen["rank0_fails"] = [str(second) if second else None, sorted(os.listdir(root))]
    torch.distributed.barrier()
    third = guard.snapshot(guard.observe(4, 100.0), model.state_dict(), _payload(rank, 5))  # still in step
    seen["written"] = [str(third) if third else None, sorted(os.listdir(root))]
    seen["failures"] = guard.write_failures
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(seen))


@pytest.mark.slow
def test_a_rank_that_cannot_write_stops_every_rank_at_the_same_point(tmp_path: Path) -> None:
    # A rank raising out of the write used to leave its peers at the next barrier until the group timed out:
    # the short timeout turns such a hang into a failure here.
    spawn_ranks(_two_ranks_one_failing, 2, str(tmp_path), timeout_s=90)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for seen in ranks:
        assert seen["rank1_fails"] == [None, []] and seen["rank0_fails"] == [None, []]
        assert seen["written"][1] == ["iter_0000004"] and seen["written"][0].endswith("iter_0000004")
    print(f"rank 1 over its file-size limit: {ranks[0]['failures'][0]}")
    print(f"rank 0 over its file-size limit: {ranks[0]['failures'][1]}")
    assert "rank 1: OSError: [Errno 27] File too large" in ranks[0]["failures"][0]
    assert "rank 0: OSError: [Errno 27] File too large" in ranks[1]["failures"][1]  # every rank holds the reason
    assert read_metadata(tmp_path / "spike_snapshots" / "iter_0000004")[0].iteration == 4
