"""One replay process's memory, by part, for N processes, from a model's element counts and widths (its meta
build: no weight read). `replay_plan` adds where it runs and what fits.

Per process, in the precision that runs (`StepDtypes`): the model's own dtype throughout when the snapshot records
no precision policy; under a recorded one (`training.precision`), parameters held in `param_dtype` whole and as
float32 master shards sharded, the units gathered and the activations in `param_dtype`, the gradient sums in
`reduce_dtype` (sharded: in the larger of it and the master dtype, FSDP2's sharded gradients' dtype):

- parameters: P x bytes, whole. Sharded (FSDP2, units as `models.policy.shard_units` makes them: the decoder
  layers, and untied embeddings and output head): P/N, plus the root unit's own parameters, which FSDP2 keeps
  gathered from the forward through the backward (with untied embeddings only the final norm). Every other unit
  is resharded after its forward, so none is gathered when the activations peak, at the forward's end;
- gradients: one copy per config sharing the forward (a baseline replay: 1), one more while a process that runs
  several saved ranks adds the next rank's gradient into the sum (each pass's own is freed once added); sharded:
  1/N of that, plus the root's unsharded gradient (reduce-scattered last). A backward frees the forward's
  activations as it makes the gradient, so the step's peak holds the earlier copies plus the larger of the two;
- gathered (sharded, transient in the backward): three of the largest unit at once: the unit computing, its
  unsharded gradient, and the flat buffer FSDP2 gathers the unit into (or reduce-scatters its gradient from); no
  unit is prefetched. It adds to the new gradient's side of the step;
- activations: what autograd keeps for one saved rank's forward (a process runs its ranks one after another), from
  the architecture's widths and the rank's tokens (`activation_bytes`; eager attention keeps the [T, T] scores);
- runtime: the interpreter, torch and this package (CPU), or the CUDA context (GPU). Freed host memory is given
  back (`replay.host_allocator`), so nothing is counted for what the allocator would otherwise keep;
- loading (transient): a whole replay builds the model, then fills a copy of its state from the checkpoint: twice
  the parameters, in host memory, before the step starts.

The peak is the larger of loading and the step. `benchmarks/bench_plan.py` checks it against measured peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.policy import ModelSpec
from axrl_spike_replay.models.tiny_moe import TinyMoEConfig
from axrl_spike_replay.training.precision import PrecisionPolicy

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# a replay process's imports before it builds anything: python, torch with FSDP2 and DCP, transformers' modelling and
# this package (measured: 353 MiB peak RSS, torch 2.13 CPU and transformers 5, of which this package ~5 MiB)
RUNTIME_CPU_BYTES = 350 << 20
CUDA_CONTEXT_BYTES = 600 << 20  # the CUDA context and torch's kernels on each GPU a process uses


@dataclass(frozen=True)
class StepDtypes:
    """Bytes per element of what a replay process holds, in the precision that runs."""

    compute: int  # parameters whole, the units FSDP2 gathers, a pass's gradient, the activations
    master: int  # the parameters' shards (float32 master weights under a recorded policy)
    reduce: int  # the gradient sums
    params: str  # in words, for the plan
    grads: str


def step_dtypes(model_dtype: str, precision: PrecisionPolicy | None) -> StepDtypes:
    """What runs: the model's own dtype throughout when no policy is recorded, else the policy's dtypes."""
    if precision is None or not precision.recorded:
        b = DTYPE_BYTES[model_dtype]
        return StepDtypes(b, b, b, model_dtype, model_dtype)
    compute, reduce = DTYPE_BYTES[precision.param_dtype], DTYPE_BYTES[precision.reduce_dtype]
    master = DTYPE_BYTES["float32"]
    params = precision.param_dtype + ("" if compute == master else ", float32 master weights when sharded")
    return StepDtypes(compute, master, reduce, params, precision.reduce_dtype)


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs of a model, from its meta build: element counts and widths."""

    description: str
    parameters: int
    largest_unit: int  # elements of the largest FSDP unit (`models.policy.shard_units`: gathered one at a time)
    root: int  # elements FSDP2's root unit holds itself (outside every unit): gathered for the whole step
    dtype: str
    layers: int
    hidden: int
    q_width: int  # query heads x their head dim
    kv_width: int  # key/value heads x their head dim (each of k and v)
    heads: int
    dense_width: int  # the dense MLP's intermediate size (0: none)
    dense_layers: int
    expert_width: int
    experts: int
    top_k: int
    shared_width: int  # shared experts' total intermediate size (0: none)
    vocab: int


