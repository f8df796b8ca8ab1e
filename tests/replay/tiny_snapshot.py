"""Tiny spike snapshots for the replay tests, recorded with the trainer's own step functions.

One process builds the seeded policy, makes each rank's batch (a few samples carry a rollout-logprob
mismatch: the burst), computes every rank's gradients with `training.rank_step` (summed, then divided
by the world size as `reduce_gradients` does) and writes the snapshot with `write_snapshot`, which
takes every rank's payload from a single process. Under `loss.normalization: global` every rank
normalises by the step's counts, summed over the ranks' batches as the trainer's all-reduce sums
them, and records them in its grad info as the trainer does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from axrl_spike_replay.capture.snapshot_writer import RankPayload, write_snapshot
from axrl_spike_replay.models.tiny_moe import RoutingControl, TinyMoEConfig, TinyMoEPolicy, token_logprobs
from axrl_spike_replay.snapshot.metadata import AxrlMetadata, DetectorSpec, ParallelLayout
from axrl_spike_replay.training.loss_normalization import GRAD_INFO_KEY, GlobalCounts
from axrl_spike_replay.training.policy_loss import LossConfig, local_counts
from axrl_spike_replay.training.rank_step import (
    global_grad_norm,
    param_grad_norms,
    rank_forward_backward,
    reduce_gradients,
)
from axrl_spike_replay.training.routing_replay import RoutingConfig, routing_control
from axrl_spike_replay.training.sample_masks import SampleFilter, filtered_batch

MODEL = TinyMoEConfig(vocab_size=16, d_model=16, n_layers=2, n_heads=2, d_ff=32, n_experts=4, top_k=2, max_seq_len=16)
LOSS = {"kl_coef": 0.01, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "is_base_logprobs": "rollout"}
SPIKE_RATIO = 8.0
BURST = ((0, 1), (1, 2))  # (rank, sample) pairs whose rollout logprobs are wrong


@dataclass
class TinySpec:
    root: str
    world_size: int
    batch: int = 6
    seq: int = 12
    prompt: int = 4
    legacy: bool = False
    routing: bool = True
    seed: int = 0
    burst: bool = True  # the rollout-logprob mismatch on BURST's samples
    advantage_outlier: tuple[int, int, float] | None = None  # (rank, sample, scale): one mis-scaled advantage
    # (prompt lengths, response lengths) per sample: prompts left-padded to `prompt`, responses right-padded to
    # `seq - prompt` with token 0, an `attention_mask`, and no route at padding (-1), as RL trainers batch them
    lengths: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # `lengths` for each rank in turn (instead of one for all): ranks with different loss token counts
    rank_lengths: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None = None
    loss: dict[str, Any] | None = None  # the run config's loss section (default LOSS)


def run_config(world_size: int, routing: bool = True, loss: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run config a tiny snapshot is recorded with."""
    return {
        "model": MODEL.to_dict(),
        "loss": dict(LOSS if loss is None else loss),
        "routing": RoutingConfig(replay="all" if routing else "off").to_dict(),
        "parallel": {"world_size": world_size, "tp": 1, "pp": 1, "dp": world_size, "ep": 1, "etp": 1, "cp": 1},
        "train": {"seed": 0, "preset": "tiny"},
        "detector": {"kind": "median_ratio", "window": 10, "threshold": 5.0, "warmup": 4},
    }


