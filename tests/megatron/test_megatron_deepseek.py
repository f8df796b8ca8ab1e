"""DeepSeek-V3 on both replay routes: megatron-core builds its Multi-Latent Attention on the local spec (with the two
recorded CPU patches of `models.mcore.megatron_cpu`), saves it with `dist_checkpointing.save`, and the checkpoint loaded
into transformers' DeepseekV3ForCausalLM computes what megatron-core's own model computes: the same routes (sigmoid
scores, expert bias, group-limited top-k), log-probs and gradients, every parameter compared under mbridge's
DeepseekV3Bridge mapping. A snapshot of megatron-core's own training replays `reproduced` on both routes."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from megatron_helpers import (
    assert_computes_what_megatron_computes,
    forward_backward,
    left_padded_batch,
    mbridge_deepseek_to_hf,
)

from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.investigation.request import How, What, Where, replay_request
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.mcore.megatron_weights import check_megatron_weights, expected_megatron_shapes
from axrl_spike_replay.models.policy import build_policy, load_policy_weights, parse_model_config
from axrl_spike_replay.processes.rank_processes import spawn_ranks
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.testing.megatron_checkpoints import tiny_section
from axrl_spike_replay.vocabulary import Backend, Shard

pytestmark = pytest.mark.slow

# fp32 on CPU, one thread: the two models sum in different orders (MLA's RoPE applied to de-interleaved halves by
# both, but with positions counted from the row start by Megatron and from the first real token by transformers on
# a left-padded row; experts' token order; RMSNorm's rsqrt placement), so values agree to float32 ulps, not bit
# for bit. Measured: log-probs within 4.8e-7, gradients within 4.8e-7 relative; the bounds leave a 20x margin.
# As for Qwen3-MoE (test_megatron_route_megatron): the torch engine's own bar for a full-fidelity CPU replay.
# Measured: route 2 within 1.6e-11 of the recorded norm, route 1 (whole and FSDP2-sharded alike) within 3.5e-9 of
# route 2; per-rank losses equal to float32 print precision.
CROSS_CHECK_RTOL = 1e-6


def test_transformers_deepseek_v3_computes_what_megatron_computes(
    deepseek_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The router losses reach the left-padded prompt, so padding rows' gradients are compared too."""
    section, batch, router = tiny_section("deepseek_v3"), left_padded_batch(), 0.01
    out = tmp_path / "megatron.pt"
    spawn_ranks(forward_backward, 1, (section, str(deepseek_checkpoints["tp1"]), batch, str(out), None, router))
    megatron = torch.load(out, weights_only=True)

    spec = parse_model_config(section)
    policy = build_policy(spec)
    load_policy_weights(policy, spec, deepseek_checkpoints["tp1"])
    bias = policy.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0, "the checkpoint's expert bias reaches transformers' router"
    # layers 1 and 2 (the MoE ones) route alike
    assert_computes_what_megatron_computes(policy, batch, megatron, partial(mbridge_deepseek_to_hf, section), router)