@dataclass
class ProcessMemory:
    """One replay process's memory in bytes, by part."""

    parameters: int
    gradients: int
    activations: int
    runtime: int
    loading: int  # transient, while the weights load (host memory)

    held_gradients: int = 0  # the part of `gradients` kept from earlier ranks or configs while one more is computed
    gathered: int = 0  # sharded: units gathered in the backward, parameters and gradient in flight (transient)

    @property
    def step(self) -> int:
        """During a backward: the held gradients, plus the larger of what the forward kept (at its start) and the
        new gradient with the units gathered to make it (at its end; the activations are freed as it is made)."""
        fresh = self.gradients - self.held_gradients
        return self.runtime + self.parameters + self.held_gradients + max(self.activations, fresh + self.gathered)

    @property
    def peak(self) -> int:
        return max(self.step, self.runtime + self.loading)


def model_facts(spec: ModelSpec) -> ModelFacts:
    """Element counts and widths of a spec's model (HF kinds from a meta build; the tiny model from its shapes)."""
    if isinstance(spec, MegatronModelConfig):
        return model_facts(spec.hf)
    if isinstance(spec, HFModelConfig):
        return _hf_facts(spec)
    return _tiny_facts(spec)


def _tiny_facts(spec: TinyMoEConfig) -> ModelFacts:
    from axrl_spike_replay.models.tiny_moe import expected_state_shapes

    shapes = expected_state_shapes(spec)
    total = sum(math.prod(s) for s in shapes.values())
    per_layer = [
        sum(math.prod(s) for n, s in shapes.items() if n.startswith(f"blocks.{i}.")) for i in range(spec.n_layers)
    ]
    moe = len(spec.moe_layer_ids)
    return ModelFacts(
        description=f"tiny_moe ({spec.n_layers} layers, {spec.n_experts} experts)",
        parameters=total,
        largest_unit=max(per_layer, default=0),
        root=total - sum(per_layer),
        dtype="float32",
        layers=spec.n_layers,
        hidden=spec.d_model,
        q_width=spec.d_model,
        kv_width=spec.d_model,
        heads=spec.n_heads,
        dense_width=spec.d_ff,
        dense_layers=spec.n_layers - moe,
        expert_width=spec.d_ff,
        experts=spec.n_experts,
        top_k=spec.top_k,
        shared_width=0,
        vocab=spec.vocab_size,
    )


