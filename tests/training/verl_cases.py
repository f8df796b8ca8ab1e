"""The verl cross-check's settings and batches: our `verl` convention and verl 0.9.1's own functions on the
same float64 rank batches (2 DP ranks; varied response lengths, an empty response, log-ratios beyond verl's
+-20 clamp, reference log-probs beyond its k3 clamp, mixed-sign advantages). Used by test_verl_crosscheck.py
and scripts/verl_crosscheck_table.py.

verl's side is its own `ppo_loss` (workers/utils/losses.py) end to end: policy loss, entropy and KL terms
and their aggregation with the step's counts, on a TensorDict and the model's unpadded log-probs, after
`rollout_corr_helper`'s IS weights and rejection mask, as verl's trainer applies them before the actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from axrl_spike_replay.training.loss_config import LossConfig, RatioOutlierMask
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.policy_loss import local_counts, policy_loss

PROMPT, RESPONSE, BATCH, DP = 3, 9, 7, 2
GARBAGE = 1.0e3  # finite junk off the mask: it must not reach the loss (verl multiplies by the mask there)


@dataclass(frozen=True)
class Case:
    """One setting: our LossConfig fields, and verl's knobs for the same loss."""

    ours: dict[str, Any]
    mode: str = "token-mean"
    normalization: str = "global"
    clip: tuple[float, float] = (0.2, 0.2)
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    kl: tuple[str, float] | None = None  # (kl_loss_type, kl_loss_coef)
    rollout_is: tuple[str, float | str] | None = None
    rollout_rs: tuple[str, float | str] | None = None
    loss_scale_factor: float | None = None
    loss_mode: str = "vanilla"  # verl's policy_loss.loss_mode (ours: policy_loss_mode in `ours`)
    taus: tuple[float, float] = (1.0, 1.05)  # verl's SAPO tau_pos, tau_neg
    extra: dict[str, Any] = field(default_factory=dict)


