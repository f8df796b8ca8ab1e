"""The verl hook never crashes a training run: bad settings, an unwritable or full disk, a restart onto the same
steps and an unexpected error each leave training going, logged once; the norm it records is float64.

The hook runs as the patched engine calls it: `guard_step(engine, grad_norm)` after verl's clip, with the norm
the clip returned. The engine is a stand-in carrying what the hook reads (a real torch module with real gradients,
its optimizer, `optimizer_config.clip_grad`, the mini-batch the patched `forward_backward_batch` keeps, with the
`global_steps` the patched trainer sets on it). The multi-rank and fp16 cases, in test_verl_hook_ranks.py, run
verl's own patched `optimizer_step`.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from axrl_spike_replay.integrations import VERL_PATCH
from axrl_spike_replay.snapshot.layout import SNAPSHOTS_DIR
from axrl_spike_replay.snapshot.listing import list_snapshots
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.snapshot.rank_data import load_grad_info
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml
from disk_full import run_on_full_disk

VERL_HOOK_FILE = VERL_PATCH.with_name("verl.py")  # the hook shipped in the package, loaded by path as a copy
HOOK_LOG = "axrl_spike_replay.verl_hook"
_loaded = 0


def _load_hook() -> Any:
    """A fresh copy of the hook, as a new training process loads it (its state starts empty)."""
    global _loaded
    _loaded += 1
    spec = importlib.util.spec_from_file_location(f"axrl_verl_hook_safety_{_loaded}", VERL_HOOK_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _engine(clip_grad: float = 1e9, width: int = 64) -> SimpleNamespace:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 4))
    return SimpleNamespace(
        module=module,
        optimizer=torch.optim.SGD(module.parameters(), lr=0.01),
        optimizer_config=SimpleNamespace(clip_grad=clip_grad),
        _axrl_spike_batch=None,
    )


def _step(hook: Any, engine: SimpleNamespace, global_step: int | None, scale: float = 1.0) -> tuple[bool, float]:
    """One training step as verl runs it: backward, the clip (its float32 norm), then the guard; (take the step,
    the step's exact float64 pre-clip norm)."""
    engine.optimizer.zero_grad()
    width = engine.module[0].in_features
    (engine.module(torch.ones(3, width)) * scale).pow(2).mean().backward()
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    exact = math.sqrt(math.fsum(float(g.double().pow(2).sum()) for g in grads))
    batch: dict[str, Any] = {"input_ids": torch.ones(3, 5, dtype=torch.long), "response_mask": torch.ones(3, 2)}
    if global_step is not None:
        batch["global_steps"] = global_step
    engine._axrl_spike_batch = batch
    grad_norm = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), engine.optimizer_config.clip_grad)
    return hook.guard_step(engine, grad_norm), exact


def _quiet_then_spike(hook: Any, engine: SimpleNamespace, steps: int = 4, first: int = 1) -> tuple[bool, float]:
    for step in range(first, first + steps):
        assert _step(hook, engine, step)[0]
    return _step(hook, engine, first + steps, scale=1e3)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A guard that judges from the third step on, writing into an output dir's rotating snapshots dir."""
    root = tmp_path / "r1~verl-job__actor" / SNAPSHOTS_DIR
    monkeypatch.setenv("AXRL_SPIKE_DIR", str(root))
    monkeypatch.setenv("AXRL_SPIKE_WINDOW", "5")
    monkeypatch.setenv("AXRL_SPIKE_WARMUP", "3")
    for name in ("AXRL_SPIKE_ACTION", "AXRL_SPIKE_THRESHOLD", "AXRL_RUN_ID", "AXRL_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AXRL_SPIKE_WARMUP_RATIO", "AXRL_SPIKE_MAX_NORM"):
        monkeypatch.delenv(name, raising=False)
    return root


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == HOOK_LOG and r.levelno >= logging.WARNING]