def make_batch(model: TinyMoEPolicy, spec: TinySpec, rank: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rank `rank`'s batch and recorded routes (a bf16 engine forward), with the burst samples' mismatch."""
    gen = torch.Generator().manual_seed(1000 + 17 * rank + spec.seed)
    b, t = spec.batch, spec.seq
    tokens = torch.randint(0, MODEL.vocab_size, (b, t), generator=gen)
    mask = torch.zeros(b, t)
    mask[:, spec.prompt :] = 1.0
    mask[0, -2:] = 0.0  # one shorter response
    attention = None
    lengths = spec.rank_lengths[rank] if spec.rank_lengths is not None else spec.lengths
    if lengths is not None:
        attention = torch.zeros(b, t, dtype=torch.long)
        for sample, (p, r) in enumerate(zip(*lengths, strict=True)):
            attention[sample, spec.prompt - p : spec.prompt + r] = 1
        tokens = tokens * attention
        mask = attention.float()
        mask[:, : spec.prompt] = 0.0
    engine = TinyMoEPolicy(MODEL)
    engine.load_state_dict(model.state_dict())
    engine = engine.to(torch.bfloat16)
    with torch.no_grad():
        out = engine(tokens)
        rollout = token_logprobs(out.logits, tokens).float()
        routes = out.routes if attention is None else out.routes.masked_fill(attention[:, :, None, None] == 0, -1)
        old = token_logprobs(model(tokens, RoutingControl(routes=routes.long())).logits, tokens)
    rewards = torch.rand(b, generator=gen)
    advantages = rewards - rewards.mean()
    for burst_rank, sample in BURST if spec.burst else ():
        if burst_rank == rank:
            rollout[sample] = rollout[sample] - 3.0 * mask[sample]
            advantages[sample] = -2.0
    if spec.advantage_outlier is not None and spec.advantage_outlier[0] == rank:
        advantages[spec.advantage_outlier[1]] *= spec.advantage_outlier[2]
    batch = {
        "tokens": tokens,
        "loss_mask": mask,
        "advantages": advantages,
        "old_logprobs": old,
        "ref_logprobs": old - 0.05 * torch.rand(b, t, generator=gen),
        "rollout_logprobs": rollout,
        "rewards": rewards,
        "group_index": torch.arange(b) // 3 + rank * (b // 3),
    }
    if attention is not None:
        batch["attention_mask"] = attention
    return batch, routes.to(torch.int32)


def record_tiny_snapshot(root: Path, world_size: int = 2, **kwargs: Any) -> Path:
    """Record a tiny spike snapshot under `root`; its `iter_*` dir.

    The median is the grad norm / SPIKE_RATIO, or, for an `advantage_outlier` snapshot, the grad norm of the
    same batches without the outlier (the healthy step), so its spike ratio is what the outlier does."""
    spec = TinySpec(root=str(root), world_size=world_size, **kwargs)
    torch.manual_seed(spec.seed)
    model = TinyMoEPolicy(MODEL)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = run_config(world_size, spec.routing, spec.loss)
    payloads, local_norms, losses, grad_norm, counts = _record_grads(model, spec, cfg)
    median = grad_norm / SPIKE_RATIO
    if spec.advantage_outlier is not None:
        model.load_state_dict(state)
        healthy = TinySpec(**{**spec.__dict__, "advantage_outlier": None})
        median = _record_grads(model, healthy, cfg)[3]
    meta = AxrlMetadata(
        job_name="tiny-job",
        role="actor",
        iteration=7,
        grad_norm=grad_norm,
        median_norm=median,
        spike_ratio=grad_norm / median,
        detector=DetectorSpec(kind="median_ratio", window=10, threshold=5.0),
        parallel=ParallelLayout(world_size=world_size, dp=world_size),
    )
    grad_info: dict[str, Any] = {"grad_norm": grad_norm}
    if counts is not None:  # what a replay, at any layout, normalises every rank by
        grad_info[GRAD_INFO_KEY] = counts.to_doc()
    ranks = {
        rank: RankPayload(
            batch=batch,
            grad_info={**grad_info, "param_grad_norms": local_norms[rank], "loss": losses[rank]},
            routing_payload={"routed_experts": routes, "moe_layers": list(MODEL.moe_layer_ids), "source": "rollout"}
            if spec.routing
            else None,
        )
        for rank, (batch, routes, _) in payloads.items()
    }
    return write_snapshot(root, meta, cfg, state, ranks, legacy_layout=spec.legacy)


def step_grad_norm(
    loss_config: LossConfig,
    counts: GlobalCounts | None = None,
    samples: SampleFilter | None = None,
    world_size: int = 2,
    **kwargs: Any,
) -> float:
    """The global grad norm the trainer's step functions give on the batches `record_tiny_snapshot(root, world_size,
    **kwargs)` records, under `loss_config` and with `samples`' samples left out of it. Under normalization global
    every rank normalises by `counts`, or, without them, by the step's counts taken from those batches."""
    spec = TinySpec(root="", world_size=world_size, **kwargs)
    torch.manual_seed(spec.seed)
    model = TinyMoEPolicy(MODEL)
    cfg = run_config(world_size, spec.routing, spec.loss)
    return _record_grads(model, spec, cfg, loss_config, counts, samples)[3]


def _record_grads(
    model: TinyMoEPolicy,
    spec: TinySpec,
    cfg: dict[str, Any],
    loss: LossConfig | None = None,
    counts: GlobalCounts | None = None,
    samples: SampleFilter | None = None,
) -> tuple[Any, Any, Any, float, GlobalCounts | None]:
    """Every rank's batch, local grad norms and loss, the global grad norm and the step's counts (normalization
    global), as the trainer computes them; `loss`, `counts` and `samples` stand in for the recorded ones."""
    world_size = spec.world_size
    loss_cfg = loss if loss is not None else LossConfig.from_dict(cfg["loss"])
    batches = {rank: make_batch(model, spec, rank) for rank in range(world_size)}
    inputs = {rank: filtered_batch(batch, rank, samples or SampleFilter()) for rank, (batch, _) in batches.items()}
    if counts is None and loss_cfg.normalization == "global":  # the trainer all-reduces each rank's counts
        local = [local_counts(batch, loss_cfg) for batch in inputs.values()]
        counts = GlobalCounts(world_size, sum(t for t, _ in local), sum(s for _, s in local))
    payloads, local_norms, losses = {}, {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rank, (batch, routes) in batches.items():
            model.zero_grad(set_to_none=True)
            routing = routing_control(RoutingConfig.from_dict(cfg["routing"]), batch, routes)
            out = rank_forward_backward(model, inputs[rank], loss_cfg, routing, counts=counts)
            local_norms[rank] = param_grad_norms(model)
            losses[rank] = float(out.loss.detach())
            payloads[rank] = (batch, routes, [p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(payload[2][i] for payload in payloads.values())
        reduce_gradients(model, world_size)
        grad_norm = global_grad_norm(model)
    finally:
        torch.set_num_threads(threads)
    return payloads, local_norms, losses, grad_norm, counts


def split_into_micro_batches(snapshot: Path, splits: dict[int, list[int]]) -> None:
    """Rewrite each listed rank's batch file as the trainer's micro-batches (`{"micro_batches": [...]}`), cut in
    order into `splits[rank]` sequences each."""
    for rank, sizes in splits.items():
        path = snapshot / f"batch_rank{rank}.pt"
        batch = torch.load(path, weights_only=True)
        parts, start = [], 0
        for size in sizes:
            parts.append({k: v[start : start + size] for k, v in batch.items()})
            start += size
        torch.save({"micro_batches": parts}, path)
