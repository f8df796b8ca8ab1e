"""megatron-core on a CPU-only torch: every monkeypatch it needs, in one place, applied only inside `megatron_on_cpu()`.

megatron-core is written for CUDA. Built with the local layer spec (no Transformer Engine, no Apex),
`use_cpu_initialization`, the `allgather` token dispatcher and the inference RNG tracker, it builds,
runs forward and backward, and saves and loads `torch_dist` checkpoints on CPU over gloo, given the
patches below. Each was checked against megatron-core 0.16.1 (the last release for Python 3.11) and
torch 2.13 CPU; none is needed to *load* a checkpoint. They are set on entry and restored on exit,
never at import, so nothing outside the `with` block sees them. On a GPU node none is applied
(`megatron_on_cpu` is a no-op when CUDA is available).

DeepSeek-V3's Multi-Latent Attention needs two more (megatron-core 0.16.1): `MultiLatentAttention` builds its core
attention with `k_channels` / `v_channels`, which only Transformer Engine's attention takes (the local spec's
`DotProductAttention` refuses them), and it tests `isinstance(linear_proj, TELinear)` behind a `HAVE_TE` that is
True whenever `megatron.core.extensions.transformer_engine` imports, which it does without Transformer Engine
(its names are then MagicMock placeholders). `mla_core_attention()` is Megatron's own `DotProductAttention`, taking
the two widths; `megatron_on_cpu` sets the module's `HAVE_TE` to what the extension says.

Known limits on CPU (megatron-core 0.16.1), which is why the CPU routes run TP=PP=1 forwards:
- a TP>1 forward in training mode needs sequence parallel, which the torch norm fallback refuses;
- pipeline-parallel schedules hard-code `device="cuda"` (`pipeline_parallel/schedules.py`);
- the alltoall dispatcher needs `torch.cuda.Stream` shims.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
from collections.abc import Iterator
from typing import Any

CHECKED_VERSION = "0.16.1"  # the megatron-core release these patches and the routes were checked against
SUPPORTED_VERSIONS = ("0.16",)  # release series whose checkpoints and modules we read and build
INSTALL_HINT = (
    "install megatron-core without its CUDA extras: pip install --no-deps megatron-core==0.16.1 psutil "
    "(scripts/setup.sh does this for the tests)"
)


def megatron_core_version() -> str | None:
    """The installed megatron-core version, or None when it is not installed."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return None
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def megatron_unavailable_reason() -> str | None:
    """Why megatron-core cannot be used here (not installed, an unchecked release, psutil missing), or None."""
    version = megatron_core_version()
    if version is None:
        return f"megatron-core is not installed; {INSTALL_HINT}"
    if not any(version == s or version.startswith(f"{s}.") for s in SUPPORTED_VERSIONS):
        return f"megatron-core {version} is installed; the Megatron routes were checked against {CHECKED_VERSION}"
    if importlib.util.find_spec("psutil") is None:
        return "megatron-core imports psutil for checkpoint writes but does not declare it: pip install psutil"
    return None


class _Patches:
    """Attributes set on entry and put back on exit (an attribute that did not exist is deleted again)."""

    _ABSENT: Any = object()

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name, self._ABSENT)))
        setattr(owner, name, value)

    def restore(self) -> None:
        for owner, name, value in reversed(self._saved):
            if value is self._ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()


def _cpu_device() -> str:
    return "cpu"


def _no_sync(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Run megatron-core on a CPU-only torch inside the block (nothing is patched when CUDA is available)."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    from megatron.core.transformer.moe import moe_utils

    patches = _Patches()
    try:
        # Tensors are created with `device=torch.cuda.current_device()` throughout megatron-core (router buffers,
        # tensor-parallel mappings, gpt_model, the dist_checkpointing save planner): 0.16.1.
        patches.set(torch.cuda, "current_device", _cpu_device)
        # dist_checkpointing's save and the DDP / parallel_state helpers synchronize the device: 0.16.1.
        patches.set(torch.cuda, "synchronize", _no_sync)
        # Without Transformer Engine `moe_utils` never defines `te_general_gemm`, yet the router's
        # `RouterGatingLinearFunction.forward` reads it (a megatron-core bug): None takes the torch.mm path. 0.16.1.
        patches.set(moe_utils, "te_general_gemm", None)
        _patch_mla(patches)
        yield
    finally:
        patches.restore()


def initialize_cpu_rng(seed: int = 0) -> None:
    """The RNG tracker megatron-core needs before a model is built, in its CPU-usable form (the inference tracker
    forks no CUDA RNG state), reset so a second build in the same process starts afresh. Checked on 0.16.1."""
    import torch
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(seed)


def _patch_mla(patches: _Patches) -> None:
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    # `multi_latent_attention.HAVE_TE` is True when the extension module imports, and it imports without Transformer
    # Engine (TELinear is then a MagicMock, and `isinstance(self.linear_proj, TELinear)` in
    # `MultiLatentAttention.__init__` raises TypeError). The extension's own flag says whether TE is there. 0.16.1.
    patches.set(multi_latent_attention, "HAVE_TE", bool(getattr(transformer_engine, "HAVE_TE", False)))


@functools.cache
def mla_core_attention() -> type:
    """Megatron's local-spec core attention (`DotProductAttention`) taking the key and value widths Multi-Latent
    Attention passes it (`k_channels`, `v_channels`, as Transformer Engine's attention takes them).

    Checked against megatron-core 0.16.1: `DotProductAttention.forward` already works for keys and values of
    different widths (scores `baddbmm` over the key width, context `bmm` over the value width, both read from the
    tensors); only its constructor refuses the two arguments and sizes its output view from `kv_channels`. So the
    widths are accepted and the output width is the value width times the local heads; the softmax scale MLA
    passes (`softmax_scale`, its own 1/sqrt(qk_head_dim + rope dim) with yarn's mscale) is used as is."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # `Attention.__init__` builds one without widths first, MLA then rebuilds
                heads = self.config.num_attention_heads
                self.hidden_size_per_partition = divide(v_channels * heads, self.tp_group.size())

    return MLADotProductAttention
