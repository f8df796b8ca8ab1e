"""Every stored signal against a forward at the snapshot's weights, per rank, and the step's gradient by loss term
(`experiment.step_evidence` has the definitions). One load of the model, in this process (CPU or one GPU):

- signals: per saved rank, one no-grad forward under the run's routing (the current log-probs), one under the
  model's own routing when the run replays routes, and one per MoE layer with that layer on its own routing and
  the recorded routes replayed in the others (so each layer is judged on its own);
- channel: per saved rank, micro-batch by micro-batch as the trainer split its step (one micro-batch's graph at a
  time, the layers checkpointed where the plan says), one forward and one backward per loss term (the term's loss
  in the run's own convention: `training.policy_loss` with the other terms' coefficients at 0, the KL and entropy
  terms as the difference to the policy-only loss, the router losses as the trainer adds them; each micro-batch's
  scaled as the trainer scaled it, so a rank's term is their sum), summed over ranks and divided by the saved world
  size as the trainer reduces; then the same again to take each rank's term against the reduced gradient (memory:
  up to three copies of the gradient per term, never one per rank).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from axrl_spike_replay.experiment.mitigation.mitigations import AppliedConfig
from axrl_spike_replay.experiment.step_evidence import (
    LayerRoutes,
    LossChannel,
    PairFigures,
    RankSignals,
    SignalCheck,
    TermFigures,
    TermRank,
)
from axrl_spike_replay.models.policy import policy_forward, routing_shape
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.processes.rank_processes import check_cancel
from axrl_spike_replay.replay.analyses.rank_micro_batches import micro_forwards, micro_loss, rank_forward
from axrl_spike_replay.replay.compute.model_build import Placement
from axrl_spike_replay.replay.compute.process_inputs import RankInputs, config_loss, step_counts
from axrl_spike_replay.replay.compute.worker import build_model
from axrl_spike_replay.replay.reading.inputs import ReplayInputs
from axrl_spike_replay.replay.reading.route_check import check_route_shapes, check_route_values
from axrl_spike_replay.snapshot.rank_data import load_rank_routes
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.micro_batches import MicroBatch
from axrl_spike_replay.training.policy_loss import LossOutput, policy_loss

LN2 = math.log(2.0)
MAX_ROUTE_LAYERS = 64  # one forward per MoE layer and rank
GRAM_BYTES = 512 * 2**20  # every rank's gradient kept (float64) for the per-parameter dots up to this
TOP_TOKENS = 5


def whole_evidence(
    inputs: ReplayInputs,
    cfg: AppliedConfig,
    device: str,
    channel: bool,
    cancel: threading.Event | None = None,
    checkpoint: bool = False,
) -> tuple[SignalCheck, LossChannel | None]:
    """The signal check (and, with `channel`, the loss-term channel) with the whole model in this process
    (`replay.analyses.step_evidence_run.step_evidence` is the entry that decides whole or sharded)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        placement = Placement(checkpoint_layers=checkpoint)
        model = build_model(inputs.model, cfg.weights or inputs.replay_dir, device, placement)
        ranks = RankInputs(inputs.replay_dir, range(inputs.world_size), device, routing_shape(inputs.model))
        signals = signal_check(model, ranks, inputs, cfg, cancel)
        check_cancel(cancel, "diagnosis")
        terms = loss_channel(model, ranks, inputs, cfg, cancel) if channel else None
    finally:
        torch.set_num_threads(threads)
    return signals, terms


# ---- signals ----


def _pair(name: str, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> PairFigures:
    """a - b on the mask's tokens (non-finite differences left out: the non-finite family reports them)."""
    d = (a.double() - b.double()).cpu()
    on = mask.cpu() & torch.isfinite(d)
    values = d[on]
    n = int(values.numel())
    per_abs = torch.where(on, d.abs(), torch.zeros_like(d))
    counts = on.sum(dim=-1)
    means = (per_abs.sum(dim=-1) / counts.clamp(min=1)).tolist()
    peaks = per_abs.amax(dim=-1).tolist()
    has = counts.tolist()
    return PairFigures(
        pair=name,
        tokens=n,
        mean_abs=float(values.abs().mean()) if n else 0.0,
        max_abs=float(values.abs().max()) if n else 0.0,
        outside=float((values.abs() > LN2).double().mean()) if n else 0.0,
        mean=float(values.mean()) if n else 0.0,
        zeros=int((on & (b.cpu() == 0) & (a.double().cpu().abs() > LN2)).sum()),
        samples_mean_abs=[m if c else None for m, c in zip(means, has, strict=True)],
        samples_max_abs=[p if c else None for p, c in zip(peaks, has, strict=True)],
    )


def _samples_mean(values: torch.Tensor, mask: torch.Tensor) -> list[float | None]:
    """Per sample, the mean of `values` over its finite loss tokens (None: none)."""
    v = values.double().cpu()
    on = mask.cpu() & torch.isfinite(v)
    counts = on.sum(dim=-1).tolist()
    sums = torch.where(on, v, torch.zeros_like(v)).sum(dim=-1).tolist()
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)]


