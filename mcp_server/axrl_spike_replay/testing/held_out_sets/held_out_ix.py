"""The fault matrix's `held_out_ix` cases: faults of `capture.fault_injection.held_out_ix_faults`, a ninth held-out set
(six kinds no earlier provenance uses: in the tokens, the rewards, the engine log-probs, and three in what the
trainer does with a clean input: its loss scale, its accumulation divisor and its training forward's tokens), written
and committed before any diagnosis was run on them: tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one case with
two faults on two ranks.
"""

from __future__ import annotations

from functools import partial

from axrl_spike_replay.capture.reference.presets import LAST, FaultSpec
from axrl_spike_replay.testing.matrix_case import held_out_case

_ix = partial(held_out_case, "held_out_ix")

HELD_OUT_IX = (
    _ix(
        "tokens_double_bos",
        "mask_misalignment",
        "peaked",
        FaultSpec("tokens_double_bos", ranks=LAST),
        model="tiny_moe",
    ),
    _ix(
        "qwen2_moe_tokens_double_bos",
        "mask_misalignment",
        "peaked",
        FaultSpec("tokens_double_bos", ranks=(0,)),
        model="qwen2_moe",
    ),
    _ix(
        "reward_length_penalty_per_token_ws4",
        "outlier_advantage",
        "reinforce_baseline",
        FaultSpec("reward_length_penalty_per_token", ranks=(2,)),
        model="tiny_moe",
        world_size=4,
    ),
    _ix(
        "qwen2_moe_reward_length_penalty_per_token",
        "outlier_advantage",
        "reinforce_baseline",
        FaultSpec("reward_length_penalty_per_token", ranks=LAST),
        model="qwen2_moe",
    ),
    _ix(
        "olmoe_rollout_logprobs_sample_major",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_sample_major", ranks=(0,)),
        model="olmoe",
    ),
    _ix(
        "qwen2_moe_rollout_logprobs_sample_major",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_sample_major", ranks=LAST),
        model="qwen2_moe",
    ),
    _ix(
        "loss_scale_not_removed_ws4",
        "step_not_reproduced",
        "peaked",
        FaultSpec("loss_scale_not_removed", ranks=(1,)),
        model="tiny_moe",
        world_size=4,
    ),
    _ix(
        "olmoe_loss_scale_not_removed",
        "step_not_reproduced",
        "peaked",
        FaultSpec("loss_scale_not_removed", ranks=(0,)),
        model="olmoe",
    ),
    _ix(
        "grad_accumulation_off_by_one",
        "non_finite",
        "peaked",
        FaultSpec("grad_accumulation_off_by_one", ranks=LAST),
        model="tiny_moe",
    ),
    _ix(
        "grad_accumulation_off_by_one_ws4",
        "non_finite",
        "peaked",
        FaultSpec("grad_accumulation_off_by_one", ranks=(3,)),
        model="tiny_moe",
        world_size=4,
    ),
    _ix(
        "train_forward_double_bos",
        "step_not_reproduced",
        "peaked",
        FaultSpec("train_forward_double_bos", ranks=(0,)),
        model="tiny_moe",
    ),
    _ix(
        "qwen2_moe_train_forward_double_bos",
        "step_not_reproduced",
        "peaked",
        FaultSpec("train_forward_double_bos", ranks=LAST),
        model="qwen2_moe",
    ),
    _ix(
        "double_bos_forward_and_loss_scale_not_removed_ws4",
        "step_not_reproduced",
        "peaked",
        FaultSpec("train_forward_double_bos", ranks=(0,)),
        FaultSpec("loss_scale_not_removed", ranks=(3,)),
        model="tiny_moe",
        world_size=4,
    ),
)
