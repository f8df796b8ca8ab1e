"""The spike guard inside TRL's own GRPOTrainer: a tiny transformers MoE (qwen3_moe) trains on CPU with TRL's
generation and loss until a planted reward burst trips the guard; the callback skips that step, writes the snapshot
(weights, the inputs TRL's loss consumed, the routes its routers took, grad info, a trl `loss:` section from the
GRPOConfig) and the snapshot replays `reproduced` on our engine. A GRPOConfig setting the trl convention does not
cover is refused at replay by name; a snapshot of another TRL release is named in the replay's result; and a
snapshot that cannot be written never stops training.

Real parts throughout: TRL 1.16's GRPOTrainer and its Trainer loop, transformers' Qwen3MoeForCausalLM and its
generation, files written and read back by the replay engine. trl_run.py says how the run is built.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("trl", reason="TRL is not installed (scripts/setup.sh installs the trl extra)")

from transformers import TrainerCallback
from trl_run import RunSpec, trainer

from axrl_spike_replay.capture.detectors import MedianRatioDetector
from axrl_spike_replay.capture.trl_callback import TrlSpikeCallback, attach_spike_guard
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.snapshot.fields import canonicalize_batch
from axrl_spike_replay.snapshot.rank_data import load_grad_info, load_rank_batch
from axrl_spike_replay.vocabulary import Verb

BURST_STEP = 5


class WeightWatch(TrainerCallback):
    """Added after the guard's callback: whether each optimizer step moved a weight (the guard drops a skipped
    step's gradients in its own `on_pre_optimizer_step`, which runs first)."""

    def __init__(self) -> None:
        self.before: torch.Tensor | None = None
        self.moved: dict[int, bool] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.before = kwargs["model"].lm_head.weight.detach().clone()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.before is not None
        self.moved[state.global_step + 1] = not torch.equal(self.before, kwargs["model"].lm_head.weight)


def _guarded_run(out: Path, spec: RunSpec) -> tuple[TrlSpikeCallback, WeightWatch]:
    run = trainer(out, spec)
    callback = attach_spike_guard(
        run, out / "spikes", detector=MedianRatioDetector(window=4, threshold=5.0, warmup=3), job_name="trl-tiny"
    )
    watch = WeightWatch()
    run.add_callback(watch)
    run.train()
    return callback, watch


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrlSpikeCallback, WeightWatch]:
    """dapo (TRL's default loss) with the MoE router loss on, one micro-batch per step."""
    return _guarded_run(tmp_path_factory.mktemp("trl"), RunSpec())


def test_the_planted_burst_trips_the_guard_which_skips_that_step_only(trl_run: Any) -> None:
    callback, watch = trl_run
    tripped = [d.step for d in callback.decisions if d.tripped]
    assert tripped == [BURST_STEP]
    assert len(callback.decisions) == RunSpec().steps  # every optimizer step was judged, with the pre-clip norm
    assert watch.moved[BURST_STEP] is False
    assert all(moved for step, moved in watch.moved.items() if step != BURST_STEP)
    assert callback.guard.write_failures == [] and len(callback.guard.snapshots) == 1


def test_the_snapshot_holds_what_trls_loss_consumed_and_the_routes(trl_run: Any) -> None:
    callback, _ = trl_run
    snapshot = callback.guard.snapshots[0]
    config = yaml.safe_load((snapshot / "run_config.yaml").read_text(encoding="utf-8"))
    loss = config["loss"]
    assert loss["convention"] == "trl" and loss["trl"]["loss_type"] == "dapo" and loss["trl"]["version"] == "1.16.0"
    assert loss["aux_loss_coef"] == pytest.approx(0.001) and "unreproduced" not in loss
    assert config["model"]["architecture"] == "qwen3_moe" and config["model"]["temperature"] == pytest.approx(0.9)
    batch = load_rank_batch(snapshot, 0)
    for name in ("tokens", "loss_mask", "advantages", "attention_mask", "num_items_in_batch", "micro_batch"):
        assert name in batch, name
    assert float(batch["advantages"].abs().max()) > 100  # the burst is in the stored advantages
    routes = torch.load(snapshot / "routing_payload_rank0.pt", weights_only=True)
    assert routes["source"] == "train" and routes["moe_layers"] == [0, 1]
    assert tuple(routes["routed_experts"].shape[:3]) == (*batch["tokens"].shape, 2)
    info = load_grad_info(snapshot, 0)
    assert info["grad_norm"] == pytest.approx(info["trainer_grad_norm"], rel=1e-5)


