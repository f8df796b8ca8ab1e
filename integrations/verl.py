"""The spike guard inside verl 0.9.1's FSDP engine (applied with integrations/verl-0.9.1.diff).

The patched `FSDPEngine.forward_backward_batch` keeps the rank's mini-batch and the loss function it trains with
(`partial(ppo_loss, config=actor_config)`); the patched `optimizer_step` calls `guard_step(engine, grad_norm)`
with the pre-clip global norm, after verl's `clip_grad_norm_` and before `optimizer.step()`. A tripped guard
writes a snapshot collectively: weights as a sharded DCP checkpoint (`get_model_state_dict`), each rank's
mini-batch under verl's own key names (jagged tensors kept, with the step's global counts `batch_num_tokens`,
`dp_size`, `global_batch_size` the engine set on it), the routes, grad info (per-parameter norms before the clip:
the clipped ones divided by the clip's own coefficient), and `run_config.yaml` with the `loss:` section mapped from
the actor config (`capture/verl_loss_section.py`: convention verl, normalization global, clip ratios, dual clip,
aggregation, entropy, KL; settings it cannot represent listed under `unreproduced`, warned about at the first
step, and refused by the replay), the `model:` section (kind hf: the actor's HF config, its compute dtype and the
attention/experts kernels it ran with) and the `routing:` section (the engine's router replay mode), so the
snapshot replays on the torch engine. `False` means skip the step.

Loaded by file path (`AXRL_VERL_HOOK=/path/to/integrations/verl.py`; a module named `verl` on
sys.path would shadow verl itself). Settings: `AXRL_SPIKE_DIR` (snapshot root, default
`checkpoints/spike_snapshots`), `AXRL_SPIKE_ACTION` (skip | log | rollback-as-skip, default skip),
`AXRL_SPIKE_THRESHOLD`, `AXRL_SPIKE_WINDOW`, `AXRL_SPIKE_WARMUP`, `AXRL_JOB_NAME`. Needs torch and
axrl_spike_replay; verl itself is never imported here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

VERL_VERSION = "0.9.1"
_CLIP_EPS = 1e-6  # torch's and FSDP's clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), at most 1
_state: dict[str, Any] = {}
log = logging.getLogger("axrl_spike_replay.verl_hook")


def _guard() -> Any:
    if "guard" not in _state:
        from axrl_spike_replay.capture.detectors import MedianRatioDetector
        from axrl_spike_replay.capture.spike_guard import SpikeGuard

        action = os.environ.get("AXRL_SPIKE_ACTION", "skip")
        _state["guard"] = SpikeGuard(
            os.environ.get("AXRL_SPIKE_DIR", "checkpoints/spike_snapshots"),
            action="skip" if action == "rollback" else action,  # verl owns its checkpoints: no in-memory rollback
            detector=MedianRatioDetector(
                window=int(os.environ.get("AXRL_SPIKE_WINDOW", "20")),
                threshold=float(os.environ.get("AXRL_SPIKE_THRESHOLD", "5.0")),
                warmup=int(os.environ.get("AXRL_SPIKE_WARMUP", "10")),
            ),
            job_name=os.environ.get("AXRL_JOB_NAME", "verl-job"),
        )
        _state["step"] = 0
    return _state["guard"]


def batch_payload(data: Any) -> dict[str, Any]:
    """A verl mini-batch (TensorDict or mapping) as a dict of tensors under verl's key names, on the CPU."""
    import torch

    from axrl_spike_replay.snapshot.verl_batch import VERL_COUNT_KEYS

    out: dict[str, Any] = {}
    for key in list(data.keys()):
        value = data[key] if not hasattr(data, "get") else data.get(key)
        if isinstance(value, torch.Tensor):
            out[str(key)] = value.detach().cpu()
    for key in VERL_COUNT_KEYS:  # the step's global counts: non-tensor data on verl's TensorDict
        try:
            value = data[key]
        except (KeyError, AttributeError, TypeError):
            continue
        value = _unwrapped(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = torch.tensor(value)
    return out


def _unwrapped(value: Any) -> Any:
    return getattr(value, "data", value)  # NonTensorData wraps the value


def _temperature(data: Any) -> float | None:
    """The mini-batch's sampling temperature when one value holds for the whole batch (verl divides logits by it)."""
    import torch

    try:
        value = _unwrapped(data["temperature"])
    except (KeyError, AttributeError, TypeError):
        return None
    if isinstance(value, torch.Tensor):
        flat = value.detach().reshape(-1).float()
        if flat.numel() == 0 or not bool((flat == flat[0]).all()):
            return None
        value = float(flat[0])
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def _dtype_name(dtype: Any) -> str | None:
    name = str(dtype).removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else None


def model_section(module: Any, compute_dtype: Any = None, temperature: float | None = None) -> dict[str, Any] | None:
    """The `model:` section (kind hf) for the actor module: its HF config dict, architecture (`model_type`),
    the dtype the step computed in (FSDP's mixed-precision param dtype, else the parameters'), and the attention
    and experts implementations the loaded model resolved. None when the module carries no HF config.

    Written as seen: a kernel the torch engine does not build (flash attention) makes the replay refuse with a
    pointer to `--backend command` instead of recomputing with another kernel."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    doc: dict[str, Any] = {
        "kind": "hf",
        "architecture": str(getattr(config, "model_type", "")),
        "config": config.to_dict(),
    }
    dtype = _dtype_name(compute_dtype) if compute_dtype is not None else None
    if dtype is None:
        first = next(iter(module.parameters()), None)
        dtype = _dtype_name(first.dtype) if first is not None else None
    if dtype is not None:
        doc["dtype"] = dtype
    for key in ("attn_implementation", "experts_implementation"):
        value = getattr(config, f"_{key}", None)
        if isinstance(value, str):
            doc[key] = value
    if temperature is not None:
        doc["temperature"] = temperature
    return doc


def routing_section(engine_config: Any) -> dict[str, Any]:
    """The `routing:` section: verl's router replay mode (R2/R3: the recorded routes forced) or off."""
    mode = getattr(getattr(engine_config, "router_replay", None), "mode", "disabled")
    return {"replay": "all" if mode in ("R2", "R3") else "off", "current_routing_layers": []}


def _loss_function(engine: Any) -> Any:
    return getattr(engine, "_axrl_spike_loss_fn", None)  # kept by the patched forward_backward_batch


def _rollout_correction(data: Any) -> str:
    """What the snapshot holds of verl's rollout correction (applied by its driver before the update)."""
    has_weights = data is not None and "rollout_is_weights" in list(data.keys())
    weights = "rollout_is_weights in the batch" if has_weights else "no rollout_is_weights in the batch"
    return f"as verl's driver applied it before the update: {weights}; response_mask after any rejection sampling"


def run_config(world_size: int, engine: Any = None, data: Any = None) -> dict[str, Any]:
    """The snapshot's run_config.yaml: the `loss:` section of the engine's loss function (verl's convention, global
    normalisation), an FSDP data-parallel layout, the verl version, and, from the engine when given, the actor's
    `model:` and `routing:` sections."""
    from axrl_spike_replay.capture.verl_loss_section import loss_section

    doc: dict[str, Any] = {
        "loss": loss_section(_loss_function(engine)),
        "parallel": {"world_size": world_size, "dp": world_size, "strategy": "fsdp"},
        "train": {"trainer": "verl", "verl_version": VERL_VERSION, "rollout_correction": _rollout_correction(data)},
    }
    if engine is not None:
        temperature = _temperature(data) if data is not None else None
        model = model_section(engine.module, getattr(engine, "_autocast_dtype", None), temperature)
        if model is not None:
            doc["model"] = model
        doc["routing"] = routing_section(getattr(engine, "engine_config", None))
    return doc


def _warn_once(engine: Any) -> None:
    """At the first step, say which of the trainer's loss settings a snapshot could not represent (a spike's
    snapshot records them and the torch replay refuses it), so the user knows before any spike."""
    from axrl_spike_replay.capture.verl_loss_section import section_from_loss_function

    found = section_from_loss_function(_loss_function(engine))
    for item in found.unreproduced:
        log.warning("axrl spike guard: snapshots will record this loss setting as not reproduced: %s", item)


def clip_coefficient(grad_norm: Any, max_norm: Any) -> float:
    """The factor verl's `clip_grad_norm_` multiplied every gradient by, computed as torch and FSDP compute it
    (in the norm's dtype): min(1, max_norm / (norm + 1e-6)); 1.0 without a max norm."""
    import torch

    if max_norm is None:
        return 1.0
    norm = grad_norm.detach().cpu() if isinstance(grad_norm, torch.Tensor) else torch.tensor(float(grad_norm))
    return float(torch.clamp(float(max_norm) / (norm + _CLIP_EPS), max=1.0))


def _sharded(module: Any) -> bool:
    """Whether FSDP (1 or 2) wraps the module: each rank then holds a shard of the reduced gradient."""
    from torch.distributed import fsdp

    kinds = tuple(k for k in (getattr(fsdp, "FullyShardedDataParallel", None), getattr(fsdp, "FSDPModule", None)) if k)
    return isinstance(module, kinds)


def grad_info(engine: Any, norm: float, grad_norm: Any) -> dict[str, Any]:
    """The rank's grad info: the global pre-clip norm and each parameter's pre-clip gradient norm (this rank's
    shard under FSDP). The guard runs after verl's clip, so the norms read off the clipped gradients are divided
    by the clip's coefficient; a non-finite norm leaves them as read (the clip made them NaN or zero)."""
    params = dict(engine.module.named_parameters())
    coef = clip_coefficient(grad_norm, getattr(getattr(engine, "optimizer_config", None), "clip_grad", None))
    divisor = coef if 0.0 < coef < float("inf") else 1.0

    def local(p: Any) -> float:
        if p.grad is None:
            return 0.0
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        return float(grad.detach().float().norm()) / divisor

    return {
        "grad_norm": norm,
        "param_grad_norms": {n: local(p) for n, p in params.items()},
        "param_numel": {n: p.numel() for n, p in params.items()},
        "param_grad_norms_kind": "reduced_shard" if _sharded(engine.module) else "reduced",
        "clip_coef": coef,
    }


def guard_step(engine: Any, grad_norm: Any) -> bool:
    """Judge the step's pre-clip grad norm; on a spike snapshot it (collective); True to take the optimizer step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from axrl_spike_replay.capture.snapshot_writer import RankPayload
    from axrl_spike_replay.snapshot.metadata import ParallelLayout
    from axrl_spike_replay.snapshot.verl_batch import verl_padded_batch, verl_routes

    if "guard" not in _state:
        _warn_once(engine)
    guard = _guard()
    _state["step"] += 1
    norm = float(grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm)
    decision = guard.observe(_state["step"], norm)
    if decision.tripped:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        guard.parallel = ParallelLayout(world_size=world, dp=world)
        data = getattr(engine, "_axrl_spike_batch", None)
        batch = batch_payload(data if data is not None else {})  # a TensorDict refuses bool()
        routing = None
        if "routed_experts" in batch and "response_mask" in batch:
            routes = verl_routes(verl_padded_batch(batch, "verl mini-batch"))
            if routes is not None:
                routing = {"routed_experts": routes, "moe_layers": list(range(routes.shape[2])), "source": "rollout"}
        state = get_model_state_dict(engine.module)
        payloads = {rank: RankPayload(batch, grad_info(engine, norm, grad_norm), routing)}
        guard.snapshot(decision, state, payloads, run_config=run_config(world, engine, data))
    return guard.apply(decision, engine.module, engine.optimizer)
