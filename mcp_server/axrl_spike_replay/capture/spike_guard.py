"""The spike guard for a PyTorch training loop: detect a grad-norm spike, snapshot it, then log, skip or roll back.

Example (one process or every data-parallel rank alike)::

    guard = SpikeGuard(out_dir / SNAPSHOTS_DIR, action="skip", job_name="my-job", run_id=run_id,
                       detector=MedianRatioDetector(window=20, threshold=5.0, warmup=10), keep_last=3)
                       # armed from step 1: non-finite norms, and > 10x the median of the steps seen in warm-up
    guard.checkpoint(0, model, optimizer)               # only needed for action="rollback"
    for step, batch in enumerate(loader, start=1):
        loss = compute_loss(model, batch)
        loss.backward()                                 # under DP: after the gradient all-reduce
        grad_norm = total_grad_norm(model)              # global, pre-clip: identical on every rank
        decision = guard.observe(step, grad_norm)
        if decision.tripped:
            guard.snapshot(decision, model.state_dict(), {rank: RankPayload(batch, grad_info, routes)})
        if guard.apply(decision, model, optimizer):     # False: the step was skipped or rolled back
            clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        optimizer.zero_grad()
        if step % 100 == 0:
            guard.checkpoint(step, model, optimizer)

With a GradScaler (fp16), pass it to `apply` after `scaler.unscale_(optimizer)`: a skipped step then closes the
scaler's step with `scaler.update()` as `scaler.step` + `update` would have, so the next `unscale_` is allowed.

Under torch.distributed every rank feeds the same reduced norm, so every rank takes the same
decision; `snapshot` is collective (each rank passes its own payload). The guard never raises into the loop:
a snapshot that cannot be written (a full disk, an unwritable dir, a failure on any rank) is abandoned on every
rank alike, nothing of it left behind, logged once per kind of failure, and the step goes on as decided. A
`run_id` names snapshots `iter_<step>-<run_id>`, so a restarted run never meets a previous run's snapshot;
without one, a name already taken gets a `-<k>` suffix (see `snapshot_writer.free_snapshot_name`).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.capture.detectors import Detector, MedianRatioDetector
from axrl_spike_replay.capture.rank_agreement import describe, error_kind
from axrl_spike_replay.capture.snapshot_writer import RankPayload, SnapshotWriteError, write_snapshot
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.snapshot.layout import is_valid_tag
from axrl_spike_replay.snapshot.metadata import AxrlMetadata, ParallelLayout
from axrl_spike_replay.vocabulary import GUARD_ACTIONS, GuardAction

if TYPE_CHECKING:
    import torch
    from torch import nn

ACTIONS = GUARD_ACTIONS  # what a tripped guard may do
RUN_ID_MAX = 48  # leaves room in a 64-character tag for a `.<k>` collision suffix
log = logging.getLogger("axrl_spike_replay.guard")


@dataclass(frozen=True)
class GuardDecision:
    """The guard's verdict on one step. `action` is "proceed" unless it tripped."""

    step: int
    grad_norm: float
    median_norm: float
    spike_ratio: float
    score: float
    tripped: bool
    warming_up: bool
    action: GuardAction
    rule: str = ""  # which rule tripped (`detectors.RULES`): the detector's own, or in the warm-up `warmup_ratio` ...

    @property
    def apply_update(self) -> bool:
        """Whether the optimizer step should happen."""
        return self.action in (GuardAction.PROCEED, GuardAction.LOG)


@dataclass
class _Checkpoint:
    step: int
    model: dict[str, Any]
    optimizer: dict[str, Any] | None