def test_the_snapshot_replays_reproduced_on_one_process(trl_run: Any) -> None:
    callback, _ = trl_run
    result = run_replay(replay_request(What(callback.guard.snapshots[0]), how=How(nproc=1)))
    print(f"TRL snapshot: replayed {result.grad_norm!r}, recorded {result.recorded_grad_norm!r}, rel {result.rel_diff}")
    assert result.verdict == "reproduced" and result.fidelity == "full", result.error
    assert result.rel_diff is not None and result.rel_diff <= 1e-6
    assert result.trainer_version_note is None
    assert result.rank_metrics[0]["loss"] == pytest.approx(
        load_grad_info(callback.guard.snapshots[0], 0)["loss"], rel=1e-5
    )


def _edited(snapshot: Path, tmp_path: Path, edit: Any) -> Path:
    copy = Path(shutil.copytree(snapshot, tmp_path / snapshot.name))
    path = copy / "run_config.yaml"
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    edit(config)
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return copy


def test_with_another_loss_type_the_step_does_not_reproduce(trl_run: Any, tmp_path: Path) -> None:
    """The recorded settings are what reproduce it: the same step under luspo's normaliser (per sequence, where dapo
    divides by the step's tokens) is off. (Every completion here is 4 tokens long, so grpo, bnpo and dr_grpo would
    normalise as dapo does.)"""
    callback, _ = trl_run
    cut = _edited(callback.guard.snapshots[0], tmp_path, lambda c: c["loss"]["trl"].update(loss_type="luspo"))
    result = run_replay(replay_request(What(cut), how=How(nproc=1)))
    assert result.verdict == "not_reproduced", result.rel_diff


def test_a_grpo_config_setting_the_convention_does_not_cover_is_refused_naming_it(trl_run: Any, tmp_path: Path) -> None:
    callback, _ = trl_run
    cut = _edited(
        callback.guard.snapshots[0],
        tmp_path,
        lambda c: c["loss"].update(unreproduced=["top_entropy_quantile=0.8: its high-entropy token mask"]),
    )
    with pytest.raises(ConfigError, match=r"top_entropy_quantile=0\.8.*--backend command"):
        run_replay(replay_request(What(cut), how=How(nproc=1)))


def test_a_snapshot_of_another_trl_release_is_named_in_the_result(trl_run: Any, tmp_path: Path) -> None:
    callback, _ = trl_run
    cut = _edited(callback.guard.snapshots[0], tmp_path, lambda c: c["loss"]["trl"].update(version="1.15.2"))
    result = run_replay(replay_request(What(cut), how=How(nproc=1)))
    assert result.verdict == "reproduced"  # the same loss here; the note says the convention was checked on 1.16.0
    assert result.trainer_version_note is not None and "1.15.2" in result.trainer_version_note
    assert "1.16.0" in result.trainer_version_note


def test_two_micro_batches_per_step_replay_reproduced(tmp_path: Path) -> None:
    """gradient_accumulation_steps 2 (the router loss off: TRL adds it per micro-batch, which a replay of the step's
    whole batch would not): each micro-batch normalised on its own, as TRL's loss is."""
    spec = RunSpec(steps=5, burst_at=5, gradient_accumulation_steps=2, router_aux_loss_coef=0.0, loss_type="grpo")
    callback, _ = _guarded_run(tmp_path, spec)
    snapshot = callback.guard.snapshots[0]
    batch = canonicalize_batch(torch.load(snapshot / "batch_rank0.pt", weights_only=True), "batch")
    assert sorted(batch["micro_batch"].unique().tolist()) == [0, 1]
    result = run_replay(replay_request(What(snapshot), how=How(nproc=1)))
    assert result.verdict == "reproduced", (result.rel_diff, result.error)


