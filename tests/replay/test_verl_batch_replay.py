"""A spike recorded with verl's loss convention, its rank batches rewritten as verl 0.9.1 lays out a rank's
mini-batch (padded, and the engine's jagged layout), replays to the same grad norm and the same verdicts.

The recorded batch (`tiny_snapshot` with `lengths`, verl's loss convention, the trainer's own rank step) has a
real prompt / response split: prompts of 1-4 tokens left-padded, responses of 0-8
tokens right-padded, an attention mask and no route at padding. verl's per-response fields are `[B, R]`
while `input_ids` is `[B, P + R]`: the readers put response token j at column P + j, where the policy's
log-prob of that token is, so the three layouts are the same arithmetic and the grad norms agree bit for bit.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.experiment.result import ReplayResult
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.jobs.job_runner import JobRunner
from axrl_spike_replay.snapshot.fields import canonicalize_batch
from axrl_spike_replay.snapshot.trainer_formats.verl_batch import verl_routes
from verl_layouts import jagged_like_verl, padded_like_verl

PROMPT = 4
LENGTHS = ((4, 2, 3, 1, 4, 3), (8, 5, 7, 0, 3, 8))  # (prompt, response) tokens per sample; sample 3: empty response
VERL_LOSS = {
    "convention": "verl",
    "is_base_logprobs": "old",
    "rollout_is": "token",  # truncated IS against the rollout, with a loose bound: the burst goes through
    "rollout_is_threshold": 1000.0,
    "loss_agg_mode": "seq-mean-token-sum-norm",  # its horizon is verl's response width
    "kl_coef": 0.01,
    "aux_loss_coef": 0.01,
    "z_loss_coef": 0.001,
}
MITIGATION = {"mismatch_token_clip_max": 2}


def rewrite_as_verl(snapshot: Path, dest: Path, jagged: bool) -> Path:
    """A copy of `snapshot` whose rank batches are verl mini-batches. The padded copy keeps routing payloads,
    taken from the batch's `routed_experts` as the verl hook writes them; the jagged copy has none: the
    replay reads the routes the batch carries."""
    shutil.copytree(snapshot, dest)
    for rank in (0, 1):
        ours = torch.load(snapshot / f"batch_rank{rank}.pt", weights_only=True)
        payload_file = dest / f"routing_payload_rank{rank}.pt"
        routes = torch.load(payload_file, weights_only=True)["routed_experts"]
        batch = padded_like_verl(ours, routes, PROMPT)
        if jagged:
            batch = jagged_like_verl(batch)
            payload_file.unlink()
        else:
            hook_routes = verl_routes(canonicalize_batch(batch, "verl mini-batch"))
            assert hook_routes is not None
            torch.save({"routed_experts": hook_routes, "moe_layers": [0, 1], "source": "rollout"}, payload_file)
        torch.save(batch, dest / f"batch_rank{rank}.pt")
    return dest


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verl-layouts")
    ours = record_tiny_snapshot(root / "ours", world_size=2, lengths=LENGTHS, prompt=PROMPT, loss=VERL_LOSS)
    return {
        "ours": ours,
        "verl padded": rewrite_as_verl(ours, root / "padded" / ours.name, jagged=False),
        "verl jagged": rewrite_as_verl(ours, root / "jagged" / ours.name, jagged=True),
    }


def replays(layouts: dict[str, Path], mitigations: Mapping[str, Any] | None = None) -> dict[str, ReplayResult]:
    how = How(nproc=1)
    return {
        name: run_replay(replay_request(What(path, mitigations=mitigations or {}), how=how))
        for name, path in layouts.items()
    }


def test_the_verl_layouts_read_as_our_batch(layouts: dict[str, Path]) -> None:
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch

    ours = load_rank_batch(layouts["ours"], 1)
    for name in ("verl padded", "verl jagged"):
        theirs = load_rank_batch(layouts[name], 1)
        assert torch.equal(theirs["tokens"], ours["tokens"]), name
        assert torch.equal(theirs["loss_mask"], ours["loss_mask"]), name
        assert torch.equal(theirs["attention_mask"], ours["attention_mask"]), name
        on = ours["loss_mask"] > 0
        for field in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
            assert torch.equal(theirs[field][on], ours[field][on]), (name, field)


def test_the_baseline_replays_to_the_same_grad_norm_in_every_layout(layouts: dict[str, Path]) -> None:
    results = replays(layouts)
    norms = {name: r.grad_norm for name, r in results.items()}
    print("baseline grad norms:", norms, "recorded:", results["ours"].recorded_grad_norm)
    assert len(set(norms.values())) == 1, norms
    for result in results.values():
        assert result.verdict == "reproduced"
        assert result.grad_norm == result.recorded_grad_norm


def test_a_mitigation_gives_the_same_verdict_in_every_layout(layouts: dict[str, Path]) -> None:
    results = replays(layouts, mitigations=MITIGATION)
    seen = {name: (r.verdict, r.grad_norm, r.baseline_grad_norm) for name, r in results.items()}
    print("mismatch_token_clip_max=2:", seen)
    assert len(set(seen.values())) == 1, seen


@pytest.mark.slow
def test_full_fidelity_reads_the_jagged_batches_in_each_rank_process(
    layouts: dict[str, Path], warm_runner: JobRunner
) -> None:
    result = run_replay(replay_request(What(layouts["verl jagged"]), how=How(nproc=2)), runner=warm_runner)
    assert result.fidelity == "full"
    assert result.grad_norm == result.recorded_grad_norm
