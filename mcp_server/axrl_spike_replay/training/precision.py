"""The trainer's mixed-precision policy, recorded in the run config's `precision:` section and replayed.

A mixed-precision FSDP trainer keeps float32 master weights and computes the step in `param_dtype`: FSDP casts
each unit's parameters to it when it all-gathers them (and the unit's floating inputs, `cast_forward_inputs`),
casts the gradients to `reduce_dtype` before it reduce-scatters them and hands the root's outputs back in
`output_dtype` (None: as computed). The same three fields as FSDP2's `MixedPrecisionPolicy` (verl sets them from
`actor.fsdp_config.mixed_precision`; FSDP1's `MixedPrecision` has the first two).

Sharded, a replay hands the policy to `fully_shard`. Unsharded it does the equivalent cast (`cast_for_compute`):
the parameters are held in `param_dtype`, the same units cast their floating inputs with a pre-hook, the root casts
its outputs, and the reduction sums the gradients in `reduce_dtype` (`training.rank_step`). A snapshot without
the section replays as before: in the model's own dtype, reduced in it (`PrecisionPolicy.of_model`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown, shown_names
from axrl_spike_replay.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

DTYPES = ("float32", "bfloat16", "float16")
# the names trainers write: verl's PrecisionType, torch's own
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
KEYS = ("param_dtype", "reduce_dtype", "output_dtype")
RECORDED = "run_config"  # the policy came from the snapshot's `precision:` section
MODEL_DTYPE = "model_dtype"  # none recorded: the model's own dtype throughout (replays before the section existed)


def dtype_name(value: Any, where: str, optional: bool = False) -> str | None:
    """The canonical name of a dtype given as a string (`bf16`, `bfloat16`, `torch.bfloat16`) or a torch dtype."""
    if value is None and optional:
        return None
    name = str(value).removeprefix("torch.") if value is not None else ""
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        raise ConfigError(f"{where} must be one of {', '.join(DTYPES)}, got {shown(value, 40)}")
    return name


@dataclass(frozen=True)
class PrecisionPolicy:
    """Parameter (compute), gradient reduction and output dtypes of a training step, and where they came from."""

    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    output_dtype: str | None = None
    source: str = RECORDED

    def __post_init__(self) -> None:
        dtype_name(self.param_dtype, "precision.param_dtype")
        dtype_name(self.reduce_dtype, "precision.reduce_dtype")
        dtype_name(self.output_dtype, "precision.output_dtype", optional=True)

    @classmethod
    def from_dict(cls, doc: Any, where: str = "precision") -> PrecisionPolicy:
        """The `precision:` section (unknown keys and dtypes are a ConfigError naming them)."""
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{where}: expected a mapping of {', '.join(KEYS)}, got {type(doc).__name__}")
        unknown = sorted(str(k) for k in set(doc) - set(KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown keys {shown_names(unknown)} (known: {', '.join(KEYS)})")
        param = dtype_name(doc.get("param_dtype", "float32"), f"{where}.param_dtype")
        reduce = dtype_name(doc.get("reduce_dtype", param), f"{where}.reduce_dtype")
        output = dtype_name(doc.get("output_dtype"), f"{where}.output_dtype", optional=True)
        assert param is not None and reduce is not None
        return cls(param_dtype=param, reduce_dtype=reduce, output_dtype=output)

    @classmethod
    def of_model(cls, dtype: str) -> PrecisionPolicy:
        """No policy recorded: the model's own dtype for compute and reduction (how every replay ran before)."""
        return cls(param_dtype=dtype, reduce_dtype=dtype, output_dtype=None, source=MODEL_DTYPE)

    def to_dict(self) -> dict[str, Any]:
        """The run config section (without `source`)."""
        return {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype, "output_dtype": self.output_dtype}

    def describe(self) -> dict[str, Any]:
        """What a result says ran."""
        return {**self.to_dict(), "source": self.source}

    @classmethod
    def from_result(cls, doc: Mapping[str, Any]) -> PrecisionPolicy:
        """The policy a replay result says ran (`describe`'s form, with its source); ConfigError naming the dtype
        that is not one."""
        policy = cls.from_dict({k: v for k, v in doc.items() if k in KEYS}, "result precision")
        return cls(policy.param_dtype, policy.reduce_dtype, policy.output_dtype, str(doc.get("source") or RECORDED))

    @property
    def recorded(self) -> bool:
        return self.source == RECORDED

    @property
    def label(self) -> str:
        out = f", output {self.output_dtype}" if self.output_dtype else ""
        return f"param {self.param_dtype}, reduce {self.reduce_dtype}{out}"

    def torch_dtype(self, which: str) -> torch.dtype | None:
        import torch

        name = getattr(self, which)
        return None if name is None else getattr(torch, name)

    def fsdp_policy(self) -> Any:
        """FSDP2's `MixedPrecisionPolicy` for this policy (what `fully_shard` is given); FSDP's default (no cast,
        reduced in the gradients' dtype) when none was recorded."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not self.recorded:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=self.torch_dtype("param_dtype"),
            reduce_dtype=self.torch_dtype("reduce_dtype"),
            output_dtype=self.torch_dtype("output_dtype"),
            cast_forward_inputs=True,
        )


def precision_of_run_config(doc: Mapping[str, Any], where: str = "run config") -> PrecisionPolicy | None:
    """The run config's `precision:` section as a policy; None when it has none."""
    section = doc.get("precision")
    if section is None:
        return None
    return PrecisionPolicy.from_dict(section, f"{where}: precision")


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating tensor in it cast to `dtype`, walked exactly as FSDP2 walks a unit's inputs and
    the root's outputs (its own helpers: tuples, dicts, dataclasses, named tuples)."""
    import functools

    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    return _apply_to_tensors(functools.partial(_cast_fp_tensor, dtype), value)


def cast_outputs(value: Any, policy: PrecisionPolicy) -> Any:
    """`value` (a policy's outputs) as the root hands them back under `policy`: every floating tensor in it cast to
    `output_dtype` (as it is when there is none); for a caller that computes the policy's forward in pieces."""
    output = policy.torch_dtype("output_dtype") if policy.recorded else None
    return value if output is None else _cast_floats(value, output)


def cast_for_compute(model: nn.Module, units: Sequence[nn.Module], policy: PrecisionPolicy) -> None:
    """The unsharded equivalent of `fully_shard(unit, mp_policy=policy.fsdp_policy())` on each of `units` and on the
    root `model`: parameters held in `param_dtype` (buffers keep theirs, as FSDP leaves them), each unit's and
    the root's floating inputs cast to it, the root's outputs cast to `output_dtype`. Gradients come out in
    `param_dtype`; the reduction casts them to `reduce_dtype` (`rank_step.reduce_grads`)."""
    import torch

    param = policy.torch_dtype("param_dtype")
    assert param is not None
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype != param and p.is_floating_point():
                p.data = p.data.to(param)

    def cast_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _cast_floats(args, param), _cast_floats(kwargs, param)

    for unit in (*units, model):
        unit.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    output = policy.torch_dtype("output_dtype")
    if output is not None:
        model.register_forward_hook(lambda module, args, out: _cast_floats(out, output))
