"""megatron-core on CPU: the patches apply inside the context only, and an unusable install says why."""

from __future__ import annotations

import pytest
import torch
from megatron_helpers import REASON

from axrl_spike_replay.models.mcore import megatron_cpu
from axrl_spike_replay.models.mcore.megatron_cpu import megatron_on_cpu, megatron_unavailable_reason


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_patches_hold_inside_the_block_and_are_undone_after() -> None:
    from megatron.core.transformer.moe import moe_utils

    original = torch.cuda.current_device
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    with megatron_on_cpu():
        assert torch.cuda.current_device() == "cpu"
        assert torch.cuda.synchronize() is None
        assert moe_utils.te_general_gemm is None
    assert torch.cuda.current_device is original
    assert hasattr(moe_utils, "te_general_gemm") == had_gemm


def test_an_unchecked_release_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(megatron_cpu, "megatron_core_version", lambda: "0.9.0")
    reason = megatron_unavailable_reason()
    assert reason is not None and "0.9.0" in reason and "0.16.1" in reason


def test_a_missing_install_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(megatron_cpu, "megatron_core_version", lambda: None)
    reason = megatron_unavailable_reason()
    assert reason is not None and "pip install --no-deps megatron-core==0.16.1" in reason