def _tails(batch: dict[str, torch.Tensor]) -> list[int]:
    """Per sample, the tokens after its last loss token that hold a stored rollout log-prob (finite, not a 0 fill)
    and are attended: what the engine generated and the loss mask stops short of ([] without rollout log-probs)."""
    stored = batch.get("rollout_logprobs")
    if stored is None:
        return []
    mask = (batch["loss_mask"] > 0).cpu()
    positions = torch.arange(mask.shape[-1]).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=-1, keepdim=True)
    value = stored.detach().cpu()
    generated = torch.isfinite(value) & (value != 0)
    if "attention_mask" in batch:
        generated &= batch["attention_mask"].cpu() > 0
    after = (positions > last) & (last >= 0)
    return [int(n) for n in (generated & after).sum(dim=-1).tolist()]


def _rank_pairs(
    batch: dict[str, torch.Tensor], current: torch.Tensor, own: torch.Tensor | None
) -> dict[str, PairFigures]:
    mask = batch["loss_mask"] > 0
    stored = {s: batch[f"{s}_logprobs"].float() for s in ("old", "rollout", "ref") if f"{s}_logprobs" in batch}
    pairs = {}
    for name, value in stored.items():
        pairs[f"current_vs_{name}"] = _pair(f"current_vs_{name}", current, value, mask)
        if own is not None:
            pairs[f"own_vs_{name}"] = _pair(f"own_vs_{name}", own, value, mask)
    if "old" in stored and "rollout" in stored:
        pairs["old_vs_rollout"] = _pair("old_vs_rollout", stored["old"], stored["rollout"], mask)
    return pairs


def _rank_routes(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], ranks: RankInputs, rank: int
) -> list[LayerRoutes]:
    """Per MoE layer: the model's own routing there (recorded routes elsewhere) against the recorded routes, which
    are held to the model first (replayed in the other layers, an id past its experts would fail inside a kernel)."""
    payload = load_rank_routes(ranks.replay_dir, rank, batch=batch)
    if payload is None:
        return []
    check_route_shapes(payload, ranks.shape, tuple(batch["tokens"].shape))
    check_route_values(payload, ranks.shape)
    recorded = payload.routed_experts.long().to(batch["tokens"].device)
    loss = batch["loss_mask"] > 0
    attended = batch["attention_mask"] > 0 if "attention_mask" in batch else torch.ones_like(loss)
    out = []
    for i, layer in enumerate(payload.moe_layers[:MAX_ROUTE_LAYERS]):
        control = RoutingControl(routes=recorded, current_layers=frozenset({layer}))
        chosen = policy_forward(model, batch, control, need_entropy=False).routes[:, :, i, :]
        have = (recorded[:, :, i, :] >= 0).all(dim=-1) & attended
        differ = (chosen.sort(dim=-1).values != recorded[:, :, i, :].sort(dim=-1).values).any(dim=-1)
        n_loss, n_other = int((have & loss).sum()), int((have & ~loss).sum())
        out.append(
            LayerRoutes(
                layer=int(layer),
                loss_tokens=n_loss,
                other_tokens=n_other,
                loss_disagreement=int((differ & have & loss).sum()) / n_loss if n_loss else None,
                other_disagreement=int((differ & have & ~loss).sum()) / n_other if n_other else None,
            )
        )
    return out


def signals_of_rank(
    rank: int,
    batch: dict[str, torch.Tensor],
    current: torch.Tensor,
    entropy: torch.Tensor | None,
    own: torch.Tensor | None,
) -> RankSignals:
    """A rank's signals from its replayed log-probs (and entropies) [B, T] under the run's routing, and under the
    model's own (None: the run replays no routes); its routes are the caller's to add."""
    signals = RankSignals(rank=rank, pairs=_rank_pairs(batch, current, own), samples=int(current.shape[0]))
    signals.samples_mean_logprob = _samples_mean(current, batch["loss_mask"] > 0)
    signals.samples_tail = _tails(batch)
    if entropy is not None:
        signals.samples_mean_entropy = _samples_mean(entropy, batch["loss_mask"] > 0)
    if own is not None:
        signals.samples_mean_logprob_own = _samples_mean(own, batch["loss_mask"] > 0)
    return signals


