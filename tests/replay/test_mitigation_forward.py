"""Mitigations that change the forward (routing) or the weights: the replayed loss equals the loss of a
forward pass built by hand with that routing or those weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.models.tiny_moe import RoutingControl, TinyMoEConfig, TinyMoEPolicy
from axrl_spike_replay.replay.reading.inputs import read_run_config
from axrl_spike_replay.replay.sweep import run_sweep
from axrl_spike_replay.snapshot.dcp.checkpoint import load_model_state
from axrl_spike_replay.snapshot.layout import routing_payload_file
from axrl_spike_replay.snapshot.rank_data import load_rank_batch
from axrl_spike_replay.training.policy_loss import LossConfig
from axrl_spike_replay.training.rank_step import rank_forward_backward
from axrl_spike_replay.vocabulary import Verb

FORCED = (3, 2)  # every token, every MoE layer: experts 3 and 2 (the current router rarely picks these)


@pytest.fixture(scope="module")
def forced_routes(tmp_path_factory: pytest.TempPathFactory, spike_snapshot: Path) -> Path:
    """The spike snapshot with routing payloads that force experts (3, 2) everywhere."""
    import shutil

    snap = tmp_path_factory.mktemp("forced") / spike_snapshot.name
    shutil.copytree(spike_snapshot, snap)
    for rank in (0, 1):
        path = snap / routing_payload_file(rank)
        doc = torch.load(path, weights_only=True)
        routes = torch.empty_like(doc["routed_experts"])
        routes[..., 0], routes[..., 1] = FORCED
        torch.save({**doc, "routed_experts": routes}, path)
    return snap


def _model(weights: Path, cfg: TinyMoEConfig) -> TinyMoEPolicy:
    model = TinyMoEPolicy(cfg)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    load_model_state(weights, state)
    model.load_state_dict(state)
    return model


def hand_losses(snap: Path, weights: Path, routing: Callable[[dict, torch.Tensor], RoutingControl]) -> list[float]:
    """Each rank's loss from a forward whose routing (and weights) are chosen here."""
    doc = read_run_config(snap)
    model = _model(weights, TinyMoEConfig.from_dict(doc["model"]))
    loss_cfg = LossConfig.from_dict(doc["loss"])
    out = []
    for rank in (0, 1):
        batch = load_rank_batch(snap, rank)
        routes = torch.load(snap / routing_payload_file(rank), weights_only=True)["routed_experts"].long()
        result = rank_forward_backward(model, batch, loss_cfg, routing(batch, routes), backward=False)
        out.append(float(result.loss.detach()))
    return out


def save_initial_model(snap: Path, dest: Path) -> Path:
    """The run's initial weights (the reference trainer seeds torch with train.seed) as a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp

    doc = read_run_config(snap)
    torch.manual_seed(doc["train"]["seed"])
    model = TinyMoEPolicy(TinyMoEConfig.from_dict(doc["model"]))
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=str(dest), no_dist=True)
    return dest


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_routing_and_weight_mitigations_change_the_forward_as_specified(forced_routes: Path, tmp_path: Path) -> None:
    initial = save_initial_model(forced_routes, tmp_path / "initial_model")
    configs = [
        {"routing_replay": "off"},
        {"routing_replay": "loss_tokens"},
        {"current_routing_layers": [1]},
        {"initial_model": str(initial)},
    ]
    sweep = run_sweep(replay_request(What(forced_routes, verb=Verb.SWEEP, configs=tuple(configs)), how=How(nproc=1)))
    replayed = {r.config_id: [m["loss"] for m in r.rank_metrics] for r in (sweep.baseline, *sweep.results)}
    snap = forced_routes
    expected = {
        "baseline": hand_losses(snap, snap, lambda b, r: RoutingControl(routes=r)),
        "routing_replay=off": hand_losses(snap, snap, lambda b, r: RoutingControl()),
        "routing_replay=loss_tokens": hand_losses(
            snap, snap, lambda b, r: RoutingControl(routes=r, replay_tokens=b["loss_mask"] > 0)
        ),
        "current_routing_layers=1": hand_losses(
            snap, snap, lambda b, r: RoutingControl(routes=r, current_layers=frozenset({1}))
        ),
        f"initial_model={initial.name}": hand_losses(snap, initial, lambda b, r: RoutingControl(routes=r)),
    }
    assert set(replayed) == set(expected)
    for config_id, losses in expected.items():
        assert replayed[config_id] == pytest.approx(losses, rel=1e-6), config_id
        if config_id != "baseline":
            assert replayed[config_id] != pytest.approx(expected["baseline"], rel=1e-4), config_id
