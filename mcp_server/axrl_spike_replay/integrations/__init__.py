"""Hooks for trainers we did not write, shipped in the package: `megatron` (the spike guard in a Megatron-core
loop: `from axrl_spike_replay.integrations.megatron import MegatronSpikeGuard`) and `verl` (the spike guard in
verl 0.9.1's FSDP engine, called by the patch `verl-0.9.1.diff` beside it). Each imports its trainer only inside
its functions, so importing the package needs neither."""

from __future__ import annotations

from pathlib import Path

VERL_PATCH = Path(__file__).with_name("verl-0.9.1.diff")  # `git apply` it in a verl 0.9.1 checkout
