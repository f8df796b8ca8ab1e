"""The spike guard inside verl 0.9.1's FSDP engine (applied with the patch `verl-0.9.1.diff` beside this file).

The patched `FSDPEngine.forward_backward_batch` keeps the rank's mini-batch and the loss function it trains with
(`partial(ppo_loss, config=actor_config)`); the patched `optimizer_step` calls `guard_step(engine, grad_norm)`
with the pre-clip global norm, after verl's `clip_grad_norm_` and before `optimizer.step()`. A tripped guard
writes a snapshot collectively: weights as a sharded DCP checkpoint (`get_model_state_dict`), each rank's
mini-batch under verl's own key names (jagged tensors kept, with the step's global counts `batch_num_tokens`,
`dp_size`, `global_batch_size` the engine set on it), the routes, grad info (the global pre-clip norm and the
per-parameter ones, computed in float64 from the gradients: the clipped ones divided by the clip's own
coefficient), and `run_config.yaml` with the `loss:` section mapped from
the actor config (`capture/verl_loss_section.py`: convention verl, normalization global, clip ratios, dual clip,
aggregation, entropy, KL; settings it cannot represent listed under `unreproduced`, warned about at the first
step, and refused by the replay), the `model:` section (kind hf: the actor's HF config, its compute dtype and the
attention/experts kernels it ran with) and the `routing:` section (the engine's router replay mode), so the
snapshot replays on the torch engine. `False` means skip the step (the fp16 GradScaler's step is then closed
with `scaler.update()`, so verl's next `unscale_` is allowed).

The iteration is verl's global step, which the patched trainer sets on the batch (`global_steps`; without it, the
hook's own count of optimizer updates, said once in the log). Snapshots are named `iter_<global step>-<run id>`:
a restarted run writes beside the previous run's snapshots of the same steps, never onto them, and a second
spiking update within one step gets a `.2` suffix.

`guard_step` never raises into training: a bad setting is logged once (variable and value) and takes its
default; a snapshot that cannot be written on any rank (a full disk, an unwritable dir) is abandoned on every rank
alike with nothing left behind, logged once, and the step is handled as the guard decided; anything else turns the
guard off for the rest of the run, logged once with its traceback, and verl's step goes on unguarded.

Turned on by `AXRL_VERL_HOOK=axrl_spike_replay.integrations.verl` (the patch imports it from the installed
package; a path to a copy of this file is loaded by path instead). Settings: `AXRL_SPIKE_DIR` (snapshot root, default
`checkpoints/spike_snapshots`), `AXRL_SPIKE_ACTION` (skip | log | rollback | rollback-as-skip, default skip;
verl owns its checkpoints, so rollback skips), `AXRL_SPIKE_THRESHOLD` (5), `AXRL_SPIKE_WINDOW` (20),
`AXRL_SPIKE_WARMUP` (10), `AXRL_SPIKE_WARMUP_RATIO` (10; `off` for a blind warm-up), `AXRL_SPIKE_MAX_NORM` (none),
`AXRL_JOB_NAME`, `AXRL_RUN_ID` (default: the UTC start time and four hex digits). The guard is the hooks' shared one
(`capture.guard_settings.guard_detector`): armed from step 1, see docs/capture.md.
Needs torch and axrl_spike_replay; verl itself is never imported here.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

VERL_VERSION = "0.9.1"
_CLIP_EPS = 1e-6  # torch's and FSDP's clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), at most 1
# AXRL_SPIKE_ACTION values: verl owns its checkpoints, so there is no in-memory rollback; it skips instead
_ACTIONS = {"skip": "skip", "log": "log", "rollback": "skip", "rollback-as-skip": "skip"}
_state: dict[str, Any] = {}
log = logging.getLogger("axrl_spike_replay.verl_hook")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _report_once(kind: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
    """Log a problem once per run (rank 0; the other ranks hold the same settings and agreed outcomes)."""
    reported: set[str] = _state.setdefault("reported", set())
    if kind in reported or _rank() != 0:
        log.debug("axrl spike guard: " + message, *args)
        return
    reported.add(kind)
    log.log(level, "axrl spike guard: " + message, *args)


def _guard() -> Any:
    if "guard" not in _state:
        from axrl_spike_replay.capture.guard_settings import guard_detector, settings_from_env
        from axrl_spike_replay.capture.spike_guard import SpikeGuard

        settings = settings_from_env(os.environ, _ACTIONS)
        for problem in settings.problems:
            _report_once(f"setting {problem.split('=', 1)[0]}", "%s", problem)
        for note in settings.notes:
            _report_once(note, "%s", note, level=logging.INFO)
        _state["guard"] = SpikeGuard(
            settings.snapshots_root,
            action=settings.action,
            detector=guard_detector(settings),  # armed from step 1 unless AXRL_SPIKE_WARMUP_RATIO=off
            job_name=settings.job_name,
            run_id=settings.run_id,
        )
        _state["run_id"] = settings.run_id
    return _state["guard"]


def batch_payload(data: Any) -> dict[str, Any]:
    """A verl mini-batch (TensorDict or mapping) as a dict of tensors under verl's key names, on the CPU."""
    import torch

    from axrl_spike_replay.snapshot.trainer_formats.verl_batch import VERL_COUNT_KEYS

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
        precision = precision_section(getattr(engine, "engine_config", None))
        if precision is not None:
            doc["precision"] = precision
    return doc