def test_the_deepseek_checkpoint_has_the_expected_shapes() -> None:
    shapes = expected_megatron_shapes(MegatronModelConfig.from_dict(tiny_section("deepseek_v3")))
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (256, 64)  # the dense first layer: gate | up rows
    assert shapes["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == (8, 64, 64)
    assert "decoder.layers.0.mlp.router.weight" not in shapes


@pytest.mark.matrix  # the layouts' row of the default run: test_megatron_route_transformers (Qwen3-MoE)
def test_every_saved_deepseek_layout_loads_the_same_model(deepseek_layouts: dict[str, Path]) -> None:
    spec = MegatronModelConfig.from_dict(tiny_section("deepseek_v3"))
    states = {}
    for name, directory in deepseek_layouts.items():
        check_megatron_weights(directory, spec, "the snapshot's checkpoint")
        policy = build_policy(spec)
        load_policy_weights(policy, spec, directory)
        states[name] = policy.state_dict()
    reference = states.pop("tp1")
    assert states.keys() == {"ep2", "tp2"}
    for name, state in states.items():
        assert all(torch.equal(state[k], reference[k]) for k in reference), name


def test_what_does_not_map_is_refused_by_name(deepseek_checkpoints: dict[str, Path]) -> None:
    config = tiny_section("deepseek_v3")["config"]
    refused = {
        "rope_interleave": (dict(config, rope_interleave=False), "rope_interleave false"),
        "linear": (dict(config, rope_scaling={"rope_type": "linear", "factor": 4.0}), "RoPE scaling 'linear'"),
        "yarn_mscale": (
            dict(
                config,
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.7},
            ),
            "yarn with an mscale but no mscale_all_dim",
        ),
        "groups": (dict(config, num_experts_per_tok=4, n_group=2, topk_group=1), "top 2 experts"),
        "norm": (dict(config, norm_topk_prob=False), "norm_topk_prob false"),
    }
    for changed, message in refused.values():
        with pytest.raises(ConfigError, match=rf"deepseek_v3 Megatron checkpoint with .*{message}.*--backend"):
            MegatronModelConfig.from_dict(tiny_section("deepseek_v3", config=changed))
    # a model without the dense first layer is a different checkpoint: its layer 0 has no router
    no_dense = MegatronModelConfig.from_dict(tiny_section("deepseek_v3", config=dict(config, first_k_dense_replace=0)))
    with pytest.raises(SnapshotError, match=r"lacks .*decoder\.layers\.0\.mlp"):
        check_megatron_weights(deepseek_checkpoints["tp1"], no_dense, "the snapshot's checkpoint")


def test_a_checkpoint_with_multi_token_prediction_layers_is_refused_by_them(tmp_path: Path) -> None:
    """megatron-core saves DeepSeek-V3 with an MTP layer (its `mtp.` keys); transformers' model has none, so route 1
    refuses the checkpoint naming them rather than replaying without their loss."""
    from megatron_helpers import save_with_mtp

    spawn_ranks(save_with_mtp, 1, str(tmp_path / "mtp"))
    spec = MegatronModelConfig.from_dict(tiny_section("deepseek_v3"))
    with pytest.raises(SnapshotError, match=r"mtp\.layers\.0\..*multi-token prediction layers.*--backend command"):
        check_megatron_weights(tmp_path / "mtp", spec, "the snapshot's checkpoint")


def _agrees_with_megatron(section: dict, tmp_path: Path, seq: int) -> None:
    """Save `section`'s model with megatron-core, load it into transformers: the same routes, log-probs, gradients."""
    from axrl_spike_replay.testing.megatron_checkpoints import LAYOUTS, save_checkpoints

    checkpoint = tmp_path / "checkpoint"
    save_checkpoints(section, [(LAYOUTS["tp1"], checkpoint)], None)
    gen = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(3, 1024, (2, seq), generator=gen), "loss_mask": torch.ones(2, seq)}
    batch["attention_mask"] = torch.ones(2, seq, dtype=torch.long)
    out = tmp_path / "megatron.pt"
    spawn_ranks(forward_backward, 1, (section, str(checkpoint), batch, str(out), None, 0.0))
    megatron = torch.load(out, weights_only=True)
    spec = parse_model_config(section)
    policy = build_policy(spec)
    load_policy_weights(policy, spec, checkpoint)
    assert_computes_what_megatron_computes(policy, batch, megatron, partial(mbridge_deepseek_to_hf, section))


@pytest.mark.matrix
def test_yarn_rope_scaling_maps_as_deepseek_v3_sets_it(tmp_path: Path) -> None:
    """DeepSeek-V3's released RoPE: yarn with its factor 40, mscales and correction range, here from an original
    length of 16 so the 40-token batch lies beyond it. Megatron's YarnRotaryEmbedding and MLA softmax scale and
    transformers' yarn agree."""
    yarn = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}
    yarn.update(mscale=1.0, mscale_all_dim=1.0)
    config = dict(tiny_section("deepseek_v3")["config"], rope_scaling=yarn)
    _agrees_with_megatron(tiny_section("deepseek_v3", config=config), tmp_path, 40)


@pytest.mark.matrix
def test_a_query_without_lora_maps_too(tmp_path: Path) -> None:
    """q_lora_rank null (DeepSeek-V2-Lite's shape): one query projection, megatron-core's linear_q_proj."""
    config = dict(tiny_section("deepseek_v3")["config"], q_lora_rank=None)
    _agrees_with_megatron(tiny_section("deepseek_v3", config=config), tmp_path, 24)


