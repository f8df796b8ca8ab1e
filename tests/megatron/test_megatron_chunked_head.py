"""Route 2's head in chunks (`models.megatron_policy.megatron_logprobs`): the GPTModel's output layer hands its
input to `models.chunked_head`, so no [T, V] float32 tensor is held for a sequence. Against the GPTModel's own
whole logits (megatron-core's output layer, log-softmaxed whole), same weights, batch and forced-free routing,
float32: the log-probs and every parameter's gradient within 1e-6, router losses included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_helpers import forward_backward, left_padded_batch

SAME = 1e-6


@pytest.mark.parametrize("router", [0.0, 0.1])
def test_the_chunked_head_is_the_gpt_models_whole_head(
    megatron_checkpoints: dict[str, Path], tmp_path: Path, router: float
) -> None:
    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

    batch, section = left_padded_batch(), tiny_section()
    got = {}
    for chunked in (False, True):
        out = tmp_path / f"chunked-{chunked}.pt"
        payload = (section, str(megatron_checkpoints["tp1"]), batch, str(out), None, router, chunked)
        spawn_ranks(forward_backward, 1, payload, timeout_s=300.0, label="megatron forward")
        got[chunked] = torch.load(out, weights_only=True)
    whole, chunked_ = got[False], got[True]
    assert torch.equal(whole["routes"], chunked_["routes"])
    diff = (chunked_["logprobs"] - whole["logprobs"]).abs().max()
    assert float(diff) <= SAME * float(whole["logprobs"].abs().max())
    assert whole["grads"].keys() == chunked_["grads"].keys()
    assert any(name.startswith("output_layer.") for name in whole["grads"])
    for name, grad in whole["grads"].items():
        rel = (chunked_["grads"][name] - grad).norm() / grad.norm().clamp_min(1e-30)
        assert float(rel) <= SAME, name
