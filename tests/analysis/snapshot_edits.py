"""Hand edits of a copy of the golden snapshot, for the diagnosis tests (shared helper, not a test)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"


def copy_fixture(tmp_path: Path) -> Path:
    """A copy of the golden job output dir (with its log) under `tmp_path`; its spike snapshot (iteration 21)."""
    out = tmp_path / FIXTURE.name
    shutil.copytree(FIXTURE, out)
    return out / "checkpoints" / "spike_snapshots" / "iter_0000021"


def edit_batch(snapshot: Path, rank: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Load rank `rank`'s batch, apply `edit` to it in place, save it back."""
    path = snapshot / f"batch_rank{rank}.pt"
    batch = torch.load(path, weights_only=True)
    edit(batch)
    torch.save(batch, path)


def edit_grad_info(snapshot: Path, rank: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Load rank `rank`'s grad info, apply `edit` to it in place, save it back."""
    path = snapshot / f"grad_info_rank{rank}.pt"
    info = torch.load(path, weights_only=True)
    edit(info)
    torch.save(info, path)


def no_mismatch(snapshot: Path) -> None:
    """Rollout logprobs made the trainer's on every rank: the fixture's log-prob mismatch is gone."""
    for rank in (0, 1):
        edit_batch(snapshot, rank, lambda b: b.__setitem__("rollout_logprobs", b["old_logprobs"].clone()))


def set_loss(snapshot: Path, **values: Any) -> None:
    """Rewrite keys of the run config's `loss:` section (e.g. the ratio's base)."""
    import yaml

    path = snapshot / "run_config.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["loss"].update(values)
    path.write_text(yaml.safe_dump(doc))


def stale_old_logprobs(snapshot: Path, rank: int, nats: float = 6.0, share: float = 0.3, seed: int = 0) -> None:
    """Rank `rank`'s stored old log-probs made stale: `nats` lower on a random `share` of its loss tokens (the
    policy they came from gave those tokens far less probability), the other ranks' untouched."""
    g = torch.Generator().manual_seed(seed)

    def edit(b: dict[str, Any]) -> None:
        hit = (torch.rand(b["loss_mask"].shape, generator=g) < share).float() * b["loss_mask"]
        b["old_logprobs"] = b["old_logprobs"] - nats * hit

    edit_batch(snapshot, rank, edit)


def shift_routes(snapshot: Path, rank: int, experts: int = 4) -> None:
    """Rank `rank`'s recorded routes all moved to the next expert id (a payload from another table)."""
    path = snapshot / f"routing_payload_rank{rank}.pt"
    payload = torch.load(path, weights_only=True)
    routes = payload["routed_experts"]
    payload["routed_experts"] = torch.where(routes >= 0, (routes + 1) % experts, routes)
    torch.save(payload, path)
