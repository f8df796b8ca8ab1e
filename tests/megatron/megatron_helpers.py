"""Helpers of the Megatron tests: the skip reason, functions run inside megatron-core rank processes (spawned:
importable module-level functions), and mbridge's mapping of a live Megatron model's names (the peer check)."""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from axrl_spike_replay.models.mcore.megatron_cpu import megatron_unavailable_reason

REASON = megatron_unavailable_reason()


def load_gpt(section: dict[str, Any], checkpoint: str) -> Any:
    """Megatron-core's GPTModel for the section (TP=PP=EP=1), its weights loaded by `dist_checkpointing.load` as
    route 2 loads them (`snapshot.trainer_formats.megatron_load`)."""
    from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
    from axrl_spike_replay.models.mcore.megatron_gpt import MegatronParallel, build_gpt_model, init_parallel
    from axrl_spike_replay.snapshot.trainer_formats.megatron_load import load_megatron_model

    init_parallel(MegatronParallel())
    model = build_gpt_model(MegatronModelConfig.from_dict(section))
    load_megatron_model(model, checkpoint)
    return model


def load_gpt_rank(rank: int, world: int, payload: tuple[dict[str, Any], str]) -> None:
    """`load_gpt` in a rank process (spawn_ranks): payload (section, checkpoint dir)."""
    del rank, world
    load_gpt(*payload)