def _cases() -> dict[str, Case]:
    modes = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")
    cases: dict[str, Case] = {}
    for norm in ("global", "per_rank"):
        for mode in modes:
            cases[f"{mode} {norm}"] = Case({}, mode=mode, normalization=norm)
    for est in ("k1", "k2", "k3", "low_var_kl", "k3+", "abs"):
        cases[f"kl {est}"] = Case({"kl_coef": 0.1, "kl_estimator": est}, kl=(est, 0.1))
    cases["entropy"] = Case({"entropy_coef": 0.01}, mode="seq-mean-token-mean", entropy_coeff=0.01)
    cases["dual clip c=2, clip 0.2/0.28"] = Case(
        {"dual_clip_c": 2.0, "clip_eps_high": 0.28}, clip=(0.2, 0.28), clip_ratio_c=2.0
    )
    # The +-20 log-ratio clamp shows only on a negative-advantage token past +20 whose dual clip c exceeds e^20
    # (4.9e8): there the loss is |A| e^20 with no gradient, where an unclamped ratio gives |A| e^25 and a gradient.
    # Everywhere else the PPO clip, dual clip or exp's underflow hide it.
    cases["dual clip c=1e12: the +-20 log-ratio clamp"] = Case({"dual_clip_c": 1e12}, clip_ratio_c=1e12)
    cases["token TIS 2"] = Case({"rollout_is": "token", "rollout_is_threshold": 2.0}, rollout_is=("token", 2.0))
    cases["sequence TIS 5"] = Case(
        {"rollout_is": "sequence", "rollout_is_threshold": 5.0}, rollout_is=("sequence", 5.0)
    )
    cases["token IcePop 0.5_2"] = Case(
        {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"}, rollout_is=("token", "0.5_2.0")
    )
    for option, threshold in (
        ("token_k1", 2.0),
        ("token_k2", 0.5),
        ("seq_sum_k1", "0.1_10"),
        ("seq_mean_k3", 0.5),
        ("seq_max_k2", 1.0),
        ("token_k1,seq_mean_k3", "2.0,0.5"),
        # asymmetric k1 bounds: their mirror images ([0.5, 4], [0.8, 2], [0.5, 5]) keep and drop other tokens
        ("token_k1", "0.25_2.0"),
        ("seq_mean_k1", "0.5_1.25"),
        ("seq_sum_k1", "0.2_2.0"),
    ):
        cases[f"RS {option} {threshold}"] = Case(
            {"rollout_rs": option, "rollout_rs_threshold": threshold}, rollout_rs=(option, threshold)
        )
    cases["seq-mean-token-sum-norm loss_scale_factor 64"] = Case(
        {"loss_scale_factor": 64.0}, mode="seq-mean-token-sum-norm", loss_scale_factor=64.0
    )
    cases["mismatch_token_clip_max 2 = token TIS"] = Case({"mismatch_token_clip_max": 2.0}, rollout_is=("token", 2.0))
    cases["ratio_outlier_mask token = RS token_k1"] = Case(
        {"ratio_outlier_mask": RatioOutlierMask("token", 0.5, 4.0)}, rollout_rs=("token_k1", "0.25_2.0")
    )
    # pi/pi_rollout in [0.8, 2] is pi_rollout/pi_train in [0.5, 1.25]: asymmetric, so the inversion shows
    cases["ratio_outlier_mask sequence = RS seq_mean_k1"] = Case(
        {"ratio_outlier_mask": RatioOutlierMask("sequence", 0.8, 2.0)}, rollout_rs=("seq_mean_k1", "0.5_1.25")
    )
    cases["all: seq-mean-token-mean, k3, entropy, TIS, RS"] = Case(
        {
            "kl_coef": 0.05,
            "entropy_coef": 0.01,
            "rollout_is": "token",
            "rollout_is_threshold": 2.0,
            "rollout_rs": "token_k1",
            "rollout_rs_threshold": 2.0,
        },
        mode="seq-mean-token-mean",
        entropy_coeff=0.01,
        kl=("k3", 0.05),
        rollout_is=("token", 2.0),
        rollout_rs=("token_k1", 2.0),
    )
    return cases


CASES = _cases()


def rank_batch(rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One rank's response-only tensors [B, RESPONSE] (verl's layout), float64, with `response_mask`."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    lengths = torch.tensor([9, 1, 0, 5, 9, 3, 7]) if rank == 0 else torch.tensor([4, 9, 2, 8, 6, 9, 1])
    mask = torch.arange(RESPONSE)[None, :] < lengths[:, None]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    logprobs = -randn(BATCH, RESPONSE).abs() - 0.1
    old = logprobs + 0.3 * randn(BATCH, RESPONSE)
    old[0, 2] = logprobs[0, 2] - 25.0  # a log-ratio of +25: past verl's +-20 clamp (sample 0's advantage is < 0)
    old[3, 1] = logprobs[3, 1] + 30.0
    rollout = old + 0.1 * randn(BATCH, RESPONSE)
    rollout[1, 0] = old[1, 0] - 3.0  # rollout/train mismatch outliers, outside any rejection bounds used
    rollout[4, 5] = old[4, 5] + 2.5
    # pi_rollout/pi_train of e and 1/e: between asymmetric k1 bounds and their mirror image (e.g. [0.25, 2] and
    # [0.5, 4]), so a rejection that reads the ratio the wrong way round keeps and drops other tokens
    rollout[5, 0] = old[5, 0] + 1.0
    rollout[6, 0] = old[6, 0] - 1.0
    adv = randn(BATCH, 1).expand(BATCH, RESPONSE).clone() * 2.0  # mixed signs
    adv[0] = -adv[0].abs()  # the +25 log-ratio's advantage is negative: dual-clip decides its loss
    adv[4] = 40.0  # an advantage outlier
    ref = logprobs + 0.2 * randn(BATCH, RESPONSE)
    # reference offsets past verl's k3 clamp: k3 = exp(6) - 7 = 396 and (ref - logprob clamped to -20) 19, both
    # clamped to 10, where the gradient stops
    ref[0, 3] = logprobs[0, 3] + 6.0
    ref[3, 4] = logprobs[3, 4] - 30.0
    return {
        "response_mask": mask,
        "log_probs": logprobs,
        "old_log_probs": old,
        "rollout_log_probs": rollout,
        "ref_log_prob": ref,
        "advantages": adv,
        "entropy": randn(BATCH, RESPONSE).abs(),
    }


def _ours_layout(r: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our layout: prompt columns in front (off the mask), junk wherever the mask is off."""

    def full(x: torch.Tensor) -> torch.Tensor:
        out = torch.full((BATCH, PROMPT + RESPONSE), GARBAGE, dtype=torch.float64)
        out[:, PROMPT:] = torch.where(r["response_mask"], x, torch.full_like(x, GARBAGE))
        return out

    mask = torch.zeros(BATCH, PROMPT + RESPONSE, dtype=torch.float64)
    mask[:, PROMPT:] = r["response_mask"].double()
    return {
        "loss_mask": mask,
        "old_logprobs": full(r["old_log_probs"]),
        "rollout_logprobs": full(r["rollout_log_probs"]),
        "ref_logprobs": full(r["ref_log_prob"]),
        "advantages": full(r["advantages"]),
        "logprobs": full(r["log_probs"]),
        "entropy": full(r["entropy"]),
    }


def our_config(case: Case) -> LossConfig:
    """Our config of the case: convention verl unless `ours` names another."""
    values = {"convention": "verl", "normalization": case.normalization, "loss_agg_mode": case.mode}
    return LossConfig(**{**values, "clip_eps_low": case.clip[0], "clip_eps_high": case.clip[1], **case.ours})


def ours_step(case: Case, ranks: list[dict[str, torch.Tensor]]) -> list[tuple[float, torch.Tensor]]:
    """(loss, d loss / d response logprobs) per rank, with our verl convention."""
    cfg = our_config(case)
    batches = [_ours_layout(r) for r in ranks]
    counts = None
    if case.normalization == "global":
        tokens = sum(local_counts(b, cfg)[0] for b in batches)
        sequences = sum(local_counts(b, cfg)[1] for b in batches)
        counts = GlobalCounts(DP, tokens, sequences)
    out = []
    for b in batches:
        logprobs = b.pop("logprobs").requires_grad_(True)
        entropy = b.pop("entropy")
        loss = policy_loss(logprobs, b, cfg, entropy=entropy, counts=counts).loss
        loss.backward()
        assert logprobs.grad is not None
        out.append((float(loss.detach()), logprobs.grad[:, PROMPT:].clone()))
    return out


def _response_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Each response's length: up to its last loss token (a response may start with masked tokens)."""
    columns = torch.arange(1, mask.shape[-1] + 1)
    return (mask.to(torch.long) * columns).amax(dim=-1)


def _unpadded(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`values` [B, R] as the model's unpadded output over prompt + response tokens, the way `ppo_loss` reads it
    (`no_padding_2_padding`: response token j's output at the sequence's position PROMPT - 1 + j), and where each
    response token's output lies in it: `out[positions]` is `values[on]`, `on` the [B, R] response tokens."""
    on = torch.arange(values.shape[-1]) < lengths[:, None]
    rows, cols = on.nonzero(as_tuple=True)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (PROMPT + lengths).cumsum(0)[:-1]])
    positions = starts[rows] + PROMPT - 1 + cols
    flat = torch.full((int((PROMPT + lengths).sum()),), GARBAGE, dtype=values.dtype)  # outputs ppo_loss never reads
    flat[positions] = values[on]
    return flat, positions, on


def verl_step(
    case: Case, ranks: list[dict[str, torch.Tensor]], peer: dict[str, Any]
) -> list[tuple[float, torch.Tensor]]:
    """(loss, d loss / d response logprobs) per rank, by verl 0.9.1's own `ppo_loss`.

    Each rank's batch is what the trainer hands the actor after `rollout_corr_helper`'s rollout correction (IS
    weights, rejection mask as the response mask), in a TensorDict with the counts the engine assigns
    (all-reduced loss tokens, the mini-batch's sequences, the DP size); the log-probs are the model's
    unpadded output over prompt + response tokens, which `ppo_loss` cuts back to the responses itself.
    """
    from tensordict import TensorDict
    from verl_peer import ActorConfigStandIn

    rc, losses = peer["rollout_corr"], peer["losses"]
    prepared = []
    for r in ranks:
        mask, weights = r["response_mask"], None
        log_ratio = r["old_log_probs"] - r["rollout_log_probs"]
        if case.rollout_is is not None:
            weights, _ = rc.compute_rollout_correction_weights(
                log_ratio, mask, rollout_is=case.rollout_is[0], rollout_is_threshold=case.rollout_is[1]
            )
        if case.rollout_rs is not None:
            mask, _ = rc.compute_rollout_rejection_mask(
                log_ratio, mask, rollout_rs=case.rollout_rs[0], rollout_rs_threshold=case.rollout_rs[1]
            )
        prepared.append((mask.to(torch.bool), weights))
    counts: dict[str, Any] = {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None}  # a rank alone
    if case.normalization == "global":
        counts = {
            "dp_size": DP,
            "batch_num_tokens": int(sum(int(m.sum()) for m, _ in prepared)),
            "global_batch_size": BATCH * len(ranks),
        }
    out = []
    for r, (mask, weights) in zip(ranks, prepared, strict=True):
        lengths = _response_lengths(r["response_mask"])
        attention = torch.cat([torch.ones(BATCH, PROMPT), (torch.arange(RESPONSE) < lengths[:, None]).float()], 1)
        fields = {
            "prompts": torch.ones(BATCH, PROMPT, dtype=torch.long),
            "responses": torch.ones(BATCH, RESPONSE, dtype=torch.long),
            "attention_mask": attention.long(),
            "response_mask": mask,
            "old_log_probs": r["old_log_probs"],
            "advantages": r["advantages"],
        }
        if weights is not None:
            fields["rollout_is_weights"] = weights
        if case.kl is not None:
            fields["ref_log_prob"] = r["ref_log_prob"]
        data = TensorDict(fields, batch_size=[BATCH])
        losses.tu.assign_non_tensor(data, **counts)
        log_probs, positions, on = _unpadded(r["log_probs"], lengths)
        log_probs.requires_grad_(True)
        model_output = {"log_probs": log_probs}
        if case.entropy_coeff:  # verl's engine computes the entropy only when the loss uses it
            model_output["entropy"] = _unpadded(r["entropy"], lengths)[0]
        config = ActorConfigStandIn(
            clip_low=case.clip[0],
            clip_high=case.clip[1],
            clip_ratio_c=case.clip_ratio_c,
            loss_agg_mode=case.mode,
            loss_scale_factor=case.loss_scale_factor,
            entropy_coeff=case.entropy_coeff,
            kl=case.kl,
            loss_mode=case.loss_mode,
            taus=case.taus,
        )
        loss, _ = losses.ppo_loss(config, model_output, data)
        loss.backward()
        assert log_probs.grad is not None
        grad = torch.zeros(BATCH, RESPONSE, dtype=torch.float64)  # padding has no output, so no gradient
        grad[on] = log_probs.grad[positions]
        out.append((float(loss.detach()), grad))
    return out


def compare(
    case: Case, peer: dict[str, Any], seed: int = 0, ranks: list[dict[str, torch.Tensor]] | None = None
) -> dict[str, float]:
    """Our and verl's summed-over-ranks loss, and the worst relative difference of loss and gradient (on `ranks`,
    by default `rank_batch`'s of `seed`)."""
    ranks = ranks if ranks is not None else [rank_batch(r, seed) for r in range(DP)]
    ours, theirs = ours_step(case, ranks), verl_step(case, ranks, peer)
    loss_rel = grad_rel = 0.0
    for (lo, go), (lv, gv) in zip(ours, theirs, strict=True):
        loss_rel = max(loss_rel, abs(lo - lv) / max(abs(lv), 1e-300))
        grad_rel = max(grad_rel, float((go - gv).abs().max() / gv.abs().max().clamp(min=1e-300)))
    return {
        "ours": sum(lo for lo, _ in ours),
        "verl": sum(lv for lv, _ in theirs),
        "loss_rel": loss_rel,
        "grad_rel": grad_rel,
    }
