"""The newer policy objectives beside PPO's clipped surrogate, per token, as verl 0.9.1's registered policy losses
form them: GSPO's sequence-level ratio (`compute_policy_loss_gspo`), CISPO's clipped, detached importance weight on
the log-probability (`compute_policy_loss_cispo`) and SAPO's soft, temperature-gated ratio
(`compute_policy_loss_sapo`). `loss.policy_loss_mode` picks one under the axrl and verl conventions (TRL's own are
`loss.trl.loss_type` and `loss.trl.importance_sampling_level`, training/trl_convention.py).

Under `verl` the loss keeps verl's safety clamps: the token log-ratio clamped to +-20 before exp (CISPO, SAPO) and
GSPO's combined log-ratio clamped above at 10. Under `axrl` the same forms have no clamp of their own (only the
replay's `log_ratio_clip`), as the axrl PPO loss has none: on log-ratios within verl's clamps the two are the same
number. GSPO's gradient is verl's and TRL's alike (each token gets the sequence ratio's full gradient: verl's
sg[s_i] * pi / sg[pi], TRL's exp of the mean log-ratio summed over the sequence's tokens). CISPO's weight is verl's
clip to [1 - clip_eps_low, 1 + clip_eps_high]; TRL's caps it above at epsilon_high only. Checked against verl's own
functions in tests/training/test_verl_objectives.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from axrl_spike_replay.training.loss_config import LossConfig

GSPO_LOG_RATIO_MAX = 10.0  # verl clamps GSPO's combined log-ratio above at 10 (for numerical stability)


@dataclass
class ObjectiveTerms:
    """One objective's per-token policy loss and the ratio it weighs tokens by (detached, for the metrics)."""

    per_token: torch.Tensor  # [B, T] before any rollout IS weight, not yet masked
    ratio: torch.Tensor  # [B, T] the importance ratio the objective used
    clipped: torch.Tensor  # [B, T] bool: the token's weight or ratio was clipped


def objective_loss(
    mode: str,
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    safety_bound: float | None,
) -> ObjectiveTerms:
    """`mode`'s per-token loss ("gspo", "cispo" or "sapo"): `log_ratio` is log(pi / pi_base) per token (with the
    replay's `log_ratio_clip` applied), `mask` the [B, T] float loss mask; `safety_bound` verl's +-20 on the token
    log-ratio, which also turns on GSPO's clamp at 10 (convention verl), or None (axrl)."""
    low, high = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    if mode == "gspo":
        lengths = mask.sum(dim=-1).clamp(min=1.0)
        on_mask = torch.where(mask > 0, log_ratio, torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))
        seq = (on_mask * mask).sum(dim=-1) / lengths
        log_seq = logprobs - logprobs.detach() + seq.detach().unsqueeze(-1)
        if safety_bound is not None:
            log_seq = log_seq.clamp(max=GSPO_LOG_RATIO_MAX)
        ratio = log_seq.exp()
        unclipped, clipped = -adv * ratio, -adv * ratio.clamp(low, high)
        return ObjectiveTerms(torch.maximum(unclipped, clipped), ratio.detach(), (clipped > unclipped).detach())
    if safety_bound is not None:
        log_ratio = log_ratio.clamp(-safety_bound, safety_bound)
    ratio = log_ratio.exp()
    if mode == "cispo":
        weight = ratio.clamp(low, high).detach()
        return ObjectiveTerms(-weight * adv * logprobs, ratio.detach(), (ratio != weight).detach())
    if mode == "sapo":
        taus = torch.where(
            adv > 0,
            torch.as_tensor(cfg.sapo_tau_pos, dtype=adv.dtype, device=adv.device),
            torch.as_tensor(cfg.sapo_tau_neg, dtype=adv.dtype, device=adv.device),
        )
        gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
        return ObjectiveTerms(-gates * adv, ratio.detach(), torch.zeros_like(mask, dtype=torch.bool))
    raise ValueError(f"policy objective {mode!r} is not one of gspo, cispo, sapo")


def objective_aggregation(mode: str, loss_agg_mode: str) -> str:
    """The verl convention's aggregation of the policy term: verl's SAPO always takes seq-mean-token-mean, whatever
    loss_agg_mode says (its entropy and KL terms still use loss_agg_mode); every other objective takes
    loss_agg_mode. (The axrl convention's is loss_agg_mode for every objective.)"""
    return "seq-mean-token-mean" if mode == "sapo" else loss_agg_mode