def precision_section(engine_config: Any) -> dict[str, Any] | None:
    """The `precision:` section of an FSDP engine: `fsdp_config.mixed_precision` read with verl's own defaults
    (param bf16, reduce fp32; `FSDPEngine._build_fsdp_module`), so a replay computes in the trainer's precision;
    None for an engine that is not FSDP's."""
    from axrl_spike_replay.training.precision import PrecisionPolicy

    if engine_config is None or getattr(engine_config, "strategy", None) not in ("fsdp", "fsdp2"):
        return None
    given = getattr(engine_config, "mixed_precision", None) or {}
    policy = PrecisionPolicy.from_dict(
        {
            "param_dtype": given.get("param_dtype", "bf16"),
            "reduce_dtype": given.get("reduce_dtype", "fp32"),
        },
        "verl fsdp_config.mixed_precision",
    )
    return policy.to_dict()


def _warn_once(engine: Any) -> None:
    """At the first step, say which of the trainer's loss settings a snapshot could not represent (a spike's
    snapshot records them and the torch replay refuses it), so the user knows before any spike."""
    from axrl_spike_replay.capture.verl_loss_section import section_from_loss_function

    found = section_from_loss_function(_loss_function(engine))
    for item in found.unreproduced:
        _report_once(f"loss {item}", "snapshots will record this loss setting as not reproduced: %s", item)


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


def grad_info(engine: Any, norms: Any, coef: float, trainer_norm: float) -> dict[str, Any]:
    """The rank's grad info from its float64 norms (`capture.float64_norms`): the global pre-clip norm and each
    parameter's pre-clip gradient norm (this rank's shard under FSDP). The guard runs after verl's clip, so norms
    read off the clipped gradients are divided by the clip's coefficient, the global one and the per-parameter
    ones alike (they merge to it); a non-finite norm leaves them as read (the clip made them NaN or zero).
    `trainer_grad_norm` keeps the float32 norm verl's clip reported."""
    params = dict(engine.module.named_parameters())
    divisor = coef if 0.0 < coef < float("inf") else 1.0
    return {
        "grad_norm": pre_clip_norm(norms.global_norm, coef, trainer_norm),
        "param_grad_norms": {n: norms.local.get(n, 0.0) / divisor for n in params},
        "param_numel": {n: p.numel() for n, p in params.items()},
        "param_grad_norms_kind": "reduced_shard" if _sharded(engine.module) else "reduced",
        "clip_coef": coef,
        "trainer_grad_norm": trainer_norm,
    }


def pre_clip_norm(clipped_norm: float, coef: float, trainer_norm: float) -> float:
    """The float64 pre-clip global norm from the clipped gradients' float64 norm: divided by the clip's float32
    coefficient, the very factor the gradients were multiplied by, so only the multiply's rounding (at most 2^-24
    of each element, hence of the norm) stays. A non-finite trainer norm is kept as verl reported it."""
    if not math.isfinite(trainer_norm):
        return trainer_norm
    return clipped_norm / (coef if 0.0 < coef < float("inf") else 1.0)


def global_step(data: Any) -> int | None:
    """verl's global step on the mini-batch (`global_steps`, set by the patched trainer), else None."""
    try:
        value = _unwrapped(data["global_steps"]) if data is not None else None
    except (KeyError, AttributeError, TypeError, IndexError):
        return None
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def _iteration(data: Any) -> tuple[int, int, bool]:
    """(iteration, which optimizer update of that iteration, whether it is verl's global step). Without verl's
    global step, the hook numbers optimizer updates itself (said once)."""
    _state["updates"] = _state.get("updates", 0) + 1
    step = global_step(data)
    if step is None:
        _report_once(
            "no global step",
            "verl's global step is not on the mini-batch (is the trainer part of the patch verl-0.9.1.diff "
            "applied?); snapshots are numbered by this process's optimizer updates",
        )
        return _state["updates"], 1, False
    _state["update"] = _state.get("update", 0) + 1 if _state.get("last_step") == step else 1
    _state["last_step"] = step
    return step, _state["update"], True


