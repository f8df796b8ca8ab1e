"""The leave-out invariance check (shared helper, not a test): a saved rank that `drop_ranks` / `keep_ranks` leaves
out contributes nothing to the replayed step, its batch-level router losses (aux, z) included. So replacing that
rank's batch by random tokens changes nothing, to the bit: the replay's grad norm, its top parameters, the kept
ranks' losses, and the loss channel split per term and per rank."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.analyses.step_evidence_run import step_evidence
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.reading.inputs import read_run_config
from axrl_spike_replay.vocabulary import Shard


def vocab_of(snapshot: Path) -> int:
    """The policy's vocabulary size, from the snapshot's run config (the tiny model's or a transformers config's)."""
    model = read_run_config(snapshot)["model"]
    return int(model.get("vocab_size") or model["config"]["vocab_size"])


def randomised_copy(snapshot: Path, into: Path, rank: int, vocab: int, seed: int = 0) -> Path:
    """A copy of `snapshot` whose rank `rank` batch holds random tokens (below `vocab`, its padding kept)."""
    copy = into / snapshot.name
    shutil.copytree(snapshot, copy)
    path = copy / f"batch_rank{rank}.pt"
    batch: dict[str, Any] = torch.load(path, weights_only=True)
    tokens = batch["tokens"]
    drawn = torch.randint(3, vocab, tokens.shape, generator=torch.Generator().manual_seed(seed), dtype=tokens.dtype)
    batch["tokens"] = torch.where(tokens > 0, drawn, tokens)  # a 0 is left padding: the mask stays as it was
    torch.save(batch, path)
    return copy


def _figures(snapshot: Path, mitigations: dict[str, Any], nproc: int | None, shard: str = "off") -> dict[str, Any]:
    result = run_replay(
        replay_request(What(snapshot, mitigations=mitigations), how=How(nproc=nproc, shard=Shard(shard)))
    )
    return {
        "grad_norm": result.grad_norm,
        "top_params": result.top_params,
        "kept_losses": [m["loss"] for m in result.rank_metrics if not m.get("left_out")],
        "left_out": [m["rank"] for m in result.rank_metrics if m.get("left_out")],
    }


def _channel(snapshot: Path, mitigations: dict[str, Any]) -> dict[str, Any]:
    channel = step_evidence(snapshot, mitigations=mitigations, shard="off").channel
    assert channel is not None
    return {
        "grad_norm": channel.grad_norm,
        "terms": {t.term: [(r.rank, r.grad_norm, r.share, r.value) for r in t.ranks] for t in channel.terms},
        "rank_losses": channel.rank_losses,
    }


def check_leave_out_invariance(
    snapshot: Path, tmp_path: Path, rank: int = 1, world_size: int = 2, nproc: int | None = 1, shard: str = "off"
) -> None:
    """Leaving rank `rank` out gives the same step whatever its batch holds (see the module doc), and leaving it out
    changes the step (it carried part of it, router terms included). `shard` on: the replay's processes hold the
    policy sharded with FSDP2 (a left-out rank's pass then only keeps the collectives in step)."""
    noise = randomised_copy(snapshot, tmp_path, rank, vocab_of(snapshot))
    others = ",".join(str(r) for r in range(world_size) if r != rank)
    for lever in ({"drop_ranks": str(rank)}, {"keep_ranks": others}):
        real, random = _figures(snapshot, lever, nproc, shard), _figures(noise, lever, nproc, shard)
        assert real == random, lever  # to the bit: floats compared with ==
        assert real["left_out"] == [rank]
    real, random = _channel(snapshot, {"drop_ranks": str(rank)}), _channel(noise, {"drop_ranks": str(rank)})
    assert real == random
    for term, rows in real["terms"].items():  # nothing of the left-out rank in any term, the router terms included
        assert all(g == 0.0 and share == 0.0 for r, g, share, _ in rows if r == rank), term
    assert {"aux", "z"} <= set(real["terms"])  # the run has router losses: the kept ranks' are there
    replayed = _figures(snapshot, {"drop_ranks": str(rank)}, nproc, shard)["grad_norm"]
    assert abs(real["grad_norm"] - replayed) <= 1e-5 * replayed  # the channel splits the replayed gradient
    baseline = run_replay(replay_request(What(snapshot), how=How(nproc=nproc, shard=Shard(shard)))).grad_norm
    assert baseline is not None and replayed != baseline