def _hf_facts(spec: HFModelConfig) -> ModelFacts:
    from axrl_spike_replay.models.hf_config import expected_hf_shapes, hf_config_object

    shapes = expected_hf_shapes(spec)
    tied = bool(getattr(hf_config_object(spec), "tie_word_embeddings", False))
    if tied:  # one matrix, held by the root (the state dict names it twice)
        shapes = {n: s for n, s in shapes.items() if n != "lm_head.weight"}
    total = sum(math.prod(s) for s in shapes.values())
    units: dict[str, int] = {}  # as `models.policy.shard_units` makes them: decoder layers, untied ends
    for name, shape in shapes.items():
        parts = name.split(".")
        if "layers" in parts:
            key = ".".join(parts[: parts.index("layers") + 2])
        elif not tied and ("embed_tokens" in parts or parts[0] == "lm_head"):
            key = "embed_tokens" if "embed_tokens" in parts else "lm_head"
        else:
            continue
        units[key] = units.get(key, 0) + math.prod(shape)
    c = spec.config
    hidden = int(c.get("hidden_size", 0))
    heads = int(c.get("num_attention_heads", 1))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or 0) or hidden // max(heads, 1)
    if "qk_nope_head_dim" in c:  # multi-head latent attention (DeepSeek): per-head q/k and v widths
        qk = int(c.get("qk_nope_head_dim", 0)) + int(c.get("qk_rope_head_dim", 0))
        q_width, kv_width = heads * qk, heads * max(qk, int(c.get("v_head_dim") or qk))
    else:
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
    experts = int(c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts") or 0)
    moe_layers = len(spec.moe_layer_ids)
    expert_width = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
    shared = int(c.get("shared_expert_intermediate_size") or 0)
    if not shared and c.get("n_shared_experts"):
        shared = int(c["n_shared_experts"]) * expert_width
    return ModelFacts(
        description=f"{spec.architecture} ({spec.n_layers} layers, {experts} experts, top-{spec.top_k})",
        parameters=total,
        largest_unit=max(units.values(), default=0),
        root=total - sum(units.values()),
        dtype=spec.dtype,
        layers=spec.n_layers,
        hidden=hidden,
        q_width=q_width,
        kv_width=kv_width,
        heads=heads,
        dense_width=int(c.get("intermediate_size") or 0),
        dense_layers=spec.n_layers - moe_layers,
        expert_width=expert_width,
        experts=experts,
        top_k=spec.top_k,
        shared_width=shared,
        vocab=int(c.get("vocab_size", 0)),
    )


def activation_bytes(facts: ModelFacts, batch: int, seq: int, element: int | None = None) -> int:
    """What autograd keeps for one forward of a [batch, seq] rank batch, in bytes.

    Per token and decoder layer: the norms' inputs and outputs and the residuals (6 x hidden), q, k, v and their
    rotary copies and the attention output (2 x q + 4 x kv widths... see below), eager attention's scores and
    probabilities (2 x heads x seq), and the MLP: a dense one's gate, up, activation and product (4 x width), or the
    router's logits and probabilities (float32) and, for each of the top-k experts, the token's input, gate, up,
    activation, product and output (2 x hidden + 4 x expert width), plus the shared experts. At the head: the
    logits in the compute dtype and three float32 copies (upcast, temperature, log-softmax) per vocabulary entry.
    `element`: the compute dtype's bytes (default: the model's dtype)."""
    b = element or DTYPE_BYTES[facts.dtype]
    h = facts.hidden
    attention = 6 * h + 3 * facts.q_width + 4 * facts.kv_width + 2 * facts.heads * seq
    dense = 4 * facts.dense_width
    moe = facts.top_k * (2 * h + 4 * facts.expert_width) + 4 * facts.shared_width
    router = 2 * facts.experts * 4 // b  # float32
    moe_layers = facts.layers - facts.dense_layers
    per_token = facts.layers * attention + facts.dense_layers * dense + moe_layers * (moe + router)
    head = facts.vocab + 3 * facts.vocab * 4 // b
    return batch * seq * (per_token + head + 2 * h) * b


def process_memory(
    facts: ModelFacts,
    nproc: int,
    world_size: int,
    batch: int,
    seq: int,
    *,
    sharded: bool,
    device: str,
    configs: int = 1,
    dtypes: StepDtypes | None = None,
) -> ProcessMemory:
    """One of `nproc` replay processes' memory (see the module docstring); `dtypes`: the precision that runs
    (default: the model's own dtype throughout)."""
    d = dtypes or step_dtypes(facts.dtype, None)
    ranks = math.ceil(world_size / nproc)
    copies = configs + (1 if ranks > 1 else 0)
    params = facts.parameters * d.compute
    grads = facts.parameters * d.reduce * copies
    held = facts.parameters * d.reduce * (copies - 1)
    gathered = 0
    if sharded:
        shard_grad = max(d.master, d.reduce)
        # this process's shards and the root's own parameters (gathered for the whole step); every other unit is
        # resharded after its forward, so none is gathered when the activations peak (the forward's end)
        params = math.ceil(facts.parameters * d.master / nproc) + facts.root * d.compute
        # the sharded sums and the root's unsharded gradient (reduce-scattered last)
        grads = math.ceil(facts.parameters * shard_grad * copies / nproc) + facts.root * d.compute
        held = math.ceil(facts.parameters * shard_grad * (copies - 1) / nproc)
        # in the backward, three units' worth at once: the unit computing, its unsharded gradient, and the flat
        # buffer FSDP2 gathers the unit into before copying it out (or reduce-scatters the gradient from, in the
        # reduce dtype); no unit is prefetched (`replay.model_build`)
        gathered = facts.largest_unit * (2 * d.compute + max(d.compute, d.reduce))
        loading = params
    else:
        loading = 2 * facts.parameters * d.master  # built and filled in the master dtype, then cast
    runtime = CUDA_CONTEXT_BYTES if device == "cuda" else RUNTIME_CPU_BYTES
    activations = activation_bytes(facts, batch, seq, d.compute)
    return ProcessMemory(params, grads, activations, runtime, loading, held, gathered)
