"""The trainer's attention kernel, replayed: which ones run where, and how far each may be from eager's.

The run config records the kernel (`model.attn_implementation`) and the replay builds the same one:

- `eager`: transformers' reference attention, the [heads, T, T] scores and probabilities kept for the backward;
  the cross-check every other kernel is held to;
- `sdpa`: PyTorch's `scaled_dot_product_attention` (its flash and memory-efficient kernels on a GPU, the fused
  flash kernel on CPU), O(T) memory; runs on CPU and GPU;
- `flash_attention_2`: the `flash_attn` package's kernels, on a CUDA node where the package is installed. Refused
  elsewhere, before anything loads, naming the kernel that runs here and what changes.

Kernels compute the same softmax(QK^T / sqrt(d)) V with a different summation order, so a replay on another kernel
than eager's differs by rounding. `KERNEL_BOUNDS` holds that difference per dtype (per-token log-probs and the whole
gradient, relative L2), measured on this project's architectures against eager on the same step
(`tests/models/test_attention_kernels.py` holds sdpa to it on CPU; `benchmarks/gpu_real_length.py` on a GPU). A
query whose every key is masked (left padding) is outside the bound: eager spreads it uniformly over the masked
keys, SDPA does not, and only a loss that counts padding positions (the router z-loss) sees it.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from axrl_spike_replay.models.hf_config import HFModelConfig
    from axrl_spike_replay.models.policy import PolicyOutput
    from axrl_spike_replay.models.tiny_moe import RoutingControl

ATTENTION_KERNELS = ("eager", "sdpa", "flash_attention_2")
# kernels that keep O(T) memory per head in the backward (no [T, T] scores): what `replay.compute.process_memory` counts
LINEAR_MEMORY_KERNELS = ("sdpa", "flash_attention_2")


@dataclass(frozen=True)
class KernelBound:
    """How far a kernel's replay may be from eager's on the same step (relative L2 norms)."""

    logprobs: float  # per-token log-probs
    gradient: float  # every parameter's gradient, concatenated


# Measured on CPU, sdpa against eager, qwen3_moe / deepseek_v3 / mixtral at their test sizes (no padding), largest of
# the three: float32 log-probs 4e-8, gradient 3e-7; bfloat16 log-probs 2.8e-4, gradient 2.1e-2. float16 keeps 3 more
# mantissa bits than bfloat16. Each bound is ~5x the largest measured difference.
KERNEL_BOUNDS = {
    "float32": KernelBound(logprobs=1e-6, gradient=2e-6),
    "bfloat16": KernelBound(logprobs=2e-3, gradient=1e-1),
    "float16": KernelBound(logprobs=3e-4, gradient=1.5e-2),
}


def check_attention_runs(kernel: str, dtype: str, device: str) -> None:
    """ConfigError when attention `kernel` cannot run on `device` of this node: `flash_attention_2` needs a CUDA
    device and the `flash_attn` package. The message names the nearest kernel that runs and what changes."""
    if kernel != "flash_attention_2":
        return
    missing = []
    if not device.startswith("cuda"):
        missing.append(f"the replay runs on {device}, not a CUDA device")
    if importlib.util.find_spec("flash_attn") is None:
        missing.append("the flash_attn package is not installed")
    if not missing:
        return
    raise ConfigError(
        f"model.attn_implementation flash_attention_2 cannot run here ({'; '.join(missing)}). The nearest kernel "
        "that runs here is sdpa, PyTorch's fused attention (O(T) memory, as flash): the same attention summed in "
        f"another order, so the replay differs from the trainer's by rounding; for {dtype} sdpa is held within "
        f"{_bound_text(dtype)} of eager's. Set `model.attn_implementation: sdpa` in the run config to replay with "
        "it, or replay on a CUDA node with flash_attn installed",
        "model.attn_implementation",
    )


def _bound_text(dtype: str) -> str:
    bound = KERNEL_BOUNDS.get(dtype, KERNEL_BOUNDS["bfloat16"])
    return f"{bound.logprobs:g} (log-probs) and {bound.gradient:g} (gradient, relative L2)"


@dataclass(frozen=True)
class KernelCheck:
    """One kernel's replay against eager's on the same step."""

    kernel: str
    dtype: str
    logprobs_rel: float
    gradient_rel: float
    grad_norm_rel: float
    bound: KernelBound

    @property
    def within(self) -> bool:
        return self.logprobs_rel <= self.bound.logprobs and self.gradient_rel <= self.bound.gradient


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / denominator if denominator > 0 else math.inf


def compare_to_eager(
    spec: HFModelConfig,
    state: dict[str, Any],
    batch: dict[str, torch.Tensor],
    routing: RoutingControl,
    loss_of: Callable[[PolicyOutput], torch.Tensor],
    device: str = "cpu",
) -> KernelCheck:
    """The spec's kernel against eager on one step: both policies built from `state`, forwarded on `batch` with
    `routing`, and `loss_of` their outputs back-propagated; relative differences of the log-probs, the gradient and
    its norm, with the dtype's bound (`KERNEL_BOUNDS`)."""
    import dataclasses

    import torch

    from axrl_spike_replay.models.policy import build_policy, policy_forward

    results = []
    for kernel in ("eager", spec.attn_implementation):
        variant = dataclasses.replace(spec, attn_implementation=kernel)
        check_attention_runs(kernel, spec.dtype, device)
        model = build_policy(variant, "cpu")
        model.load_state_dict(state)
        model.to(device)
        out = policy_forward(model, batch, routing, need_entropy=False)
        loss_of(out).backward()
        grads = [p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None]
        results.append((out.logprobs.detach().float(), torch.cat(grads)))
        del model
    (eager_lp, eager_g), (lp, g) = results
    norm, eager_norm = float(g.double().norm()), float(eager_g.double().norm())
    norm_rel = abs(norm - eager_norm) / eager_norm if eager_norm > 0 else math.inf
    return KernelCheck(
        kernel=spec.attn_implementation,
        dtype=spec.dtype,
        logprobs_rel=_rel(lp, eager_lp),
        gradient_rel=_rel(g, eager_g),
        grad_norm_rel=norm_rel,
        bound=KERNEL_BOUNDS.get(spec.dtype, KERNEL_BOUNDS["bfloat16"]),
    )
