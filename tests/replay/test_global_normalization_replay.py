"""A step normalised by its global counts (`loss.normalization: global`) replays as the trainer computed it, at
full and reduced fidelity, under either convention, and a replay tells it apart from per-rank normalisation.

The captures (`tiny_snapshot`: the trainer's own step functions, the step's counts recorded in every rank's grad
info) have what makes the two normalisations differ: ranks whose responses differ in length (31 and 20 loss
tokens) and one empty response on each rank. `token-mean` then divides by the step's 51 tokens instead of a
rank's own 31 or 20; verl's `seq-mean-token-mean` by the step's 12 sequences, empty ones included, instead of a
rank's 5 with a response. A mitigation that leaves tokens out of the loss changes the step's token count: the
replay recounts it over every saved rank, whatever its layout, as the trainer would have counted it. (verl's
sequence count takes every sequence, masked or not, so no mitigation changes what its seq-mean modes divide by.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_snapshot import LOSS, record_tiny_snapshot, step_grad_norm

from axrl_spike_replay.experiment.mitigation.mitigations import apply_config, parse_config
from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.snapshot.rank_data import load_grad_info
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.loss_normalization import GRAD_INFO_KEY, GlobalCounts
from axrl_spike_replay.training.routing_config import RoutingConfig

PROMPT = 4
# (prompt, response) tokens per sample, per rank: responses 31 and 20 tokens long in all, one empty on each rank
RANK_LENGTHS = (
    ((4, 2, 3, 1, 4, 3), (8, 5, 7, 0, 3, 8)),
    ((2, 4, 1, 3, 2, 4), (2, 0, 6, 1, 8, 3)),
)
VERL = {**LOSS, "convention": "verl", "is_base_logprobs": "old"}
SETUPS = {
    "axrl token-mean": {**LOSS, "loss_agg_mode": "token-mean"},
    "verl token-mean": {**VERL, "loss_agg_mode": "token-mean"},
    "verl seq-mean-token-mean": {**VERL, "loss_agg_mode": "seq-mean-token-mean"},
}
# The step's counts each convention takes: axrl counts the sequences with loss tokens, verl every sequence.
COUNTS = {"axrl": GlobalCounts(2, 51.0, 10.0), "verl": GlobalCounts(2, 51.0, 12.0)}
# A mitigation that leaves tokens out of the loss under each convention at normalization global. axrl refuses
# ratio_outlier_mask there (its mask needs the forward, after the counts are taken), so it drops a burst sample.
MASKING = {
    "axrl": {"drop_samples": "0:1"},
    "verl": {"ratio_outlier_mask": "token"},  # verl's rejection sampling: the burst's pi/pi_rollout is about e^3
}
SAME = 1e-5  # what a reduced replay may differ by


def convention(setup: str) -> str:
    return setup.split()[0]


def capture_kwargs(setup: str, normalization: str) -> dict[str, Any]:
    """`record_tiny_snapshot`'s arguments for a setup's capture under one normalisation."""
    return {"rank_lengths": RANK_LENGTHS, "prompt": PROMPT, "loss": {**SETUPS[setup], "normalization": normalization}}


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Path]]:
    """A setup's captures of the same batches, one per normalisation (recorded on first use)."""
    made: dict[str, dict[str, Path]] = {}

    def get(setup: str) -> dict[str, Path]:
        if setup not in made:
            root = tmp_path_factory.mktemp(setup.replace(" ", "-"))
            made[setup] = {
                norm: record_tiny_snapshot(root / norm, world_size=2, **capture_kwargs(setup, norm))
                for norm in ("global", "per_rank")
            }
        return made[setup]

    return get


def replay(snapshot: Path, nproc: int, mitigations: dict[str, Any] | None = None) -> ReplayResult:
    result = run_replay(replay_request(What(snapshot, mitigations=mitigations or {}), how=How(nproc=nproc)))
    assert result.grad_norm is not None, result.error
    return result


def rel(a: float | None, b: float | None) -> float:
    assert a is not None and b is not None
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_the_capture_records_the_steps_counts_on_every_rank(
    setup: str, captures: Callable[[str], dict[str, Path]]
) -> None:
    snapshot = captures(setup)["global"]
    recorded = [GlobalCounts.from_doc(load_grad_info(snapshot, r)[GRAD_INFO_KEY], "grad info") for r in (0, 1)]
    assert recorded == [COUNTS[convention(setup)]] * 2
    local = [float(torch.load(snapshot / f"batch_rank{r}.pt")["loss_mask"].sum()) for r in (0, 1)]
    assert local == [31.0, 20.0]  # unequal ranks: a rank's own count is not its share of the step's


@pytest.mark.parametrize("setup", list(SETUPS))
def test_global_normalisation_is_not_per_rank(setup: str, captures: Callable[[str], dict[str, Path]]) -> None:
    global_norm = replay(captures(setup)["global"], nproc=1).grad_norm
    per_rank_norm = replay(captures(setup)["per_rank"], nproc=1).grad_norm
    print(f"{setup}: global {global_norm}, per_rank {per_rank_norm}, {rel(global_norm, per_rank_norm):.1%} apart")
    assert rel(global_norm, per_rank_norm) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["axrl token-mean", "verl seq-mean-token-mean"])  # both conventions, both counts
def test_full_and_reduced_replays_agree_under_global_normalisation(
    setup: str, captures: Callable[[str], dict[str, Path]]
) -> None:
    full, reduced = replay(captures(setup)["global"], nproc=2), replay(captures(setup)["global"], nproc=1)
    print(f"{setup}: full {full.grad_norm}, reduced {reduced.grad_norm}")
    assert (full.fidelity, reduced.fidelity) == ("full", "full")  # every saved rank, fewer processes
    assert full.grad_norm == full.recorded_grad_norm
    assert rel(reduced.grad_norm, full.grad_norm) <= SAME


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["axrl token-mean", "verl token-mean"])
def test_a_mitigation_that_masks_tokens_normalises_by_the_recounted_counts(
    setup: str, captures: Callable[[str], dict[str, Path]]
) -> None:
    mitigation = MASKING[convention(setup)]
    snapshot = captures(setup)["global"]
    full, reduced = replay(snapshot, 2, mitigation), replay(snapshot, 1, mitigation)
    masked_tokens = sum(m["loss_tokens"] for m in full.rank_metrics)
    assert masked_tokens < COUNTS[convention(setup)].batch_num_tokens, "the mitigation leaves tokens out"
    assert rel(reduced.grad_norm, full.grad_norm) <= SAME

    # The trainer's step functions on the mitigated loss: with the step's counts taken again from the masked
    # batches, and with the recorded counts of the unmasked step (what a replay that did not recount would give).
    kwargs = capture_kwargs(setup, "global")
    applied = apply_config(parse_config(mitigation), LossConfig.from_dict(kwargs["loss"]), RoutingConfig(replay="all"))
    recounted = step_grad_norm(applied.loss, samples=applied.samples, **kwargs)
    stale = step_grad_norm(applied.loss, COUNTS[convention(setup)], applied.samples, **kwargs)
    print(
        f"{setup} {mitigation} ({masked_tokens:g} tokens): replay {full.grad_norm}, recounted {recounted}, "
        f"recorded counts {stale}"
    )
    assert rel(full.grad_norm, recounted) <= SAME
    assert rel(full.grad_norm, stale) > 1e-3
