"""Megatron-core `torch_dist` checkpoints of a tiny MoE GPTModel, written by megatron-core's own code in real
gloo process groups at several layouts: for tests and benchmarks. Needs megatron-core (see
models/mcore/megatron_cpu.py).

The reference is saved from one process (TP=PP=EP=1) after seeding, with sharp routers (a wrong expert changes
the output). Every other layout is made as a trainer would reshard: each of its processes builds its shard of
the GPTModel, loads the reference with `dist_checkpointing.load` (as route 2 does:
`snapshot.trainer_formats.megatron_load`) and saves with `dist_checkpointing.save`. So all layouts hold the same global
weights, each saved in its own chunks and data files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.mcore.megatron_gpt import MegatronParallel, init_parallel

TINY_MODELS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")


def tiny_section(architecture: str = "qwen3_moe", **overrides: Any) -> dict[str, Any]:
    """A run config `model:` section (kind megatron) for a tiny `architecture` model (hidden 64, 2 layers, 8
    experts, top-2, vocab 1024)."""
    from axrl_spike_replay.testing.hf_snapshot import model_section

    doc = model_section(architecture)
    config = dict(doc["config"])
    if architecture == "mixtral":
        config.update(head_dim=16, num_key_value_heads=2)
    if architecture == "qwen2_moe":  # every layer an MoE layer (Megatron stacks them under one key)
        config.update(num_hidden_layers=2, mlp_only_layers=[], num_key_value_heads=2)
    doc.update(kind="megatron", config=config, megatron_version="0.16.1", checkpoint_format="torch_dist")
    doc.update(overrides)
    return doc


def tiny_spec(architecture: str = "qwen3_moe", **overrides: Any) -> MegatronModelConfig:
    """The tiny model's spec."""
    return MegatronModelConfig.from_dict(tiny_section(architecture, **overrides))


@dataclass(frozen=True)
class Layout:
    """A saved layout: processes and their model-parallel sizes (data parallel is the rest)."""

    name: str
    world_size: int
    parallel: MegatronParallel


LAYOUTS = {
    "tp1": Layout("tp1", 1, MegatronParallel()),
    "tp2": Layout("tp2", 2, MegatronParallel(tp=2, etp=2)),
    "ep2": Layout("ep2", 2, MegatronParallel(ep=2)),
    "pp2": Layout("pp2", 2, MegatronParallel(pp=2)),
    "tp2ep2": Layout("tp2ep2", 4, MegatronParallel(tp=2, ep=2, etp=1)),
}


def sharpen_routers(model: Any, seed: int) -> None:
    """Router weights N(0, 1), the same on every layout (seeded per router): a wrong expert shows in the output.
    A router with an expert bias (DeepSeek-V3's) gets one too, large enough to change which experts win."""
    import torch

    from axrl_spike_replay.models.mcore.megatron_policy import routers

    with torch.no_grad():
        for layer, router in routers(model).items():
            gen = torch.Generator().manual_seed(seed * 1000 + layer)
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
            bias = getattr(router, "expert_bias", None)
            if bias is not None:
                bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
        # megatron-core starts QKV biases (Qwen2-MoE's) at zero, where a misplaced query group would not show
        for name, param in model.named_parameters():
            if name.endswith("linear_qkv.bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))


def _save_ranks(
    rank: int, world: int, payload: tuple[dict[str, Any], list[tuple[Layout, str]], str | None, int]
) -> None:
    """One process of a group that saves every layout of its world size in turn (megatron imported once)."""
    import torch
    from megatron.core import dist_checkpointing

    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.mcore.megatron_gpt import build_gpt_model
    from axrl_spike_replay.snapshot.trainer_formats.megatron_load import load_megatron_model

    section, jobs, reference, seed = payload
    spec = MegatronModelConfig.from_dict(section)
    with megatron_on_cpu():
        for layout, out in jobs:
            init_parallel(layout.parallel)
            model = build_gpt_model(spec, layout.parallel, seed=seed)
            if reference is None:
                sharpen_routers(model, seed)
            else:
                load_megatron_model(model, reference)
            Path(out).mkdir(parents=True, exist_ok=True)
            torch.distributed.barrier()
            dist_checkpointing.save(model.sharded_state_dict(), out)


def save_checkpoints(
    section: dict[str, Any], jobs: list[tuple[Layout, Path]], reference: Path | None, seed: int = 0
) -> None:
    """Save the tiny model at each (layout, dir), every layout of one world size; from `reference`'s weights, or
    seeded afresh."""
    from axrl_spike_replay.processes.rank_processes import spawn_ranks

    worlds = {layout.world_size for layout, _ in jobs}
    if len(worlds) != 1:
        raise ValueError(f"one world size per call, got {sorted(worlds)}")
    payload = (section, [(layout, str(out)) for layout, out in jobs], str(reference) if reference else None, seed)
    spawn_ranks(_save_ranks, worlds.pop(), payload, timeout_s=600.0, label="megatron checkpoint save")


def save_layouts(
    root: Path, section: dict[str, Any], names: tuple[str, ...] = ("tp1", "tp2", "ep2", "pp2"), seed: int = 0
) -> dict[str, Path]:
    """{layout name: checkpoint dir} under `root`, every layout holding the reference's weights (tp1, saved first
    from one process); the other layouts are saved by one process group per world size."""
    reference = root / "tp1"
    save_checkpoints(section, [(LAYOUTS["tp1"], reference)], None, seed)
    out = {"tp1": reference}
    by_world: dict[int, list[tuple[Layout, Path]]] = {}
    for name in names:
        if name != "tp1":
            by_world.setdefault(LAYOUTS[name].world_size, []).append((LAYOUTS[name], root / name))
            out[name] = root / name
    for jobs in by_world.values():
        save_checkpoints(section, jobs, reference, seed)
    return out