OFFSETS = (-2, -1, 1, 2)  # the token offsets a rank's batch is tried at
OFF_NATS = LN2  # a stored old or rollout log-prob signal this far from the policy (mean |Δ|) is tried at them


def moved_tokens(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] tokens moved by `k` positions: row[p] = tokens[p + k], the edge token repeated where p + k is out."""
    width = int(tokens.shape[-1])
    index = (torch.arange(width, device=tokens.device) + k).clamp(0, width - 1)
    return tokens[:, index]


def realigned(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], signals: RankSignals
) -> dict[str, dict[str, float]]:
    """Per stored log-prob signal: {offset: mean |log π - stored|} over the stored loss tokens with the rank's tokens
    moved by each of OFFSETS (`moved_tokens`), the policy under its own routing; {} where the rank's old and rollout
    log-probs already sit on the policy (none past OFF_NATS)."""
    off = [p for name, p in signals.pairs.items() if name in ("current_vs_old", "current_vs_rollout")]
    if not any(p.tokens and p.mean_abs > OFF_NATS for p in off):
        return {}
    mask = batch["loss_mask"] > 0
    stored = {s: batch[f"{s}_logprobs"] for s in ("old", "rollout", "ref") if f"{s}_logprobs" in batch}
    out: dict[str, dict[str, float]] = {s: {} for s in stored}
    for k in OFFSETS:
        if abs(k) >= int(batch["tokens"].shape[-1]):
            continue
        moved = {**batch, "tokens": moved_tokens(batch["tokens"], k)}
        policy = policy_forward(model, moved, RoutingControl(), need_entropy=False).logprobs
        for name, value in stored.items():
            figures = _pair(name, policy, value.float(), mask)
            if figures.tokens:
                out[name][f"{k:+d}"] = figures.mean_abs
    return out


def signal_check(
    model: torch.nn.Module,
    ranks: RankInputs,
    inputs: ReplayInputs,
    cfg: AppliedConfig,
    cancel: threading.Event | None = None,
) -> SignalCheck:
    """Per saved rank: the replayed log-probs against every stored one, and the recorded routes per layer."""
    replays = cfg.routing.replay != "off"
    result = SignalCheck(routing_replay=cfg.routing.replay, base=cfg.loss.is_base_logprobs, has_own=replays)
    with torch.no_grad():
        for rank, batch in ranks.batches.items():
            check_cancel(cancel, "diagnosis")
            forward = rank_forward(model, ranks, cfg, rank, True)
            own = rank_forward(model, ranks, cfg, rank, False, RoutingControl()).logprobs if replays else None
            signals = signals_of_rank(rank, batch, forward.logprobs, forward.entropy, own)
            signals.shifted = realigned(model, batch, signals)
            if rank in inputs.routing_ranks:
                signals.routes = _rank_routes(model, batch, ranks, rank)
            result.ranks.append(signals)
    return result


# ---- channel ----


def _term_configs(loss: LossConfig) -> dict[str, Any]:
    policy = dataclasses.replace(loss, kl_coef=0.0, entropy_coef=0.0, aux_loss_coef=0.0, z_loss_coef=0.0)
    out: dict[str, Any] = {"policy": policy}
    if loss.kl_coef:
        out["kl"] = dataclasses.replace(policy, kl_coef=loss.kl_coef)
    if loss.entropy_coef:
        out["entropy"] = dataclasses.replace(policy, entropy_coef=loss.entropy_coef)
    return out


def micro_terms(
    model: torch.nn.Module, ranks: RankInputs, cfg: AppliedConfig, rank: int, counts: Any
) -> Iterator[tuple[MicroBatch, dict[str, torch.Tensor], Any]]:
    """Saved rank `rank`'s loss split into its terms, one micro-batch at a time (`rank_micro_batches.micro_forwards`:
    each yielded with its forward, on its graph, dropped by the caller before the next): per micro-batch, each term
    (a scalar; `_loss`: the whole loss, as `process_inputs.config_loss` computes it) scaled as the trainer scaled the
    micro-batch, so the rank's term is their sum. The rank's own loss settings under a hypothesis; on a rank the
    config leaves out, no router term (its policy terms are masked to nothing)."""
    saved = ranks.batches[rank]
    own = cfg.loss_of(rank)
    scale = own.loss_scale if own.loss_scale is not None else 1.0
    configs = _term_configs(own)
    for mb, out in micro_forwards(model, ranks, cfg, rank, cfg.needs_entropy):
        out.logprobs.retain_grad()
        losses = {}
        for name, loss_cfg in configs.items():

            def term(view: Any, batch: dict[str, Any], loss_cfg: LossConfig = loss_cfg, name: str = name) -> LossOutput:
                entropy = view.entropy if name == "entropy" else None
                return policy_loss(view.logprobs, batch, loss_cfg, entropy=entropy, counts=counts)

            losses[name] = micro_loss(out, saved, rank, cfg, mb, term).loss
        terms = {"policy": losses["policy"]}
        for name in ("kl", "entropy"):
            if name in losses:
                terms[name] = losses[name] - losses["policy"]
        if cfg.samples.keeps_rank(rank):
            for name, coef, value in (("aux", own.aux_loss_coef, out.aux_loss), ("z", own.z_loss_coef, out.z_loss)):
                if coef and value.requires_grad:
                    terms[name] = coef * value if scale == 1.0 else coef * value * scale
        terms["_loss"] = micro_loss(
            out, saved, rank, cfg, mb, lambda view, b: config_loss(view, b, cfg, rank, counts)
        ).loss
        if mb.scale != 1.0:
            terms = {name: value * mb.scale for name, value in terms.items()}
        yield mb, terms, out


def _added(total: list[torch.Tensor] | None, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]


def _grads(
    term: torch.Tensor, params: Sequence[torch.Tensor], extra: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    got = torch.autograd.grad(term, [*params, *extra], retain_graph=True, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, got[: len(params)], strict=True)]
    return grads, list(got[len(params) :])


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return math.fsum(float((x.double() * y.double()).sum()) for x, y in zip(a, b, strict=True))


def pull_of(parts: list[torch.Tensor | None], shape: torch.Size) -> torch.Tensor:
    """|dTerm/dlogprobs| (+ |dTerm/dentropy|) per token, float64 on the CPU."""
    pull = torch.zeros(shape, dtype=torch.float64)
    for part in parts:
        if part is not None:
            pull += part.detach().double().abs().cpu()
    return pull


def loss_channel(
    model: torch.nn.Module,
    ranks: RankInputs,
    inputs: ReplayInputs,
    cfg: AppliedConfig,
    cancel: threading.Event | None = None,
) -> LossChannel:
    """The reduced gradient split by loss term, per rank (see the module doc)."""
    world = inputs.world_size
    params = [p for p in model.parameters() if p.requires_grad]
    counts = step_counts(ranks, cfg, inputs.loss, inputs.counts, world)
    sums: dict[str, list[torch.Tensor]] = {}
    norms: dict[str, dict[int, float]] = {}
    pulls: dict[str, dict[int, torch.Tensor]] = {}
    values: dict[tuple[str, int], float] = {}
    losses: list[dict[str, Any]] = []
    for rank, batch in ranks.batches.items():
        check_cancel(cancel, "diagnosis")
        size, width = (int(n) for n in batch["tokens"].shape[:2])
        own: dict[str, list[torch.Tensor]] = {}  # the rank's term gradients, summed over its micro-batches
        loss = 0.0
        for mb, terms, out in micro_terms(model, ranks, cfg, rank, counts):
            loss += float(terms.pop("_loss").detach())
            extra = [out.logprobs] + ([out.entropy] if out.entropy is not None else [])
            for name, term in terms.items():
                values[(name, rank)] = values.get((name, rank), 0.0) + float(term.detach())
                grads, wrt = _grads(term, params, extra)
                own[name] = _added(own.get(name), grads)
                pull = pulls.setdefault(name, {}).setdefault(rank, torch.zeros(size, width, dtype=torch.float64))
                pull[list(mb.rows), : mb.width] += pull_of(wrt, out.logprobs.shape)
            del terms, out
        losses.append({"rank": rank, "loss": loss})
        for name, grads in own.items():
            norms.setdefault(name, {})[rank] = math.sqrt(_dot(grads, grads)) / world
            sums[name] = _added(sums.get(name), grads)
        del own
    g = [torch.zeros_like(p) for p in params]
    for grads in sums.values():
        g = [a + b / world for a, b in zip(g, grads, strict=True)]
    g_sq = _dot(g, g)
    shares: dict[str, dict[int, float]] = {}
    full = [torch.zeros_like(p) for p in params]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    keep = len(ranks.batches) * sum(p.numel() * 8 for p in params) <= GRAM_BYTES
    kept: dict[int, list[torch.Tensor]] = {}
    rank_norms: list[dict[str, Any]] = []
    for rank in ranks.batches:  # second pass: each rank's terms against the reduced gradient
        check_cancel(cancel, "diagnosis")
        whole: list[torch.Tensor] | None = None
        for _, terms, out in micro_terms(model, ranks, cfg, rank, counts):
            for name, term in terms.items():
                if name == "_loss":
                    continue
                grads, _ = _grads(term, params, [])
                share = _dot(grads, g) / world / g_sq if g_sq > 0 else 0.0  # linear: the micro-batches' shares add
                shares.setdefault(name, {})[rank] = shares.get(name, {}).get(rank, 0.0) + share
            whole = _added(whole, _grads(terms.pop("_loss"), params, [])[0])
            del terms, out
        assert whole is not None  # every rank has a micro-batch
        full = [a + b / world for a, b in zip(full, whole, strict=True)]
        rank_norms.append(
            {"rank": rank, "norms": {n: float(w.detach().float().norm()) for n, w in zip(names, whole, strict=True)}}
        )
        if keep:
            kept[rank] = [w.detach().double().cpu() for w in whole]
        del whole
    channel = LossChannel(grad_norm=math.sqrt(g_sq), rank_losses=losses, rank_param_norms=rank_norms)
    if keep:
        channel.param_gram = param_gram(names, kept)
    coefs = {"kl": cfg.loss.kl_coef, "entropy": cfg.loss.entropy_coef, "aux": cfg.loss.aux_loss_coef}
    coefs["z"] = cfg.loss.z_loss_coef
    for name, grads in sums.items():
        term_g = [x / world for x in grads]
        channel.terms.append(
            TermFigures(
                term=name,
                coef=float(coefs.get(name, 1.0)),
                grad_norm=math.sqrt(_dot(term_g, term_g)),
                share=_dot(term_g, g) / g_sq if g_sq > 0 else 0.0,
                ranks=[TermRank(r, norms[name][r], shares[name][r], values[(name, r)]) for r in sorted(norms[name])],
                top_tokens=top_tokens(pulls.get(name, {}), {r: b["loss_mask"] for r, b in ranks.batches.items()}),
                top_samples=top_samples(pulls.get(name, {})),
            )
        )
    diff = [a - b for a, b in zip(full, g, strict=True)]  # the terms add up to the loss's own gradient
    channel.sum_rel_error = math.sqrt(_dot(diff, diff) / g_sq) if g_sq > 0 else 0.0
    return channel


def param_gram(names: Sequence[str], grads: dict[int, list[torch.Tensor]]) -> dict[str, Any]:
    """Per parameter, the W x W dots of the ranks' own gradients (float64), ranks in `grads`' order."""
    order = list(grads)
    params: dict[str, list[list[float]]] = {}
    for i, name in enumerate(names):
        flat = torch.stack([grads[r][i].reshape(-1) for r in order])
        params[name] = (flat @ flat.T).tolist()
    return {"ranks": order, "params": params}


def top_tokens(pulls: dict[int, torch.Tensor], masks: dict[int, torch.Tensor]) -> list[dict[str, Any]]:
    """The loss tokens a term pulls on hardest, over every rank (`masks`: each rank's loss mask)."""
    rows = []
    for rank, pull in pulls.items():
        mask = masks[rank].cpu() > 0
        values = torch.where(mask, pull, torch.zeros_like(pull)).reshape(-1)
        k = min(TOP_TOKENS, int((values > 0).sum()))
        if k == 0:
            continue
        top = values.topk(k)
        width = pull.shape[-1]
        for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            rows.append({"rank": rank, "sample": index // width, "position": index % width, "pull": value})
    rows.sort(key=lambda r: -r["pull"])
    return rows[:TOP_TOKENS]


def top_samples(pulls: dict[int, torch.Tensor]) -> list[dict[str, Any]]:
    """The samples with the largest shares of a term's pull over every rank."""
    total = math.fsum(float(p.sum()) for p in pulls.values())
    if total <= 0:
        return []
    rows = [
        {"rank": rank, "sample": s, "share_of_pull": float(v) / total}
        for rank, pull in pulls.items()
        for s, v in enumerate(pull.sum(dim=-1).tolist())
        if v > 0
    ]
    rows.sort(key=lambda r: -r["share_of_pull"])
    return rows[:TOP_TOKENS]
