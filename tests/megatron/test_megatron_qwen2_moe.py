"""Qwen2-MoE on replay route 1: megatron-core builds it with a QKV bias and a shared expert whose output a sigmoid
gate scales (`add_qkv_bias`, `moe_shared_expert_intermediate_size`, `moe_shared_expert_gate`), saves it with
`dist_checkpointing.save`, and the checkpoint loaded into transformers' Qwen2MoeForCausalLM computes what
megatron-core's own model computes: the same routes, log-probs and gradients, every parameter compared under
mbridge's Qwen2MoEBridge mapping."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from megatron_helpers import (
    REASON,
    assert_computes_what_megatron_computes,
    forward_backward,
    left_padded_batch,
    mbridge_to_hf,
    more_layouts,
)

from axrl_spike_replay.investigation.request import How, What, Where, replay_request
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.mcore.megatron_weights import check_megatron_weights, expected_megatron_shapes
from axrl_spike_replay.models.policy import build_policy, load_policy_weights, parse_model_config
from axrl_spike_replay.processes.rank_processes import spawn_ranks
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.testing.megatron_checkpoints import save_layouts, tiny_section
from axrl_spike_replay.vocabulary import Backend, Shard

pytestmark = pytest.mark.slow

# fp32 on CPU, one thread: the two models sum in different orders (fused QKV vs split projections, experts' token
# order, RMSNorm's rsqrt placement), so values agree to float32 ulps, not bit for bit. Measured: log-probs within
# 4.8e-7, gradients within 2.1e-6 relative (the last layer's query projection and its bias; most under 5e-7).
# The torch engine's own bar for a full-fidelity CPU replay, as for Qwen3-MoE and DeepSeek-V3. Measured: route 2
# within 8e-13 of the recorded norm, route 1 (whole and FSDP2-sharded alike) within 2e-8 of route 2.
CROSS_CHECK_RTOL = 1e-6


@pytest.fixture(scope="module")
def qwen2_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"tp1": dir} of the tiny Qwen2-MoE GPTModel saved from one process."""
    if REASON is not None:
        pytest.skip(REASON)
    return save_layouts(tmp_path_factory.mktemp("qwen2-moe"), tiny_section("qwen2_moe"), ("tp1",))


@pytest.fixture(scope="module")
def qwen2_layouts(qwen2_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`qwen2_checkpoints` and the same weights saved at EP=2 and TP=2 with ETP=2 (two processes; TP splits the QKV
    bias by query groups)."""
    return more_layouts("qwen2_moe", qwen2_checkpoints, tmp_path_factory.mktemp("qwen2-moe-layouts"))


def test_transformers_qwen2_moe_computes_what_megatron_computes(
    qwen2_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Router losses reach the left-padded prompt, so padding rows' gradients are compared too; the shared expert's
    gate and the QKV biases get their gradients from both models."""
    section, batch, router = tiny_section("qwen2_moe"), left_padded_batch(), 0.01
    out = tmp_path / "megatron.pt"
    spawn_ranks(forward_backward, 1, (section, str(qwen2_checkpoints["tp1"]), batch, str(out), None, router))
    megatron = torch.load(out, weights_only=True)

    spec = parse_model_config(section)
    policy = build_policy(spec)
    load_policy_weights(policy, spec, qwen2_checkpoints["tp1"])
    state = policy.state_dict()
    assert state["model.layers.1.mlp.shared_expert_gate.weight"].abs().min() > 0
    assert state["model.layers.0.self_attn.k_proj.bias"].abs().max() > 0  # megatron-core initialises biases to 0
    assert_computes_what_megatron_computes(policy, batch, megatron, partial(mbridge_to_hf, section), router)


def test_the_qwen2_moe_checkpoint_has_the_expected_shapes() -> None:
    shapes = expected_megatron_shapes(MegatronModelConfig.from_dict(tiny_section("qwen2_moe")))
    assert shapes["decoder.layers.mlp.shared_experts.gate_weight"] == (2, 1, 64)
    assert shapes["decoder.layers.mlp.shared_experts.linear_fc1.weight"] == (2, 128, 64)
    assert shapes["decoder.layers.self_attention.linear_qkv.bias"] == (2, (4 + 2 * 2) * 16)


@pytest.mark.matrix  # the layouts' row of the default run: test_megatron_route_transformers (Qwen3-MoE)
def test_every_saved_qwen2_moe_layout_loads_the_same_model(qwen2_layouts: dict[str, Path]) -> None:
    spec = MegatronModelConfig.from_dict(tiny_section("qwen2_moe"))
    states = {}
    for name, directory in qwen2_layouts.items():
        check_megatron_weights(directory, spec, "the snapshot's checkpoint")
        policy = build_policy(spec)
        load_policy_weights(policy, spec, directory)
        states[name] = policy.state_dict()
    reference = states.pop("tp1")
    assert states.keys() == {"ep2", "tp2"}
    for name, state in states.items():
        assert all(torch.equal(state[k], v) for k, v in reference.items()), name


@pytest.fixture(scope="module")
def qwen2_capture(qwen2_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The snapshot the Megatron spike guard wrote when megatron-core's own Qwen2-MoE model, trained at EP=2 over two
    gloo processes, spiked at step 6."""
    from megatron_trainer import train

    root = tmp_path_factory.mktemp("qwen2-capture") / "checkpoints" / "spike_snapshots"
    payload = (tiny_section("qwen2_moe"), str(qwen2_checkpoints["tp1"]), str(root), 8, 6, 2, "qwen2-ep2")
    spawn_ranks(train, 2, payload, timeout_s=600.0, label="megatron training")
    snapshots = sorted(root.glob("iter_*"))
    assert [p.name for p in snapshots] == ["iter_0000006"], "the guard trips at the burst step only"
    return snapshots[0]


@pytest.mark.matrix
def test_a_qwen2_moe_spike_replays_on_both_routes_alike(qwen2_capture: Path, tmp_path: Path) -> None:
    """Route 2 (megatron-core, the routes forced through its RouterReplay) and route 1 (transformers, whole and
    FSDP2-sharded) reproduce the captured step and agree on the norm within the engine's 1e-6 bar."""
    native = run_replay(replay_request(What(qwen2_capture), Where(backend=Backend.MEGATRON)))
    assert native.verdict == "reproduced", native.verdict_basis
    whole = run_replay(replay_request(What(qwen2_capture)))
    assert whole.verdict == "reproduced", whole.verdict_basis
    sharded = run_replay(
        replay_request(What(shutil.copytree(qwen2_capture, tmp_path / "iter_0000006")), how=How(shard=Shard.ON))
    )
    assert sharded.verdict == "reproduced", sharded.verdict_basis
    assert sharded.sharded is True
    assert native.grad_norm is not None and whole.grad_norm is not None and sharded.grad_norm is not None
    for route in (whole, sharded):
        assert route.grad_norm is not None
        assert abs(route.grad_norm - native.grad_norm) / native.grad_norm < CROSS_CHECK_RTOL
