"""verl's own patched `optimizer_step` with the hook, in real process groups: an fp16 skip leaves verl's
ShardedGradScaler ready for the next step, and FSDP2 ranks whose snapshot fails on one rank all go on together.

Each case is spawned processes in one gloo group (ShardedGradScaler all-reduces its inf check over the group);
`optimizer_step` is compiled from the patched `transformer_impl.py` (see verl_engine_step.py). The process group's
timeout is short, so a rank left waiting for a peer fails the test instead of hanging it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from verl_engine_step import HOOK, optimizer_step, patched_tree, verl_root

from axrl_spike_replay.processes.rank_processes import spawn_ranks
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.snapshot.rank_data import load_grad_info

pytestmark = [
    pytest.mark.slow,  # spawned gloo processes: tens of seconds on a loaded 2-core machine
    pytest.mark.skipif(verl_root() is None, reason="needs verl 0.9.1 installed (its patched optimizer_step runs)"),
]


def _load_hook(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fp16_rank(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    # the shim imports the hook from the installed package by its module name, as docs/verl.md sets it
    os.environ.update(AXRL_VERL_HOOK="axrl_spike_replay.integrations.verl", AXRL_SPIKE_DIR=str(Path(out) / "spikes"))
    os.environ.update(AXRL_RUN_ID="fp16")
    os.environ.update(AXRL_SPIKE_WINDOW="5", AXRL_SPIKE_WARMUP="3")
    step_fn = optimizer_step(Path(out) / "src")
    torch.manual_seed(0)
    module = nn.Linear(8, 2)
    engine = SimpleNamespace(
        module=module,
        optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
        optimizer_config=SimpleNamespace(clip_grad=1.0),
        scaler=ShardedGradScaler(device="cpu", init_scale=2.0**10, growth_interval=400),  # as verl builds it
        _qat_enabled=False,
    )
    taken, scales = [], []
    for step, scale in enumerate((1.0, 1.0, 1.0, 1.0, 1e3, 1.0, float("inf"), 1.0), start=1):
        engine.optimizer.zero_grad()  # verl's train_batch: optimizer_zero_grad, forward_backward_batch, step
        engine._axrl_spike_batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "global_steps": step}
        loss = (module(torch.ones(2, 8)) * scale).pow(2).mean()
        engine.scaler.scale(loss).backward()
        before = module.weight.detach().clone()
        step_fn(engine)  # unscale_, clip, the guard, then scaler.step + update unless skipped
        taken.append(not torch.equal(before, module.weight))
        scales.append(float(engine.scaler.get_scale()))
    Path(out, "fp16.json").write_text(json.dumps({"taken": taken, "scales": scales}))


def test_an_fp16_skip_leaves_verl_s_scaler_ready_for_the_next_step(tmp_path: Path) -> None:
    patched_tree(tmp_path / "src")
    spawn_ranks(_fp16_rank, 1, str(tmp_path), timeout_s=120)
    seen = json.loads((tmp_path / "fp16.json").read_text())
    # step 5 spikes (skipped, snapshotted); step 6 unscale_s again; step 7's inf grads trip the guard too
    assert seen["taken"] == [True, True, True, True, False, True, False, True]
    assert seen["scales"][6] == seen["scales"][5] * 0.5  # the inf step backed the scale off, as scaler.step would
    assert sorted(p.name for p in (tmp_path / "spikes").iterdir()) == ["iter_0000005-fp16", "iter_0000007-fp16"]


def _fsdp2_rank(rank: int, world_size: int, out: str) -> None:
    import resource
    import signal

    from torch.distributed.fsdp import fully_shard

    step_fn = optimizer_step(Path(out) / "src")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the file-size limit: EFBIG, not a killed process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    blocker = Path(out) / "a-file"
    if rank == 0:
        blocker.write_text("not a directory")
    seen: dict[str, Any] = {}
    for run, spike_dir in (("unwritable", blocker / "spikes"), ("one-rank-full", Path(out) / "spikes")):
        os.environ.update(AXRL_VERL_HOOK=str(HOOK), AXRL_SPIKE_DIR=str(spike_dir), AXRL_RUN_ID=run)
        os.environ.update(AXRL_SPIKE_WINDOW="5", AXRL_SPIKE_WARMUP="3")
        hook = _load_hook(f"axrl_verl_hook_{run}")  # a fresh training process's hook
        import verl.utils.axrl_spike_hook as shim  # the patched shim: the method's own import finds this one

        shim._hook, shim._failed = hook, False
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        fully_shard(module)
        engine = SimpleNamespace(
            module=module,
            optimizer=torch.optim.SGD(module.parameters(), lr=0.01),
            optimizer_config=SimpleNamespace(clip_grad=1.0),
            _qat_enabled=False,
        )
        taken, exact = [], []
        for step, scale in enumerate((1.0, 1.0, 1.0, 1.0, 1e3, 1.0, 1e3), start=1):
            engine.optimizer.zero_grad()
            big = run == "one-rank-full" and step == 5 and rank == 1  # rank 1's batch outgrows its limit
            engine._axrl_spike_batch = {
                "input_ids": torch.ones(64 if big else 2, 1024 if big else 3, dtype=torch.long),
                "global_steps": 10 + step,
            }
            x = torch.full((3, 16), float(rank + 1))  # each rank its own data; FSDP reduces the gradients
            (module(x) * scale).pow(2).mean().backward()
            exact.append(
                math.sqrt(math.fsum(float(p.grad.full_tensor().double().pow(2).sum()) for p in module.parameters()))
            )
            before = [p.detach().to_local().clone() for p in module.parameters()]
            if big:
                resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
            try:
                step_fn(engine)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            taken.append(
                any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, module.parameters(), strict=True))
            )
        guard = hook._state["guard"]
        seen[run] = {
            "taken": taken,
            "exact": exact,
            "failures": guard.write_failures,
            "off": bool(hook._state.get("off")),
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))


def test_fsdp2_ranks_go_on_together_when_a_snapshot_fails_on_one_of_them(tmp_path: Path) -> None:
    patched_tree(tmp_path / "src")
    spawn_ranks(_fsdp2_rank, 2, str(tmp_path), timeout_s=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for seen in ranks:
        for run in ("unwritable", "one-rank-full"):
            assert seen[run]["taken"] == [True, True, True, True, False, True, False] and not seen[run]["off"]
    print(f"rank 0 cannot make the dir: {ranks[0]['unwritable']['failures'][0]}")
    print(f"rank 1 over its file-size limit: {ranks[0]['one-rank-full']['failures'][0]}")
    assert "NotADirectoryError" in ranks[0]["unwritable"]["failures"][0]
    assert "rank 1: OSError: [Errno 27] File too large" in ranks[0]["one-rank-full"]["failures"][0]
    assert (tmp_path / "a-file").read_text() == "not a directory"
    (written,) = (tmp_path / "spikes").iterdir()  # step 5 failed and left nothing; step 7 was written
    assert written.name == "iter_0000017-one-rank-full" and read_metadata(written)[0].iteration == 17

    exact = ranks[0]["one-rank-full"]["exact"][6]
    recorded = read_metadata(written)[0].grad_norm
    infos = [load_grad_info(written, r) for r in (0, 1)]
    merged = math.sqrt(math.fsum(v * v for info in infos for v in info["param_grad_norms"].values()))
    print(f"FSDP2 step 17: exact {exact!r}, recorded {recorded!r}, verl's clip {infos[0]['trainer_grad_norm']!r}")
    assert all(info["param_grad_norms_kind"] == "reduced_shard" for info in infos)
    assert abs(recorded - exact) <= 2**-24 * exact and abs(merged - recorded) <= 1e-12 * recorded
