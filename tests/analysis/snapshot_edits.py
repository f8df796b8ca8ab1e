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


def rerecord(snapshot: Path) -> None:
    """Record the edited step as a trainer that trained on the edited batches would have: each rank's grad info
    (global norm, local per-parameter norms, loss) and the metadata's grad norm and spike ratio, from the replay of
    the edited snapshot. A hand edit then plants a fault the trainer ran, as a captured one is, not a stored batch
    that is not the one it trained on (which `diagnose` reads as a step that does not reproduce)."""
    import json

    from axrl_spike_replay.replay.analyses.step_evidence_run import step_evidence

    channel = step_evidence(snapshot, shard="off").channel
    assert channel is not None
    for path in sorted(snapshot.glob("grad_info_rank*.pt")):
        rank = int(path.stem.removeprefix("grad_info_rank"))
        info = torch.load(path, weights_only=True)
        norms = channel.param_norms_of(rank)
        assert norms is not None
        info["grad_norm"] = channel.grad_norm
        info["param_grad_norms"] = {name: norms[name] for name in info["param_grad_norms"]}
        info["loss"] = channel.rank_loss(rank)
        torch.save(info, path)
    meta_path = snapshot / "axrl_metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["grad_norm"] = channel.grad_norm
    meta["spike_ratio"] = channel.grad_norm / meta["median_norm"]
    meta_path.write_text(json.dumps(meta, indent=1))


def diagnosed(snapshot: Path, **options: Any) -> Any:
    """`diagnose_snapshot` of a hand-edited snapshot, its step first recorded as trained (`rerecord`)."""
    from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot

    rerecord(snapshot)
    return diagnose_snapshot(snapshot, **options)
