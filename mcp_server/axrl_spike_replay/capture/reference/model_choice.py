"""The models the reference trainer can train: `tiny_moe`, or a transformers MoE architecture at a tiny size.

Torch-free, like `presets`: `capture --help` lists the names from here without loading the trainer.
Every transformers model is built from its own config class (nothing is downloaded) at the tiny size its
architecture declares (`models.architectures`: hidden 64, 8 experts, top-2, vocab 1024), eager attention and
experts, and deterministic algorithms pinned (see `models.policy`).
"""

from __future__ import annotations

from typing import Any

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.models.architectures import ARCHITECTURES

DEFAULT_CAPTURE_MODEL = "tiny_moe"
HF_RESPONSE_LEN = 32  # responses of a transformers capture (the tiny model's stay at 8 tokens)

HF_CAPTURE_MODELS = tuple(ARCHITECTURES)  # each declared architecture, at its tiny size
CAPTURE_MODELS = (DEFAULT_CAPTURE_MODEL, *HF_CAPTURE_MODELS)


def hf_model_section(architecture: str) -> dict[str, Any]:
    """The run config `model:` section (kind hf) of the tiny `architecture` the reference trainer trains."""
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"model {architecture!r} is not known (known: {', '.join(CAPTURE_MODELS)})")
    return {
        "kind": "hf",
        "architecture": architecture,
        "config": ARCHITECTURES[architecture].tiny_config(),
        "dtype": "float32",
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        "deterministic_algorithms": True,
    }


def check_capture_model(name: str) -> None:
    """ConfigError listing the known models unless `name` is one."""
    if name not in CAPTURE_MODELS:
        raise ConfigError(f"model {name!r} is not known (known: {', '.join(CAPTURE_MODELS)})")