class SpikeGuard:
    """Detect spikes on the pre-clip grad norm, write snapshots, and log, skip or roll back."""

    def __init__(
        self,
        snapshots_root: str | Path,
        *,
        action: GuardAction | str = GuardAction.SKIP,
        detector: Detector | None = None,
        keep_last: int | None = 3,
        job_name: str = "job",
        role: str = "actor",
        parallel: ParallelLayout | None = None,
        run_config: Mapping[str, Any] | None = None,
        legacy_layout: bool = False,
        rollback_to: Callable[[], int] | None = None,
        run_id: str | None = None,
    ) -> None:
        if action not in ACTIONS:
            raise ConfigError(f"spike guard action must be one of {ACTIONS}, got {action!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"spike guard keep_last must be an integer >= 1 or None, got {keep_last!r}")
        if run_id is not None and (not isinstance(run_id, str) or len(run_id) > RUN_ID_MAX or not is_valid_tag(run_id)):
            raise ConfigError(
                f"spike guard run_id must be 1-{RUN_ID_MAX} letters, digits, '.', '_' or '-' starting with a letter "
                f"or digit, got {run_id!r}"
            )
        self.snapshots_root = Path(snapshots_root)
        self.action = GuardAction(action)
        self.detector: Detector = detector or MedianRatioDetector()
        self.keep_last = keep_last
        self.job_name = job_name
        self.role = role
        self.parallel = parallel or ParallelLayout()
        self.run_config = dict(run_config or {})
        self.legacy_layout = legacy_layout
        self.rollback_to = rollback_to
        self.run_id = run_id
        self.trips: list[GuardDecision] = []
        self.snapshots: list[Path] = []
        self.write_failures: list[str] = []  # every snapshot that could not be written, and why
        self._checkpoint: _Checkpoint | None = None
        self._swept = False
        self._reported: set[str] = set()  # kinds of failure already logged

    def observe(self, step: int, grad_norm: float) -> GuardDecision:
        """Judge this step's global pre-clip grad norm (the same value on every DP rank)."""
        seen = self.detector.observe(float(grad_norm))
        decision = GuardDecision(
            step=step,
            grad_norm=seen.grad_norm,
            median_norm=seen.median_norm,
            spike_ratio=seen.spike_ratio,
            score=seen.score,
            tripped=seen.tripped,
            warming_up=seen.warming_up,
            action=self.action if seen.tripped else GuardAction.PROCEED,
            rule=seen.rule,
        )
        if decision.tripped:
            self.trips.append(decision)
        if decision.tripped and _rank() == 0:
            log.warning("spike at step %d: %s; action: %s", step, self._why(decision), self.action)
        return decision

    def _why(self, decision: GuardDecision) -> str:
        """What tripped, in words, for the log line."""
        norm = f"grad norm {decision.grad_norm:.6g}"
        if decision.rule == "non_finite":
            return f"{norm} is not finite"
        if decision.rule == "max_norm":
            return f"{norm} is above the guard's max_norm {getattr(self.detector, 'max_norm', None)} (warm-up)"
        if decision.rule == "warmup_ratio":
            return (
                f"{norm} is {decision.spike_ratio:.3g}x the median {decision.median_norm:.6g} of the steps seen so far "
                f"(warm-up ratio {getattr(self.detector, 'warmup_ratio', None)})"
            )
        return (
            f"{norm} is {decision.spike_ratio:.3g}x the rolling median {decision.median_norm:.6g} "
            f"({self.detector.kind} threshold {self.detector.threshold:g})"
        )

    def snapshot(
        self,
        decision: GuardDecision,
        model_state: Mapping[str, torch.Tensor],
        ranks: Mapping[int, RankPayload],
        *,
        run_config: Mapping[str, Any] | None = None,
        local_error: str | None = None,
        weights_writer: Callable[[Path], None] | None = None,
    ) -> Path | None:
        """Write `iter_<step>` (`iter_<step>-<run_id>`) atomically (collective under DP), then rotate to the newest
        `keep_last`; its path, or None when it could not be written.

        Never raises: a failure on any rank (or `local_error`: this rank could not collect its part) abandons the
        write on every rank alike, leaves nothing behind, is kept in `write_failures` and logged once per kind.
        `weights_writer(dir)` writes the weights instead of `model_state` (Megatron's dist_checkpointing)."""
        self._sweep_once()
        problem = local_error
        try:
            metadata = AxrlMetadata(
                job_name=self.job_name,
                role=self.role,
                iteration=decision.step,
                grad_norm=decision.grad_norm,
                median_norm=decision.median_norm,
                spike_ratio=decision.spike_ratio,
                detector=self.detector.spec(),
                parallel=self.parallel,
                created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            )
            config = dict(run_config if run_config is not None else self.run_config)
        except Exception as exc:  # still enter the collective write: the other ranks are waiting in it
            problem = problem or describe(exc)
            metadata = AxrlMetadata(self.job_name, self.role, decision.step, decision.grad_norm, 0.0, 0.0)
            config = {}
        try:
            path = write_snapshot(
                self.snapshots_root,
                metadata,
                config,
                model_state,
                ranks,
                keep_last=self.keep_last,
                legacy_layout=self.legacy_layout,
                tag=self.run_id,
                local_error=problem,
                weights_writer=weights_writer,
            )
        except Exception as exc:  # a failed write, or a collective that failed under it: never the loop's problem
            self._write_failed(decision, exc)
            return None
        self.snapshots = [p for p in self.snapshots if os.path.lexists(p)] + [path]
        return path

    def _write_failed(self, decision: GuardDecision, exc: Exception) -> None:
        agreed = isinstance(exc, SnapshotWriteError)  # every rank holds the same message: rank 0 tells it
        message = str(exc) if agreed else f"{self.snapshots_root}: snapshot of step {decision.step}: {describe(exc)}"
        self.write_failures.append(message)
        if agreed and _rank() != 0:
            return
        errors = exc.errors if isinstance(exc, SnapshotWriteError) else []
        kinds = {error_kind(e) for e in errors if e} or {error_kind(describe(exc))}
        if kinds <= self._reported:
            log.debug("spike guard: %s", message)
            return
        self._reported |= kinds
        log.error(
            "spike guard: %s; training goes on and the step is handled as decided (%s). A failure of this kind "
            "is logged once; guard.write_failures lists every one",
            message,
            decision.action,
        )

    def checkpoint(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Keep an in-memory copy of model and optimizer state to roll back to."""
        self._checkpoint = _Checkpoint(
            step=step,
            model=copy.deepcopy(model.state_dict()),
            optimizer=copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
        )

    @property
    def last_checkpoint_step(self) -> int | None:
        return self._checkpoint.step if self._checkpoint else None

    def apply(
        self,
        decision: GuardDecision,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
    ) -> bool:
        """Act on the decision; True when the caller should apply the optimizer step.

        skip: gradients are dropped. rollback: model and optimizer state return to the last
        checkpoint (or `rollback_to()` runs) and the batch is dropped; with no checkpoint yet, or when
        restoring fails (logged), it skips. `scaler` (a GradScaler the caller already `unscale_`d): a step
        not taken is closed with `scaler.update()`, as `scaler.step` + `update` close one that found infs.
        """
        if decision.apply_update:
            return True
        if decision.action == GuardAction.ROLLBACK:
            try:
                self._roll_back(decision, model, optimizer)
            except Exception as exc:  # a rollback that cannot restore: the step is skipped instead
                self._report_once("rollback", f"step {decision.step}: rollback failed ({describe(exc)}); skipped")
        _drop_grads(model, optimizer)
        if scaler is not None:
            scaler.update()
        return False

    def _roll_back(self, decision: GuardDecision, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if self.rollback_to is not None:
            restored = self.rollback_to()
            _warn("step %d rolled back to step %s by the caller's rollback", decision.step, restored)
        elif self._checkpoint is not None:
            model.load_state_dict(copy.deepcopy(self._checkpoint.model))
            if optimizer is not None and self._checkpoint.optimizer is not None:
                optimizer.load_state_dict(copy.deepcopy(self._checkpoint.optimizer))
            _warn("step %d rolled back to the checkpoint of step %d", decision.step, self._checkpoint.step)
        else:
            _warn("step %d: no checkpoint to roll back to yet; skipping the step instead", decision.step)

    def _report_once(self, kind: str, message: str) -> None:
        if kind in self._reported:
            log.debug("spike guard: %s", message)
            return
        self._reported.add(kind)
        log.error("spike guard: %s (logged once)", message)

    def _sweep_once(self) -> None:
        """Sweep interrupted writes before the first snapshot; a failure is logged (a later write may still work)."""
        if self._swept:
            return
        try:
            self._sweep_interrupted_writes()
        except OSError as exc:
            self._report_once(
                "sweep", f"could not remove an interrupted write under {self.snapshots_root}: {describe(exc)}"
            )

    def _sweep_interrupted_writes(self) -> None:
        """Remove staging dirs that an interrupted write of ours left behind (rank 0 only)."""
        self._swept = True
        if _rank() != 0 or not self.snapshots_root.is_dir():
            return
        for entry in self.snapshots_root.glob(".iter_*.writing"):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)


def _drop_grads(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)


def _warn(message: str, *args: Any) -> None:
    if _rank() == 0:
        log.warning(message, *args)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