def test_a_snapshot_that_cannot_be_written_never_stops_training(tmp_path: Path) -> None:
    blocked = tmp_path / "spikes"
    blocked.write_text("a file where the snapshot root should be", encoding="utf-8")
    run = trainer(tmp_path, RunSpec(steps=2, burst_at=1))
    callback = attach_spike_guard(run, blocked, detector=MedianRatioDetector(window=4, warmup=3, max_norm=1e-3))
    run.train()
    assert [d.tripped for d in callback.decisions] == [True, True]  # every step is above the absolute bar
    assert len(callback.guard.write_failures) == 2 and callback.guard.snapshots == []
    assert not callback.off  # a failed write is the guard's own business: it stays on
    assert run.state.global_step == 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_processes_over_gloo_write_one_snapshot_that_replays_on_one_process_and_on_two(tmp_path: Path) -> None:
    """torchrun starts two processes of the run (trl_two_process.py); accelerate joins them over gloo, TRL's DDP
    averages their gradients and gathers `num_items_in_batch`. Each process writes its own batch, routes and grad
    info into the one snapshot; the replay reproduces the step on two processes (full fidelity) and on one."""
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parent / "trl_two_process.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TRIPPED [5]" in done.stdout, done.stdout[-2000:]
    snapshot = next((tmp_path / "spikes").glob("iter_*"))
    for rank in (0, 1):
        assert (snapshot / f"batch_rank{rank}.pt").is_file() and (snapshot / f"routing_payload_rank{rank}.pt").is_file()
    config = yaml.safe_load((snapshot / "run_config.yaml").read_text(encoding="utf-8"))
    assert config["loss"]["trl"]["num_processes"] == 2 and config["parallel"]["world_size"] == 2
    for nproc, fidelity in ((2, "full"), (1, "full")):
        result = run_replay(replay_request(What(snapshot), how=How(nproc=nproc)))
        print(f"two-process TRL snapshot on {nproc}: rel_diff {result.rel_diff}")
        assert result.verdict == "reproduced" and result.fidelity == fidelity, (result.rel_diff, result.error)


def test_a_sweep_runs_trls_objectives_beside_todays_mitigations_on_the_captured_spike(trl_run: Any) -> None:
    """The spike is a reward burst (advantages 1000x): the objectives that bound ratios cannot clear it (the ratios
    are 1: one update per generation), an advantage clip does. Each result says so, with its cosine to the clean
    gradient and the tokens it touched."""
    from axrl_spike_replay.replay.sweep import run_sweep

    callback, _ = trl_run
    configs = [
        {"importance_sampling_level": "sequence"},
        {"trl_loss_type": "cispo"},
        {"trl_loss_type": "sapo"},
        {"trl_loss_type": "dr_grpo"},
        {"delta": 1.5},
        {"advantage_clip": 1},
    ]
    sweep = run_sweep(
        replay_request(What(callback.guard.snapshots[0], verb=Verb.SWEEP, configs=tuple(configs)), how=How(nproc=1))
    )
    assert sweep.baseline.verdict == "reproduced"
    verdicts = {}
    for config, result in zip(configs, sweep.results, strict=True):
        print(f"{config}: {result.verdict}, change {result.change_vs_baseline}, cosine {result.cosine_to_clean}")
        assert result.verdict != "failed", result.error
        verdicts[next(iter(config))] = result.verdict
    assert verdicts["advantage_clip"] == "cleared"
    assert verdicts["delta"] == "no_effect"  # every ratio is 1: a cap at 1.5 touches nothing


class BrokenDetector(MedianRatioDetector):
    """A detector that fails on its second step (an unexpected error inside the guard)."""

    def __init__(self) -> None:
        super().__init__(window=4, threshold=5.0, warmup=3)
        self.calls = 0

    def observe(self, grad_norm: float) -> Any:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("detector failure")
        return super().observe(grad_norm)


def test_an_unexpected_error_turns_the_guard_off_and_training_goes_on(tmp_path: Path) -> None:
    run = trainer(tmp_path, RunSpec(steps=3, burst_at=None))
    callback = attach_spike_guard(run, tmp_path / "spikes", detector=BrokenDetector())
    run.train()
    assert callback.off and len(callback.decisions) == 1  # judged step 1, failed on step 2, off from then on
    assert run.state.global_step == 3
