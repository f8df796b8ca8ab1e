"""Replay route 1: a Megatron checkpoint loaded into the matching transformers model computes what megatron-core's
own GPTModel computes from the same checkpoint: the same routes, log-probs and gradients, every parameter
compared under mbridge's mapping of Megatron's names (an independent peer of our checkpoint-key table)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from megatron_helpers import (
    LOGPROB_ATOL,
    assert_computes_what_megatron_computes,
    forward_backward,
    left_padded_batch,
    mbridge_to_hf,
)

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.models.mcore.megatron_weights import check_megatron_weights, expected_megatron_shapes
from axrl_spike_replay.models.policy import build_policy, load_policy_weights, parse_model_config, policy_forward
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.processes.rank_processes import spawn_ranks
from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

pytestmark = pytest.mark.slow

# fp32 on CPU, one thread: the two models sum in different orders (fused QKV vs three projections, experts'
# token order, RMSNorm's rsqrt placement), so values agree to a few float32 ulps, not bit for bit. Measured:
# log-probs within 5e-7, gradients within 5e-7 relative; the bounds leave a 20x margin.


@pytest.mark.parametrize("router", [pytest.param(0.0, marks=pytest.mark.matrix), 0.01])  # 0.01 checks 0.0's facts too
def test_transformers_model_computes_what_megatron_computes(
    megatron_checkpoints: dict[str, Path], tmp_path: Path, router: float
) -> None:
    """With `router` > 0 the loss (its router z- and aux losses) reaches the left-padded prompt's positions: their
    attention rows see no key, and route 1 must pass them no gradient, as Megatron's filled scores do."""
    section, batch = tiny_section(), left_padded_batch()
    out = tmp_path / "megatron.pt"
    spawn_ranks(forward_backward, 1, (section, str(megatron_checkpoints["tp1"]), batch, str(out), None, router))
    megatron = torch.load(out, weights_only=True)

    spec = parse_model_config(section)
    policy = build_policy(spec)
    load_policy_weights(policy, spec, megatron_checkpoints["tp1"])
    assert_computes_what_megatron_computes(policy, batch, megatron, partial(mbridge_to_hf, section), router)


def test_every_saved_layout_loads_the_same_transformers_model(megatron_checkpoints: dict[str, Path]) -> None:
    spec = parse_model_config(tiny_section())
    states = {}
    for name, directory in megatron_checkpoints.items():
        policy = build_policy(spec)
        load_policy_weights(policy, spec, directory)
        states[name] = policy.state_dict()
    reference = states.pop("tp1")
    for name, state in states.items():
        assert all(torch.equal(state[k], reference[k]) for k in reference), name


def test_the_checkpoint_is_checked_against_the_model_before_loading(megatron_checkpoints: dict[str, Path]) -> None:
    spec = parse_model_config(tiny_section())
    assert expected_megatron_shapes(spec)["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, 8, 64, 64)
    check_megatron_weights(megatron_checkpoints["ep2"], spec, "the snapshot's checkpoint")
    wider = parse_model_config(tiny_section(config={**tiny_section()["config"], "moe_intermediate_size": 48}))
    with pytest.raises(SnapshotError, match=r"linear_fc1\.weight \(2, 8, 64, 64\) \(the run config's model needs"):
        check_megatron_weights(megatron_checkpoints["ep2"], wider, "the snapshot's checkpoint")
    mixtral = parse_model_config(tiny_section("mixtral"))
    with pytest.raises(SnapshotError, match=r"does not place.*q_layernorm.*--backend command"):
        check_megatron_weights(megatron_checkpoints["tp1"], mixtral, "the snapshot's checkpoint")


@pytest.mark.matrix
def test_a_mixtral_checkpoint_maps_too(tmp_path: Path) -> None:
    """The second mapped architecture: megatron-core saves a Mixtral-shaped GPTModel (no QK norms, softmax then
    renormalised top-k), route 1 gives Megatron's routes and log-probs from it."""
    from axrl_spike_replay.testing.megatron_checkpoints import LAYOUTS, save_checkpoints

    section, batch = tiny_section("mixtral"), left_padded_batch()
    checkpoint = tmp_path / "mixtral"
    save_checkpoints(section, [(LAYOUTS["tp1"], checkpoint)], None)
    out = tmp_path / "megatron.pt"
    spawn_ranks(forward_backward, 1, (section, str(checkpoint), batch, str(out), None, 0.0))
    megatron = torch.load(out, weights_only=True)
    spec = parse_model_config(section)
    policy = build_policy(spec)
    load_policy_weights(policy, spec, checkpoint)
    ours = policy_forward(policy, batch, RoutingControl(), need_entropy=False)
    assert torch.equal(ours.routes, megatron["routes"])
    assert (ours.logprobs - megatron["logprobs"]).abs().max() < LOGPROB_ATOL
