"""The names of the replay-only mitigations, importable without torch (tool schemas, help, skills).

`replay/mitigations.py` holds the registry behind these names; a test keeps the two in step.
"""

from __future__ import annotations

MITIGATION_NAMES = (
    "mismatch_token_clip_max",
    "ratio_outlier_mask",
    "advantage_clip",
    "log_ratio_clip",
    "loss_agg_mode",
    "is_base_logprobs",
    "clip_eps_low",
    "clip_eps_high",
    "dual_clip_c",
    "kl_coef",
    "entropy_coef",
    "aux_loss_coef",
    "z_loss_coef",
    "routing_replay",
    "current_routing_layers",
    "balance_negative_advantages",
    "initial_model",
)