def left_padded_batch() -> dict[str, torch.Tensor]:
    """Three rows of 24 tokens, the second a left-padded prompt, the first with loss-free tokens at its end."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 1024, (3, 24), generator=gen)
    attention = torch.ones(3, 24, dtype=torch.long)
    attention[1, :3] = 0  # a left-padded prompt
    tokens[1, :3] = 0
    mask = torch.zeros(3, 24)
    mask[:, 8:] = 1.0
    mask[0, -3:] = 0.0
    return {"tokens": tokens, "loss_mask": mask, "attention_mask": attention}


def simple_loss(out: Any, batch: dict[str, torch.Tensor], router: float = 0.0) -> torch.Tensor:
    """A loss with a gradient through every log-prob the mask keeps, plus `router` x (aux + z loss)."""
    mask = batch["loss_mask"]
    weights = torch.linspace(-1.0, 1.0, mask.shape[-1])
    return -(out.logprobs * mask * weights).sum() / mask.sum() + router * (out.aux_loss + out.z_loss)


LOGPROB_ATOL = 1e-5  # transformers' log-probs against megatron-core's, same weights and batch (float32)
GRAD_RTOL = 1e-5  # each parameter's gradient, relative to megatron-core's


def assert_computes_what_megatron_computes(
    policy: Any,
    batch: dict[str, torch.Tensor],
    megatron: dict[str, Any],
    to_hf: Any,
    router: float = 0.0,
) -> None:
    """The transformers policy, loaded from megatron-core's checkpoint, computes what megatron-core computed on
    `batch` (`forward_backward`'s saved output): the same routes, log-probs within LOGPROB_ATOL, and every
    parameter's gradient within GRAD_RTOL of megatron-core's, mapped to HF names by mbridge (`to_hf(grads, policy)`)."""
    from axrl_spike_replay.models.policy import policy_forward
    from axrl_spike_replay.models.tiny_moe import RoutingControl

    ours = policy_forward(policy, batch, RoutingControl(), need_entropy=False)
    assert torch.equal(ours.routes, megatron["routes"])  # every token to the same experts
    assert (ours.logprobs - megatron["logprobs"]).abs().max() < LOGPROB_ATOL
    simple_loss(ours, batch, router).backward()
    theirs = to_hf(megatron["grads"], policy)
    grads = {name: p.grad for name, p in policy.named_parameters()}
    assert theirs.keys() == grads.keys()
    for name, grad in grads.items():
        assert grad is not None
        rel = float((grad - theirs[name]).norm() / theirs[name].norm())
        assert rel < GRAD_RTOL, f"{name}: relative difference {rel:.2e}"


def forward_backward(rank: int, world: int, payload: tuple[Any, ...]) -> None:
    """Megatron's own forward and backward of `batch` (routes forced when given): log-probs, routes, grads saved.
    Payload (section, checkpoint, batch, out, routes, router[, chunked]): `chunked` takes the log-probs with the
    head in chunks (route 2's way), else from the GPTModel's whole logits (the default here: the trainer's)."""
    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.mcore.megatron_policy import force_routes, install_trace, megatron_logprobs
    from axrl_spike_replay.snapshot.trainer_formats.megatron_routes import to_router_replay

    section, checkpoint, batch, out, routes, router = payload[:6]
    chunked = bool(payload[6]) if len(payload) > 6 else False
    torch.manual_seed(0)
    with megatron_on_cpu():
        model = load_gpt(section, checkpoint)
        trace = install_trace(model)
        layers = sorted(trace_layers(model))
        force_routes(model, None if routes is None else dict(zip(layers, to_router_replay(routes), strict=True)))
        result = megatron_logprobs(model, trace, batch, chunked=chunked)
        simple_loss(result, batch, router).backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    torch.save({"logprobs": result.logprobs.detach(), "routes": result.routes, "grads": grads}, Path(out))


def forward_backward_each(rank: int, world: int, payloads: list[tuple[Any, ...]]) -> None:
    """`forward_backward` of each payload in turn, in this one process: one megatron-core import and start for
    several models (each build resets the RNG tracker and seeds afresh, so each gives what a process of its own
    gives)."""
    for payload in payloads:
        forward_backward(rank, world, payload)


def trace_layers(model: Any) -> list[int]:
    from axrl_spike_replay.models.mcore.megatron_policy import routers

    return list(routers(model))


# The local spec's parameter names as Transformer Engine's MoE spec (and mbridge) name them: the input norm fused
# into linear_qkv (the pre-MLP norm of an MoE layer stays a module), experts as grouped-GEMM names
# (`linear_fc1.weight<e>`).
_TE_NAMES = (
    (re.compile(r"\.input_layernorm\.weight$"), ".self_attention.linear_qkv.layer_norm_weight"),
    (re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"), r".mlp.experts.\2.weight\1"),
)


def mbridge_to_hf(section: dict[str, Any], tensors: dict[str, torch.Tensor], hf_model: Any) -> dict[str, torch.Tensor]:
    """A live Megatron model's tensors (local spec names, TP=PP=EP=1) under transformers' names and layout, by
    mbridge's mapping and QKV / gate-up split (per-expert names merged by transformers' own conversion)."""
    from mbridge.core.parallel_states import ParallelStates
    from mbridge.models.qwen2moe import Qwen2MoEBridge
    from mbridge.models.qwen3moe import Qwen3MoEBridge

    from axrl_spike_replay.models.hf_config import hf_config_object
    from axrl_spike_replay.models.hf_weights import to_model_layout
    from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig

    spec = MegatronModelConfig.from_dict(section)
    bridges = {"qwen3_moe": Qwen3MoEBridge, "qwen2_moe": Qwen2MoEBridge}
    assert spec.architecture in bridges, (
        "the peer check maps Qwen3-MoE and Qwen2-MoE (mbridge's Mixtral keeps transformers 4 names)"
    )
    bridge = bridges[spec.architecture](
        hf_config_object(spec.hf), dtype=torch.float32, parallel_states=ParallelStates()
    )
    per_expert: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        for pattern, replacement in _TE_NAMES:
            name = pattern.sub(replacement, name)
        names, values = bridge._weight_to_hf_format(name, tensor)
        per_expert.update(zip(names, values, strict=True))
    return to_model_layout(hf_model, per_expert)


# DeepSeek-V3's local-spec names as Transformer Engine's MLA spec (and mbridge) name them: the q / kv LoRA norms fused
# into the up projections, experts as grouped-GEMM names. A dense layer's pre-MLP norm mbridge takes under both names.
_TE_MLA_NAMES = (
    (re.compile(r"\.self_attention\.q_layernorm\.weight$"), ".self_attention.linear_q_up_proj.layer_norm_weight"),
    (re.compile(r"\.self_attention\.kv_layernorm\.weight$"), ".self_attention.linear_kv_up_proj.layer_norm_weight"),
    (re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"), r".mlp.experts.\2.weight\1"),
)


def mbridge_deepseek_to_hf(section: dict[str, Any], tensors: dict[str, torch.Tensor], hf_model: Any) -> dict[str, Any]:
    """A live DeepSeek-V3 Megatron model's tensors (local spec names, TP=PP=EP=1) under transformers' names and
    layout, by mbridge's DeepseekV3Bridge mapping and gate/up split. Its constructor builds a Transformer Engine
    config, so the bridge is made without it: the mapping reads only the HF config and the MTP layer count."""
    from types import SimpleNamespace

    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    from axrl_spike_replay.models.hf_config import hf_config_object
    from axrl_spike_replay.models.hf_weights import to_model_layout
    from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig

    spec = MegatronModelConfig.from_dict(section)
    bridge = DeepseekV3Bridge.__new__(DeepseekV3Bridge)
    bridge.hf_config = hf_config_object(spec.hf)
    bridge.config = SimpleNamespace(mtp_num_layers=None, num_layers=spec.n_layers)
    bridge.make_vocab_size_divisible_by = None  # type: ignore[assignment] - its constructor's default
    per_expert: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        for pattern, replacement in _TE_MLA_NAMES:
            name = pattern.sub(replacement, name)
        names, values = bridge._weight_to_hf_format(name, tensor)
        per_expert.update(zip(names, values, strict=True))
    return to_model_layout(hf_model, per_expert)


def save_with_mtp(rank: int, world: int, out: str) -> None:
    """The tiny DeepSeek-V3 GPTModel with one multi-token-prediction layer (megatron-core's local MTP block spec),
    saved by `dist_checkpointing.save` to `out`."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer import MLATransformerConfig

    from axrl_spike_replay.models.mcore.megatron_cpu import initialize_cpu_rng, megatron_on_cpu
    from axrl_spike_replay.models.mcore.megatron_deepseek import deepseek_block_spec
    from axrl_spike_replay.models.mcore.megatron_gpt import MegatronParallel, init_parallel, transformer_config_kwargs
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_spec

    spec = tiny_spec("deepseek_v3")
    with megatron_on_cpu():
        init_parallel(MegatronParallel())
        config = MLATransformerConfig(**transformer_config_kwargs(spec, MegatronParallel()), mtp_num_layers=1)
        block = deepseek_block_spec(config)
        mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False)
        initialize_cpu_rng(0)
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=1024,
            max_sequence_length=256,
            position_embedding_type="rope",
            mtp_block_spec=mtp,
        )
        Path(out).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), out)


def more_layouts(architecture: str, checkpoints: dict[str, Path], root: Path) -> dict[str, Path]:
    """`checkpoints` (its "tp1" the reference) and the reference's weights saved at EP=2 and TP=2 under `root`."""
    from axrl_spike_replay.testing.megatron_checkpoints import LAYOUTS, save_checkpoints, tiny_section

    more = {name: root / name for name in ("ep2", "tp2")}
    save_checkpoints(tiny_section(architecture), [(LAYOUTS[n], d) for n, d in more.items()], checkpoints["tp1"])
    return {**checkpoints, **more}


@dataclass(frozen=True)
class CliRun:
    """A CLI call's workspace, its argv before `--workspace` and `--json`, and the JSON document it printed."""

    workspace: Path
    argv: list[str]
    doc: dict[str, Any]


def cli_json(argv: list[str], cwd: Path) -> dict[str, Any]:
    """`axrl-spike-replay ARGV` run in this process from `cwd` (its rank processes come from this process's warm
    process server, not from a fresh interpreter's): the one JSON document it printed; fails with its stderr
    unless it exits 0."""
    from axrl_spike_replay.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())  # exactly one JSON document, or this raises
