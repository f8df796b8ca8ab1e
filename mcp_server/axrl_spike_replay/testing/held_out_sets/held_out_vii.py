"""The fault matrix's `held_out_vii` cases: faults of `capture.fault_injection.held_out_vii_faults`, a seventh held-out
set (eight kinds no earlier provenance uses: in the old and reference log-probs, the REINFORCE baseline, the routing
payload, the loss mask, and two in what the trainer does with a clean input: its clipping and its routing replay),
written and committed before any diagnosis was run on them: tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one
case with two faults on two ranks.
"""

from __future__ import annotations

from functools import partial

from axrl_spike_replay.capture.reference.presets import LAST, FaultSpec
from axrl_spike_replay.testing.matrix_case import held_out_case

_vii = partial(held_out_case, "held_out_vii")

HELD_OUT_VII = (
    _vii(
        "old_logprobs_last_position_logits",
        "stale_old_logprobs",
        "peaked",
        FaultSpec("old_logprobs_last_position_logits", ranks=(0,)),
        model="tiny_moe",
    ),
    _vii(
        "old_logprobs_labels_not_shifted",
        "stale_old_logprobs",
        "peaked",
        FaultSpec("old_logprobs_labels_not_shifted", ranks=LAST),
        model="tiny_moe",
    ),
    _vii(
        "ref_logprobs_final_norm_skipped_ws4",
        "bad_ref_logprobs",
        "peaked_kl",
        FaultSpec("ref_logprobs_final_norm_skipped", ranks=(3,)),
        model="tiny_moe",
        world_size=4,
    ),
    _vii(
        "baseline_all_reduced_sum_ws4",
        "negative_advantage_dominance",
        "reinforce_baseline",
        FaultSpec("baseline_all_reduced_sum", ranks=(2,)),
        model="tiny_moe",
        world_size=4,
    ),
    _vii(
        "routes_topk_layer_axes_swapped",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_topk_layer_axes_swapped", ranks=LAST),
        model="tiny_moe",
    ),
    _vii(
        "olmoe_routes_topk_layer_axes_swapped",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_topk_layer_axes_swapped", ranks=LAST),
        model="olmoe",
    ),
    _vii(
        "qwen2_moe_loss_mask_as_token_weights",
        "mask_misalignment",
        "peaked",
        FaultSpec("loss_mask_as_token_weights", ranks=(0,)),
        model="qwen2_moe",
    ),
    _vii(
        "local_clip_coef_uncapped",
        "step_not_reproduced",
        "peaked",
        FaultSpec("local_clip_coef_uncapped", ranks=LAST, params={"max_norm": 30.0}),
        model="tiny_moe",
    ),
    _vii(
        "replay_first_expert_only",
        "step_not_reproduced",
        "expert_sensitive",
        FaultSpec("replay_first_expert_only", ranks=(0,)),
        model="tiny_moe",
    ),
    _vii(
        "olmoe_replay_first_expert_only",
        "step_not_reproduced",
        "expert_sensitive",
        FaultSpec("replay_first_expert_only", ranks=(0,)),
        model="olmoe",
    ),
    _vii(
        "local_clip_and_first_expert_replay_ws4",
        "step_not_reproduced",
        "expert_sensitive",
        FaultSpec("local_clip_coef_uncapped", ranks=(0,), params={"max_norm": 30.0}),
        FaultSpec("replay_first_expert_only", ranks=(3,)),
        model="tiny_moe",
        world_size=4,
    ),
)
