"""Imported by the process server for `hf` and `megatron` jobs (see `processes.process_starts.KIND_PRELOADS`):
transformers and the modeling modules of the declared MoE architectures, so a rank process forked from it builds
its model without importing them (seconds each). Importing them runs no torch op and starts no thread."""

from __future__ import annotations

from axrl_spike_replay.models.architectures import ARCHITECTURES
from axrl_spike_replay.processes.process_starts import import_installed

MODULES = (
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.modeling_auto",
    *(f"transformers.models.{name}.modeling_{name}" for name in ARCHITECTURES),
)

import_installed(MODULES)