def guard_step(engine: Any, grad_norm: Any) -> bool:
    """Judge the step's pre-clip grad norm; on a spike snapshot it (collective); True to take the optimizer step.

    Never raises: see the module's docstring for what happens to each kind of failure."""
    if _state.get("off"):
        return True
    try:
        return _guard_step(engine, grad_norm)
    except Exception:
        _state["off"] = True
        log.exception(
            "axrl spike guard: an unexpected error; the guard is off for the rest of this run and training goes on "
            "unguarded (verl's own step, as without the hook)"
        )
        return True


def _guard_step(engine: Any, grad_norm: Any) -> bool:
    import torch

    first = "guard" not in _state
    guard = _guard()
    if first:
        try:
            _warn_once(engine)
        except Exception as exc:  # only a warning is lost: the guard itself is fine
            _report_once("loss settings", "could not read the loss settings at the first step: %s", exc)
    data = getattr(engine, "_axrl_spike_batch", None)
    iteration, update, from_verl = _iteration(data)
    norm = float(grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm)
    decision = guard.observe(iteration, norm)
    if decision.tripped:
        _snapshot(guard, engine, data, grad_norm, decision, {"optimizer_update": update, "from_verl": from_verl})
    return guard.apply(decision, engine.module, engine.optimizer, getattr(engine, "scaler", None))


def _snapshot(guard: Any, engine: Any, data: Any, grad_norm: Any, decision: Any, step: dict[str, Any]) -> None:
    """Write the snapshot on every rank. The collective parts come first and in the same order on every rank,
    whatever failed before them; each rank's own failure then travels into the write, which abandons it on all
    ranks alike (no rank is left waiting in a collective another rank skipped)."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from axrl_spike_replay.capture.float64_norms import float64_grad_norms
    from axrl_spike_replay.capture.rank_agreement import describe
    from axrl_spike_replay.capture.snapshot_writer import RankPayload
    from axrl_spike_replay.snapshot.metadata import ParallelLayout
    from axrl_spike_replay.snapshot.trainer_formats.verl_batch import verl_padded_batch, verl_routes

    rank = _rank()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    guard.parallel = ParallelLayout(world_size=world, dp=world)
    errors: list[str] = []
    norms: Any = None
    state: Any = {}
    try:
        norms = float64_grad_norms(engine.module)  # collective under FSDP
    except Exception as exc:
        errors.append(f"float64 grad norms: {describe(exc)}")
    try:
        state = get_model_state_dict(engine.module)  # collective under FSDP1's sharded state dict
    except Exception as exc:
        errors.append(f"model state dict: {describe(exc)}")
    payloads: dict[int, Any] = {}
    config: dict[str, Any] = {}
    record = decision
    if not errors:
        try:
            coef = clip_coefficient(grad_norm, getattr(getattr(engine, "optimizer_config", None), "clip_grad", None))
            info = grad_info(engine, norms, coef, decision.grad_norm)
            exact = info["grad_norm"]
            median = decision.median_norm
            ratio = exact / median if median > 0 and math.isfinite(exact) else decision.spike_ratio
            record = dataclasses.replace(decision, grad_norm=exact, spike_ratio=ratio)
            batch = batch_payload(data if data is not None else {})  # a TensorDict refuses bool()
            routing = None
            if "routed_experts" in batch and "response_mask" in batch:
                routes = verl_routes(verl_padded_batch(batch, "verl mini-batch"))
                if routes is not None:
                    routing = {
                        "routed_experts": routes,
                        "moe_layers": list(range(routes.shape[2])),
                        "source": "rollout",
                    }
            payloads = {rank: RankPayload(batch, info, routing)}
            config = run_config(world, engine, data)
            config["train"].update(
                {
                    "global_step": decision.step if step["from_verl"] else None,
                    "optimizer_update": step["optimizer_update"],
                    "run_id": _state.get("run_id"),
                }
            )
        except Exception as exc:
            errors.append(describe(exc))
    guard.snapshot(record, state, payloads, run_config=config, local_error="; ".join(errors) or None)