def _check_shards(rank: int, world_size: int, payload: tuple[str, str]) -> None:
    from axrl_spike_replay.models.sharded_weights import local_rows
    from axrl_spike_replay.replay.compute.model_build import Placement, build_model

    directory, report = payload
    spec = parse_model_config(tiny_section("deepseek_v3"))
    whole = build_policy(spec)
    load_policy_weights(whole, spec, directory)
    saved = dict(whole.state_dict())
    model = build_model(spec, directory, "cpu", Placement(shard=True))
    held = 0
    for name, param in model.named_parameters():
        row, local = local_rows(param)
        assert torch.equal(local, saved[name][row : row + local.shape[0]]), name
        held += local.numel()
    Path(f"{report}.{rank}").write_text(json.dumps([held, sum(p.numel() for p in whole.parameters())]))


@pytest.mark.matrix
def test_each_process_reads_its_rows_of_a_deepseek_checkpoint(
    deepseek_layouts: dict[str, Path], tmp_path: Path
) -> None:
    """FSDP2 over two gloo processes: each reads its rows of the per-layer keys (the fused gate | up rows of the
    dense MLP and shared expert split per layer)."""
    report = tmp_path / "held"
    spawn_ranks(_check_shards, 2, (str(deepseek_layouts["ep2"]), str(report)))
    rows = [json.loads(Path(f"{report}.{r}").read_text()) for r in range(2)]
    assert sum(h for h, _ in rows) == rows[0][1] and all(h < whole for h, whole in rows)


@pytest.mark.matrix
def test_a_deepseek_spike_replays_on_both_routes_alike(deepseek_capture: Path, tmp_path: Path) -> None:
    """Megatron-core's own DeepSeek-V3 training at EP=2 tripped the guard; route 1 (transformers, whole and FSDP2
    sharded) and route 2 (megatron-core) reproduce the step and agree on the norm."""
    native = run_replay(replay_request(What(deepseek_capture), Where(backend=Backend.MEGATRON)))
    assert native.verdict == "reproduced", native.verdict_basis
    assert native.rel_diff is not None and native.rel_diff < CROSS_CHECK_RTOL
    assert native.consistency is not None and native.consistency.self_consistent
    whole = run_replay(replay_request(What(deepseek_capture)))
    assert whole.verdict == "reproduced", whole.verdict_basis
    assert whole.grad_norm is not None and native.grad_norm is not None
    assert abs(whole.grad_norm - native.grad_norm) / native.grad_norm < CROSS_CHECK_RTOL
    losses = {m["rank"]: m["loss"] for m in whole.rank_metrics}
    native_losses = {m["rank"]: m["loss"] for m in native.rank_metrics}
    assert losses.keys() == native_losses.keys() == {0, 1}
    assert all(abs(losses[r] - native_losses[r]) < 1e-5 * abs(native_losses[r]) for r in losses)
    sharded = run_replay(
        replay_request(What(shutil.copytree(deepseek_capture, tmp_path / "iter_0000006")), how=How(shard=Shard.ON))
    )
    assert sharded.verdict == "reproduced", sharded.verdict_basis
    assert sharded.sharded is True and whole.sharded is False
    assert sharded.grad_norm is not None
    assert abs(sharded.grad_norm - native.grad_norm) / native.grad_norm < CROSS_CHECK_RTOL


def test_a_layout_the_deepseek_shards_contradict_is_refused(deepseek_capture: Path, tmp_path: Path) -> None:
    """The run config and metadata say TP=2, the per-layer keys were saved at TP=1: refused before any replay,
    naming the attention projection the shards were read from."""
    import yaml

    snapshot = shutil.copytree(deepseek_capture, tmp_path / "iter_0000006")
    config = yaml.safe_load((snapshot / "run_config.yaml").read_text())
    config["parallel"].update(tp=2, world_size=4)
    (snapshot / "run_config.yaml").write_text(yaml.safe_dump(config))
    metadata = json.loads((snapshot / "axrl_metadata.json").read_text())
    metadata["parallel"].update(tp=2, world_size=4)
    (snapshot / "axrl_metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(SnapshotError, match=r"linear_proj is saved in 1 tensor-parallel shards but .* tp=2"):
        run_replay(replay_request(What(snapshot)))
