"""Imported by the process server for `megatron` jobs (see `processes.process_starts.KIND_PRELOADS`): the
megatron-core modules the replay's Megatron routes import, so a rank process forked from it finds them imported.
Without megatron-core installed, nothing is imported. Importing them runs no torch op and starts no thread."""

from __future__ import annotations

from axrl_spike_replay.processes.process_starts import import_installed

MODULES = (
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.dict_utils",
    "megatron.core.dist_checkpointing.mapping",
    "megatron.core.dist_checkpointing.strategies.common",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.validation",
    "megatron.core.extensions.transformer_engine",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.tensor_parallel.random",
    "megatron.core.transformer",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.router_replay",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.utils",
)

import_installed(MODULES)