def test_bad_settings_are_logged_once_by_name_and_take_their_defaults(
    quick: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AXRL_SPIKE_ACTION", "rollback-as-skip")  # offered by the docstring: a skip
    monkeypatch.setenv("AXRL_SPIKE_WINDOW", "abc")
    monkeypatch.setenv("AXRL_SPIKE_THRESHOLD", "-1")
    monkeypatch.setenv("AXRL_SPIKE_WARMUP", "3")
    hook, engine = _load_hook(), _engine()
    with caplog.at_level(logging.INFO, logger=HOOK_LOG):
        assert _quiet_then_spike(hook, engine, steps=3)[0] is False  # still guarded: the spike is skipped
        assert _step(hook, engine, 5)[0]
    detector = hook._state["guard"].detector
    assert (detector.window, detector.threshold, detector.warmup) == (20, 5.0, 3)
    said = _warnings(caplog)
    assert sum("AXRL_SPIKE_WINDOW='abc'" in m and "default 20" in m for m in said) == 1, said
    assert sum("AXRL_SPIKE_THRESHOLD='-1'" in m and "default 5.0" in m for m in said) == 1, said
    assert not any("AXRL_SPIKE_ACTION" in m for m in said)  # a valid value: noted, not warned about
    assert len(list(quick.glob("iter_*"))) == 1


def test_a_warmup_longer_than_the_window_and_an_unknown_action_are_brought_in_line(
    quick: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AXRL_SPIKE_ACTION", "skp")
    monkeypatch.setenv("AXRL_SPIKE_WARMUP", "9")
    hook, engine = _load_hook(), _engine()
    with caplog.at_level(logging.WARNING, logger=HOOK_LOG):
        assert _step(hook, engine, 1)[0] and _step(hook, engine, 2)[0]
    guard = hook._state["guard"]
    assert (guard.detector.window, guard.detector.warmup, guard.action) == (5, 5, "skip")
    said = _warnings(caplog)
    assert any("AXRL_SPIKE_ACTION='skp'" in m and "using the default skip" in m for m in said), said
    assert any("AXRL_SPIKE_WARMUP=9 is longer than the window (5); using 5" in m for m in said), said


def test_an_unwritable_snapshot_dir_never_reaches_training(
    tmp_path: Path, quick: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("AXRL_SPIKE_DIR", str(blocker / "spike_snapshots"))
    hook, engine = _load_hook(), _engine()
    with caplog.at_level(logging.DEBUG, logger="axrl_spike_replay.guard"):
        assert _quiet_then_spike(hook, engine)[0] is False  # the spike is still skipped, as decided
        assert _step(hook, engine, 6, scale=1e3)[0] is False  # and the next one: no raise either time
        assert _step(hook, engine, 7)[0]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "NotADirectoryError" in errors[0], errors  # once, not once per spike
    assert blocker.read_text() == "not a directory" and list(tmp_path.glob("**/.iter_*")) == []
    assert not hook._state.get("off")  # the guard stays on: a later spike may find the disk writable


_FULL_DISK_HOOK = """
import importlib.util, json, math, os, sys, torch
from pathlib import Path
from types import SimpleNamespace
from torch import nn

root = Path(sys.argv[1]) / "spike_snapshots"
os.environ.update(AXRL_SPIKE_DIR=str(root), AXRL_SPIKE_WINDOW="5", AXRL_SPIKE_WARMUP="3", AXRL_RUN_ID="full")
spec = importlib.util.spec_from_file_location("axrl_verl_hook", sys.argv[2])
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)
torch.manual_seed(0)
module = nn.Linear(256, 256)  # 257 KiB of weights: the weights alone overfill the 128 KiB disk
engine = SimpleNamespace(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.01),
                         optimizer_config=SimpleNamespace(clip_grad=1e9))
taken = []
for step in range(1, 7):
    engine.optimizer.zero_grad()
    (module(torch.ones(2, 256)) * (1e3 if step in (5, 6) else 1.0)).pow(2).mean().backward()
    engine._axrl_spike_batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "global_steps": step}
    taken.append(hook.guard_step(engine, torch.nn.utils.clip_grad_norm_(module.parameters(), 1e9)))
print(json.dumps({"taken": taken, "left": sorted(p.name for p in root.iterdir()),
                  "failures": hook._state["guard"].write_failures, "off": bool(hook._state.get("off"))}))
"""


def test_a_full_disk_never_reaches_training_and_leaves_nothing(tmp_path: Path) -> None:
    out = run_on_full_disk(_FULL_DISK_HOOK, tmp_path / "disk", 128, str(VERL_HOOK_FILE))
    print(f"full disk under the hook: {out['failures'][0]}")
    assert out["taken"] == [True, True, True, True, False, False] and out["left"] == [] and not out["off"]
    assert "No space left on device" in out["failures"][0] or "MB free on its filesystem" in out["failures"][0]


def test_a_restarted_run_never_meets_the_previous_run_s_snapshots(quick: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AXRL_RUN_ID", "first-run")
    first = _load_hook()
    assert _quiet_then_spike(first, _engine(), first=4)[0] is False  # verl's global step 8 spikes
    monkeypatch.delenv("AXRL_RUN_ID")
    restarted = _load_hook()  # resumed from the checkpoint of step 3: the same steps, the same spike
    engine = _engine()
    assert _quiet_then_spike(restarted, engine, first=4)[0] is False
    assert _step(restarted, engine, 8, scale=1e3)[0] is False  # a second spiking update within step 8
    names = sorted(p.name for p in quick.iterdir())
    run_id = restarted._state["run_id"]
    assert names == sorted(["iter_0000008-first-run", f"iter_0000008-{run_id}", f"iter_0000008-{run_id}.2"])
    assert run_id != "first-run" and len(run_id) == len("20250102T030405Z-9f3a")
    for name in names:
        assert read_metadata(quick / name)[0].iteration == 8  # verl's global step, not the hook's own count
    train = read_untrusted_yaml(quick / f"iter_0000008-{run_id}.2" / "run_config.yaml")["train"]
    assert (train["global_step"], train["optimizer_update"], train["run_id"]) == (8, 2, run_id)
    listed = list_snapshots(quick.parent.parent).snapshots
    assert sorted(Path(s.path).name for s in listed) == names and {s.iteration for s in listed} == {8}


def test_without_verl_s_global_step_the_hook_counts_updates_and_says_so(
    quick: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hook, engine = _load_hook(), _engine()
    with caplog.at_level(logging.WARNING, logger=HOOK_LOG):
        for _ in range(4):
            assert _step(hook, engine, None)[0]
        assert _step(hook, engine, None, scale=1e3)[0] is False
    (written,) = quick.iterdir()
    assert read_metadata(written)[0].iteration == 5
    assert read_untrusted_yaml(written / "run_config.yaml")["train"]["global_step"] is None
    assert sum("global step is not on the mini-batch" in m for m in _warnings(caplog)) == 1


def test_an_unexpected_error_turns_the_guard_off_once_and_training_goes_on(
    quick: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hook, engine = _load_hook(), _engine()
    with caplog.at_level(logging.WARNING, logger=HOOK_LOG):
        assert hook.guard_step(engine, "not a norm") is True
        assert all(hook.guard_step(engine, torch.tensor(1e6)) for _ in range(8))  # off: verl's own step
    said = [r for r in caplog.records if r.name == HOOK_LOG and r.levelno >= logging.ERROR]
    assert len(said) == 1 and said[0].exc_info is not None and "off for the rest of this run" in said[0].getMessage()


@pytest.mark.parametrize("clip_grad", [1e9, 1e-3], ids=["unclipped", "clipped"])
def test_the_recorded_norm_is_float64_and_the_parameter_norms_merge_to_it(quick: Path, clip_grad: float) -> None:
    hook, engine = _load_hook(), _engine(clip_grad=clip_grad, width=512)
    taken, exact = _quiet_then_spike(hook, engine)
    assert taken is False
    (written,) = quick.iterdir()
    info = load_grad_info(written, 0)
    recorded = read_metadata(written)[0].grad_norm
    merged = math.sqrt(math.fsum(v * v for v in info["param_grad_norms"].values()))
    trainer = info.get("trainer_grad_norm")
    print(f"{clip_grad=}: exact {exact!r}, recorded {recorded!r}, verl's float32 clip norm {trainer!r}")
    # unclipped: the gradients as they were; clipped: only the clip's float32 multiply (2^-24 at most) remains
    assert abs(recorded - exact) <= (1e-12 if clip_grad > 1 else 2**-24) * exact
    assert recorded == info["grad_norm"] and abs(merged - recorded) <= 1e-12 * recorded
    assert trainer is not None and abs(trainer - exact) > abs(recorded - exact)  # verl's, kept for reference


def test_the_verl_side_shim_never_raises_either(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog) -> None:
    from verl_engine_step import SHIM, patched_tree, verl_root

    if verl_root() is None:
        pytest.skip("needs verl 0.9.1 installed (its files are patched)")
    tree = patched_tree(tmp_path / "src")
    spec = importlib.util.spec_from_file_location("axrl_spike_hook_shim", tree / SHIM)
    assert spec is not None and spec.loader is not None
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    monkeypatch.setenv("AXRL_VERL_HOOK", str(tmp_path / "moved-away" / "verl.py"))
    with caplog.at_level(logging.WARNING):
        assert all(shim.guard_step(SimpleNamespace(), torch.tensor(1.0)) for _ in range(3))
    said = [r for r in caplog.records if "AXRL_VERL_HOOK" in r.getMessage()]
    assert len(said) == 1 and "moved-away" in said[0].getMessage()


def test_the_guard_is_armed_from_step_1_and_its_warm_up_settings_are_read(
    quick: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A spike on the second step, inside the warm-up, is skipped and snapshotted (the guard's shared default,
    `guard_settings.guard_detector`); `AXRL_SPIKE_WARMUP_RATIO=off` gives the blind warm-up back; a bad value is
    logged once and takes the default."""
    monkeypatch.setenv("AXRL_SPIKE_WARMUP", "5")
    hook, engine = _load_hook(), _engine()
    assert _step(hook, engine, 1)[0]
    assert _step(hook, engine, 2, scale=1e3)[0] is False  # 10^6 x the first step's norm, in the warm-up
    assert hook._state["guard"].detector.warmup_ratio == 10.0
    assert len(list(quick.glob("iter_*"))) == 1

    monkeypatch.setenv("AXRL_SPIKE_WARMUP_RATIO", "off")
    monkeypatch.setenv("AXRL_SPIKE_DIR", str(quick.parent / "blind"))
    hook, engine = _load_hook(), _engine()
    assert _step(hook, engine, 1)[0] and _step(hook, engine, 2, scale=1e3)[0]  # blind: the spike goes through
    assert hook._state["guard"].detector.warmup_ratio is None

    monkeypatch.setenv("AXRL_SPIKE_WARMUP_RATIO", "0.5")
    monkeypatch.setenv("AXRL_SPIKE_MAX_NORM", "abc")
    hook, engine = _load_hook(), _engine()
    with caplog.at_level(logging.WARNING, logger=HOOK_LOG):
        assert _step(hook, engine, 1)[0]
    detector = hook._state["guard"].detector
    assert (detector.warmup_ratio, detector.max_norm) == (10.0, None)
    said = _warnings(caplog)
    assert any("AXRL_SPIKE_WARMUP_RATIO='0.5'" in m and "a finite number > 1" in m for m in said), said
    assert any("AXRL_SPIKE_MAX_NORM='abc'" in m for m in said), said
