"""The spike guard inside TRL's `GRPOTrainer`: `attach_spike_guard(trainer, ...)` before `trainer.train()`.

Example (one process, or every process of an `accelerate launch` alike)::

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    attach_spike_guard(trainer, "checkpoints/spike_snapshots", action="skip", job_name="my-grpo")
    trainer.train()

What it hooks, and why these: a `TrainerCallback` (`on_pre_optimizer_step`, after the gradients are reduced and
clipped, before `optimizer.step()`) judges the step and skips or rolls it back; but no callback event sees the batch
or the pre-clip norm (transformers' loop keeps the norm in a local), so the two smallest hooks that do are wrapped
on this one trainer instance: `compute_loss` (each micro-batch's inputs exactly as TRL's loss consumes them, routes
recorded on that forward only, and its loss) and `_get_grad_norm` (the pre-clip global norm the loop computed).
Instance wrappers work with any `GRPOTrainer` subclass a user already has, where a subclass of ours would have to
be mixed into theirs.

On a spike the snapshot holds the weights before the update (DCP), each process's micro-batches
(`capture.trl_batch`), the MoE routes (router hooks; `routing.replay: off`, as TRL trains), grad info (the float64
pre-clip norm from the gradients, divided by the clip's coefficient as the verl hook does, and per-parameter norms)
and `run_config.yaml` whose `loss:` section is the trl convention with the trainer's `GRPOConfig` values
(`capture.trl_loss_section`). A skipped step drops the gradients (`optimizer.step()` then moves nothing; the
learning-rate schedule still advances, as on an overflowed fp16 step); a rollback restores the in-memory
checkpoint the guard takes at the start of training and every `checkpoint_every` steps.

Never raises into training: a snapshot that cannot be written is abandoned on every process alike (logged once,
the step handled as decided); anything unexpected turns the guard off for the rest of the run, logged once with its
traceback, and TRL's step goes on unguarded.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from axrl_spike_replay.capture.detectors import Detector
from axrl_spike_replay.capture.spike_guard import SpikeGuard
from axrl_spike_replay.capture.trl_batch import (
    RouteTape,
    install_route_tape,
    micro_batch_fields,
    multimodal_inputs,
    routing_payload,
)
from axrl_spike_replay.capture.trl_loss_section import trl_loss_section
from axrl_spike_replay.training.loss_config import UNREPRODUCED_KEY

log = logging.getLogger("axrl_spike_replay.trl_callback")
_CLIP_EPS = 1e-6  # torch's clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), at most 1


class TrlSpikeCallback(TrainerCallback):
    """Judges each optimizer step of a `GRPOTrainer` with a `SpikeGuard` (see the module docstring)."""

    def __init__(self, trainer: Any, guard: SpikeGuard, checkpoint_every: int | None = None) -> None:
        self.trainer = trainer
        self.guard = guard
        self.checkpoint_every = checkpoint_every
        self.off = False
        self.pending: list[tuple[dict[str, torch.Tensor], float, list[str]]] = []  # this step's micro-batches
        self.grad_norm: float | None = None
        self.tape = RouteTape()
        self.decisions: list[Any] = []

    # the two instance hooks (installed by `attach_spike_guard`)

    def record_loss(self, original: Any, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """`compute_loss` with the micro-batch's inputs (and routes) kept, by reference, for the step."""
        training = bool(getattr(model, "training", False)) and not self.off
        if training:
            self.tape.begin()
        try:
            loss = original(model, inputs, *args, **kwargs)
        finally:
            if training:
                self.tape.end()
        if training:
            self._safely(self._keep, inputs, loss)
        return loss

    def record_norm(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """`_get_grad_norm` with its pre-clip global norm kept for the step."""
        norm = original(*args, **kwargs)
        if not self.off:
            self._safely(self._keep_norm, norm)
        return norm

    def _keep(self, inputs: Any, loss: Any) -> None:
        self.pending.append((inputs, float(loss.detach()), multimodal_inputs(inputs)))

    def _keep_norm(self, norm: Any) -> None:
        self.grad_norm = float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    # TrainerCallback events

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard.action == "rollback":
            self._safely(self.guard.checkpoint, state.global_step, kwargs["model"], kwargs.get("optimizer"))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.off:
            self._safely(self._judge, args, state, kwargs["model"], kwargs.get("optimizer"))
        self.pending, self.grad_norm = [], None
        self.tape.clear()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        every = self.checkpoint_every
        if not self.off and self.guard.action == "rollback" and every and state.global_step % every == 0:
            self._safely(self.guard.checkpoint, state.global_step, kwargs["model"], kwargs.get("optimizer"))

    def _safely(self, action: Any, *args: Any) -> None:
        try:
            action(*args)
        except Exception:
            self.off = True
            log.exception(
                "axrl spike guard: an unexpected error; the guard is off for the rest of this run and training goes "
                "on unguarded (TRL's own step, as without the callback)"
            )

    def _judge(self, args: Any, state: Any, model: Any, optimizer: Any) -> None:
        if self.grad_norm is None:
            self.off = True
            log.error("axrl spike guard: the trainer computed no grad norm this step; the guard is off for the run")
            return
        decision = self.guard.observe(state.global_step + 1, self.grad_norm)
        self.decisions.append(decision)
        if decision.tripped:
            self._snapshot(args, model, decision)
        self.guard.apply(decision, model, optimizer)

    def _snapshot(self, args: Any, model: Any, decision: Any) -> None:
        """Write the snapshot (collective over the processes: each passes its own part, a failure of one is
        carried into the write, which abandons it on all alike)."""
        import dataclasses

        from axrl_spike_replay.capture.float64_norms import float64_grad_norms
        from axrl_spike_replay.capture.rank_agreement import describe
        from axrl_spike_replay.capture.snapshot_writer import RankPayload
        from axrl_spike_replay.snapshot.metadata import ParallelLayout

        accelerator = self.trainer.accelerator
        rank, world = int(accelerator.process_index), int(accelerator.num_processes)
        self.guard.parallel = ParallelLayout(world_size=world, dp=world)
        payloads: dict[int, Any] = {}
        config: dict[str, Any] = {}
        state: Any = {}
        record, error = decision, None
        try:
            state = {k: v.detach() for k, v in model.state_dict().items()}
            norms = float64_grad_norms(model)
            coef = clip_coefficient(self.grad_norm, args.max_grad_norm)
            divisor = coef if 0.0 < coef < math.inf else 1.0
            exact = norms.global_norm / divisor if math.isfinite(decision.grad_norm) else decision.grad_norm
            median = decision.median_norm
            ratio = exact / median if median > 0 and math.isfinite(exact) else decision.spike_ratio
            record = dataclasses.replace(decision, grad_norm=exact, spike_ratio=ratio)
            batches = [micro_batch_fields(inputs, i) for i, (inputs, _, _) in enumerate(self.pending)]
            params = dict(model.named_parameters())
            info = {
                "grad_norm": exact,
                "param_grad_norms": {n: norms.local.get(n, 0.0) / divisor for n in params},
                "param_numel": {n: p.numel() for n, p in params.items()},
                "param_grad_norms_kind": "reduced",
                "clip_coef": coef,
                "trainer_grad_norm": decision.grad_norm,
                "loss": sum(loss for _, loss, _ in self.pending),
            }
            routing = routing_payload(self.tape, batches)
            payloads = {rank: RankPayload({"micro_batches": batches}, info, routing)}
            config = self.run_config(args, model, world, decision.step)
        except Exception as exc:
            error = describe(exc)
        self.guard.snapshot(record, state, payloads, run_config=config, local_error=error)

    def run_config(self, args: Any, model: Any, world: int, step: int) -> dict[str, Any]:
        """The snapshot's run_config.yaml: the trl `loss:` section, the policy's `model:` section (kind hf, with
        TRL's temperature), routing off (TRL replays no routes), a DDP layout and TRL's version."""
        import trl

        trainer = self.trainer
        aux = float(trainer.router_aux_loss_coef) if getattr(trainer, "aux_loss_enabled", False) else 0.0
        loss = trl_loss_section(
            args,
            gradient_accumulation_steps=len(self.pending),
            num_processes=world,
            aux_loss_coef=aux,
            version=trl.__version__,
            use_vllm=bool(getattr(trainer, "use_vllm", False)),
        )
        unreproduced = loss.setdefault(UNREPRODUCED_KEY, [])
        multimodal = sorted({name for _, _, names in self.pending for name in names})
        if multimodal:
            unreproduced.append(f"multimodal inputs {multimodal}: the torch replay builds text-only policies")
        mixed = str(getattr(trainer.accelerator, "mixed_precision", "no"))
        if mixed != "no":
            unreproduced.append(
                f"mixed_precision={mixed}: TRL's forward ran under the accelerator's {mixed} autocast, which the "
                "torch replay does not reproduce"
            )
        if not unreproduced:
            loss.pop(UNREPRODUCED_KEY)
        config = model.config
        doc_model: dict[str, Any] = {
            "kind": "hf",
            "architecture": str(getattr(config, "model_type", "")),
            "config": config.to_dict(),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "temperature": float(args.temperature),
        }
        for key in ("attn_implementation", "experts_implementation"):
            value = getattr(config, f"_{key}", None)
            if isinstance(value, str):
                doc_model[key] = value
        return {
            "loss": loss,
            "model": doc_model,
            "routing": {"replay": "off", "current_routing_layers": []},
            "parallel": {"world_size": world, "dp": world, "strategy": "ddp"},
            "train": {"trainer": "trl", "trl_version": trl.__version__, "global_step": step},
        }


def clip_coefficient(grad_norm: float | None, max_norm: float | None) -> float:
    """The factor the trainer's clip multiplied every gradient by: min(1, max_norm / (norm + 1e-6)) in float32, as
    torch computes it; 1.0 without a clip."""
    if grad_norm is None or not max_norm or max_norm <= 0:
        return 1.0
    norm = torch.tensor(float(grad_norm), dtype=torch.float32)
    return float(torch.clamp(float(max_norm) / (norm + _CLIP_EPS), max=1.0))


def attach_spike_guard(
    trainer: Any,
    snapshots_root: str | Path | None = None,
    *,
    guard: SpikeGuard | None = None,
    action: str = "skip",
    detector: Detector | None = None,
    job_name: str = "trl-job",
    run_id: str | None = None,
    keep_last: int | None = 3,
    checkpoint_every: int | None = None,
) -> TrlSpikeCallback:
    """Guard `trainer` (a TRL `GRPOTrainer`): a callback added to it and its `compute_loss` / `_get_grad_norm`
    wrapped on the instance. `guard` (else one built from the other arguments, `snapshots_root` default
    `<output_dir>/spike_snapshots`). Returns the callback (its `guard` holds the decisions and snapshots).
    ConfigError for a bad setting, before training starts."""
    from axrl_spike_replay.capture.guard_settings import guard_detector

    if guard is None:
        root = Path(snapshots_root) if snapshots_root is not None else Path(trainer.args.output_dir) / "spike_snapshots"
        guard = SpikeGuard(
            root,
            action=action,
            detector=detector or guard_detector(),
            job_name=job_name,
            run_id=run_id,
            keep_last=keep_last,
        )
    callback = TrlSpikeCallback(trainer, guard, checkpoint_every)
    loss_fn, norm_fn = trainer.compute_loss, trainer._get_grad_norm

    def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return callback.record_loss(loss_fn, model, inputs, *args, **kwargs)

    def get_grad_norm(*args: Any, **kwargs: Any) -> Any:
        return callback.record_norm(norm_fn, *args, **kwargs)

    trainer.compute_loss = compute_loss
    trainer._get_grad_norm = get_grad_norm
    try:
        callback.tape = install_route_tape(trainer.accelerator.unwrap_model(trainer.model))
    except Exception as exc:  # no routes is no reason to leave the run unguarded
        log.warning("axrl spike guard: the routers could not be hooked (%s); snapshots will hold no routes", exc)
    trainer.add_callback(callback)
    return callback
