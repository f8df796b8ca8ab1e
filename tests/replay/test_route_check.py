"""Recorded routes are held to the model and the batch before any replay: a payload of the wrong width,
length or batch is refused rather than broadcast, expert ids past the model's experts and `moe_layers` naming
layers the model lacks are refused naming the file (never a C++ error on a rank), and `diagnose` lists the
refusal instead of exiting with a traceback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot
from axrl_spike_replay.errors import AxrlError, SnapshotError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.models.policy import routing_shape
from axrl_spike_replay.models.tiny_moe import TinyMoEConfig
from axrl_spike_replay.replay.reading.route_check import check_route_shapes, check_route_values
from axrl_spike_replay.snapshot.rank_data import RoutingPayload
from hostile_snapshot import edit_routing_payload

PAYLOAD = "routing_payload_rank0.pt"
SHAPE = routing_shape(TinyMoEConfig(n_layers=3, n_experts=4, top_k=2, moe_layers=(0, 2)))


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda doc: doc.__setitem__(key, value)


def _routes(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    return lambda doc: doc.__setitem__("routed_experts", change(doc["routed_experts"]))


SHAPE_EDITS = {
    "top-k width 1": (_routes(lambda r: r[..., :1].clone()), "holds 1 experts per token but the model routes to top-k"),
    "sequence of 1": (_routes(lambda r: r[:, :1].clone()), "the routes must cover every sample and position"),
    "batch of 1": (_routes(lambda r: r[:1].clone()), "the routes must cover every sample and position"),
    "a layer the model lacks": (_set("moe_layers", [0, 5]), "moe_layers names layers [5] the model lacks"),
    "layers swapped": (_set("moe_layers", [1, 0]), "do not match the model's MoE layers [0, 1]"),
    "one slot too many": (_routes(lambda r: torch.cat([r, r[:, :, :1]], dim=2)), "'moe_layers' lists 2 layers"),
}


@pytest.mark.parametrize("edit", SHAPE_EDITS, ids=list(SHAPE_EDITS))
def test_a_payload_that_does_not_fit_is_refused_before_any_replay(
    edit: str, snapshot_copy: Callable[[], Path], workspace: Path
) -> None:
    change, message = SHAPE_EDITS[edit]
    snap = snapshot_copy()
    edit_routing_payload(snap, 0, change)

    with pytest.raises(SnapshotError, match=PAYLOAD) as refused:
        run_request(replay_request(What(snap), how=How(nproc=1), workspace=workspace))
    assert message in str(refused.value)
    assert not (workspace / "tmp").exists()  # refused before the run's output dir was made


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_routes(lambda r: r.masked_fill(torch.arange(r.numel()).view(r.shape) == 7, 4)), "expert ids [4] in"),
        (_routes(lambda r: r.masked_fill(torch.arange(r.numel()).view(r.shape) == 3, -7)), "expert ids [-7] in"),
    ],
    ids=["id past the experts", "negative id"],
)
def test_expert_ids_the_model_lacks_are_refused_naming_the_file(
    change, message: str, snapshot_copy: Callable[[], Path], workspace: Path
) -> None:
    snap = snapshot_copy()
    edit_routing_payload(snap, 0, change)

    with pytest.raises(AxrlError, match=PAYLOAD) as refused:
        run_request(replay_request(What(snap), how=How(nproc=1), workspace=workspace))
    assert message in str(refused.value) and "the model has 4 experts per layer" in str(refused.value)
    assert "Run instead: drop_ranks=0, recompute=routes:rank0,old_logprobs:rank0" in str(refused.value)
    assert "Traceback" not in str(refused.value) and "IndexError" not in str(refused.value)
    assert not (workspace / "tmp").exists()  # the values are read before the run's output dir is made


def test_one_expert_twice_in_a_tokens_top_k_is_computable_and_replays_as_recorded() -> None:
    """Forced routes that list an expert twice are what the trainer ran (that expert counts twice): the check
    passes them; `input_checks` reports them as a finding."""
    routes = torch.tensor([[0, 0], [2, 3], [-1, -1]]).view(1, 3, 1, 2).expand(1, 3, 2, 2).contiguous()
    check_route_values(_payload(routes, [0, 2]), SHAPE)
    with pytest.raises(SnapshotError, match=r"recompute=routes:rank3,old_logprobs:rank3 or drop_ranks=3"):
        check_route_values(_payload(routes.masked_fill(routes == 3, 4), [0, 2]), SHAPE, rank=3)


def test_diagnose_lists_a_payload_it_cannot_replay_instead_of_failing(snapshot_copy: Callable[[], Path]) -> None:
    snap = snapshot_copy()
    edit_routing_payload(snap, 1, _routes(lambda r: r.masked_fill(r == 1, 9)))

    d = diagnose_snapshot(snap, model="always")

    [refusal] = [n for n in d.not_checked if n.startswith("model evidence")]
    assert "rank 1 routed_experts (" in refusal and "routing_payload_rank1.pt): expert ids [9]" in refusal


def _payload(routes: torch.Tensor, layers: list[int] | None) -> RoutingPayload:
    listed = layers is not None
    return RoutingPayload(
        routed_experts=routes,
        moe_layers=layers if listed else list(range(routes.shape[2])),
        source="rollout",
        file=Path("p.pt"),
        layers_listed=listed,
    )


def test_routes_that_fit_pass_and_every_mismatch_is_named() -> None:
    routes = torch.tensor([[0, 1], [2, 3], [-1, -1]]).view(1, 3, 1, 2).expand(1, 3, 2, 2).contiguous()
    check_route_shapes(_payload(routes, [0, 2]), SHAPE, (1, 3))
    check_route_shapes(_payload(routes, None), SHAPE, (1, 3))  # no layer list: the slots in order
    check_route_values(_payload(routes, [0, 2]), SHAPE)
    with pytest.raises(SnapshotError, match=r"p\.pt: moe_layers \[0, 1\] do not match .* \(\[1\] are dense"):
        check_route_shapes(_payload(routes, [0, 1]), SHAPE, (1, 3))
    with pytest.raises(SnapshotError, match=r"has 1 layer slots but the model has 2 MoE layers \[0, 2\]$"):
        check_route_shapes(_payload(routes[:, :, :1], None), SHAPE, (1, 3))
    absolute = routing_shape(TinyMoEConfig(n_layers=3, n_experts=4, top_k=2, moe_layers=(0, 2)))
    assert not absolute.absolute_slots  # the tiny model indexes its MoE layers in order only
