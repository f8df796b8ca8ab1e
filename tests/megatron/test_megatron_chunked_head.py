"""Route 2's head in chunks (`models.megatron_policy.megatron_logprobs`): the GPTModel's output layer hands its
input to `models.chunked_head`, so no [T, V] float32 tensor is held for a sequence. Against the GPTModel's own
whole logits (megatron-core's output layer, log-softmaxed whole), same weights, batch and forced-free routing,
float32: the log-probs and every parameter's gradient within 1e-6, router losses included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_helpers import forward_backward_each, left_padded_batch

SAME = 1e-6


ROUTERS = (0.0, 0.1)


@pytest.fixture(scope="module")
def heads(megatron_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict]:
    """{(router, chunked): the saved log-probs, routes and grads} of every router loss weight, whole head and
    chunked, computed in one Megatron-core process (one import and start for the four; each build starts afresh)."""
    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

    batch, section, root = left_padded_batch(), tiny_section(), tmp_path_factory.mktemp("chunked-head")
    outs = {
        (router, chunked): root / f"router-{router}-chunked-{chunked}.pt"
        for router in ROUTERS
        for chunked in (False, True)
    }
    payloads = [
        (section, str(megatron_checkpoints["tp1"]), batch, str(out), None, router, chunked)
        for (router, chunked), out in outs.items()
    ]
    spawn_ranks(forward_backward_each, 1, payloads, timeout_s=600.0, label="megatron forward")
    return {key: torch.load(out, weights_only=True) for key, out in outs.items()}


@pytest.mark.parametrize("router", ROUTERS)
def test_the_chunked_head_is_the_gpt_models_whole_head(heads: dict[tuple, dict], router: float) -> None:
    whole, chunked_ = heads[(router, False)], heads[(router, True)]
    assert torch.equal(whole["routes"], chunked_["routes"])
    diff = (chunked_["logprobs"] - whole["logprobs"]).abs().max()
    assert float(diff) <= SAME * float(whole["logprobs"].abs().max())
    assert whole["grads"].keys() == chunked_["grads"].keys()
    assert any(name.startswith("output_layer.") for name in whole["grads"])
    for name, grad in whole["grads"].items():
        rel = (chunked_["grads"][name] - grad).norm() / grad.norm().clamp_min(1e-30)
        assert float(rel) <= SAME, name
