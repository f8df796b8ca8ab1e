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
- activations: what autograd keeps for one micro-batch's forward (a process runs its ranks, and a rank its
  micro-batches, one after another), from the architecture's widths and the micro-batch's tokens
  (`activation_bytes`): eager attention keeps the [T, T] scores, sdpa and flash do not; checkpointed decoder layers
  keep their inputs only, plus one layer recomputed; the head in chunks keeps one chunk's [chunk, V] tensors;
- runtime: the interpreter, torch and this package (CPU), or the CUDA context (GPU). Freed host memory is given
  back (`replay.compute.host_allocator`), so nothing is counted for what the allocator would otherwise keep;
- loading (transient): a whole replay builds the model, then fills a copy of its state from the checkpoint: twice
  the parameters, in host memory, before the step starts.

The peak is the larger of loading and the step. `benchmarks/bench_plan.py` checks it against measured peaks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
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
    attention: str = "eager"  # the attention kernel the replay runs (`models.attention_kernels`)


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
    if isinstance(spec, MegatronModelConfig):  # route 1 runs Megatron's unfused attention (`megatron_attention`)
        return dataclasses.replace(model_facts(spec.hf), attention="eager")
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
        attention="sdpa",  # the tiny model's attention is F.scaled_dot_product_attention
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
        attention=spec.attn_implementation,
    )


def layer_elements(facts: ModelFacts, seq: int, attention: str, element: int) -> tuple[int, int]:
    """(a dense layer's, an MoE layer's) elements autograd keeps per token, in the compute dtype.

    Per token: the norms' inputs and outputs and the residuals (6 x hidden), q, k, v, their rotary copies and the
    attention output (3 x q + 4 x kv widths); eager attention's scores and probabilities (2 x heads x seq), where a
    fused kernel (sdpa, flash) keeps one float32 log-sum-exp per head instead; then the MLP: a dense one's gate, up,
    activation and product (4 x width), or the router's logits and probabilities (float32) and, for each of the
    top-k experts, the token's input, gate, up, activation, product and output (2 x hidden + 4 x expert width),
    plus the shared experts."""
    from axrl_spike_replay.models.attention_kernels import LINEAR_MEMORY_KERNELS

    h = facts.hidden
    scores = facts.heads * 4 // element if attention in LINEAR_MEMORY_KERNELS else 2 * facts.heads * seq
    attention_part = 6 * h + 3 * facts.q_width + 4 * facts.kv_width + scores
    moe = facts.top_k * (2 * h + 4 * facts.expert_width) + 4 * facts.shared_width + 2 * facts.experts * 4 // element
    return attention_part + 4 * facts.dense_width, attention_part + moe


def activation_bytes(
    facts: ModelFacts,
    batch: int,
    seq: int,
    element: int | None = None,
    *,
    attention: str = "eager",
    checkpointed: bool = False,
) -> int:
    """What autograd keeps for one forward of a [batch, seq] micro-batch, in bytes, at its peak.

    Each decoder layer keeps `layer_elements` per token; a checkpointed one (`models.layer_checkpoint`) keeps only
    its input (hidden), and the backward holds one layer's full activations again while it recomputes it. Eager
    attention also builds one [batch, 1, seq, seq] additive mask in the compute dtype (a fused kernel: a boolean
    one at most). The head runs in chunks (`models.chunked_head`): per token the final norm's input and output
    (2 x hidden) and two float32 numbers (log-sum-exp, entropy); one chunk's [chunk, vocab] float32 tensors
    (`CHUNK_COPIES` of them) at a time. `element`: the compute dtype's bytes (default: the model's dtype)."""
    from axrl_spike_replay.models.attention_kernels import LINEAR_MEMORY_KERNELS
    from axrl_spike_replay.models.chunked_head import CHUNK_COPIES, chunk_tokens

    b = element or DTYPE_BYTES[facts.dtype]
    dense, moe = layer_elements(facts, seq, attention, b)
    moe_layers = facts.layers - facts.dense_layers
    if checkpointed:
        largest = moe if moe_layers else dense
        layers = facts.layers * facts.hidden + largest
    else:
        layers = facts.dense_layers * dense + moe_layers * moe
    head = 2 * facts.hidden + 2 * 4 // b
    tokens = batch * seq
    mask = batch * seq * seq * (1 if attention in LINEAR_MEMORY_KERNELS else b)
    chunk = min(chunk_tokens(facts.vocab), tokens) * facts.vocab * 4 * CHUNK_COPIES
    return tokens * (layers + head) * b + mask + chunk


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
    attention: str | None = None,
    checkpointed: bool = False,
    micro_batches: int = 1,
) -> ProcessMemory:
    """One of `nproc` replay processes' memory (see the module docstring) for a [batch, seq] micro-batch;
    `dtypes`: the precision that runs (default: the model's own dtype throughout); `attention`: the kernel (default:
    the model's);
    `checkpointed`: decoder layers recompute their activations in the backward; `micro_batches`: the most a rank is
    split into (a whole process keeps a rank's own gradient beside the sum while its micro-batches add up, for the
    rank's per-parameter norms: one more copy)."""
    d = dtypes or step_dtypes(facts.dtype, None)
    ranks = math.ceil(world_size / nproc)
    copies = configs + (1 if ranks > 1 else 0) + (1 if micro_batches > 1 and not sharded else 0)
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
        # reduce dtype); no unit is prefetched (`replay.compute.model_build`)
        gathered = facts.largest_unit * (2 * d.compute + max(d.compute, d.reduce))
        loading = params
    else:
        loading = 2 * facts.parameters * d.master  # built and filled in the master dtype, then cast
    runtime = CUDA_CONTEXT_BYTES if device == "cuda" else RUNTIME_CPU_BYTES
    kernel = attention or facts.attention
    activations = activation_bytes(facts, batch, seq, d.compute, attention=kernel, checkpointed=checkpointed)
    return ProcessMemory(params, grads, activations, runtime, loading, held, gathered)
