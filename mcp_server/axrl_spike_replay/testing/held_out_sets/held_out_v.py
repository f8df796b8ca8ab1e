"""The fault matrix's `held_out_v` cases: faults of `capture.fault_injection.held_out_v_faults`, a fifth held-out set
(eight kinds no earlier provenance uses, three of them in the trainer's loss), written and committed before any
diagnosis was run on them: tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one case with two faults on two ranks.
"""

from __future__ import annotations

from functools import partial

from axrl_spike_replay.capture.reference.presets import LAST, FaultSpec
from axrl_spike_replay.testing.matrix_case import held_out_case

_v = partial(held_out_case, "held_out_v")

HELD_OUT_V = (
    _v(
        "ratio_against_reference",
        "step_not_reproduced",
        "peaked",
        FaultSpec("ratio_against_reference", ranks=LAST),
        model="tiny_moe",
    ),
    _v(
        "qwen2_moe_ratio_against_reference_ws4",
        "step_not_reproduced",
        "peaked",
        FaultSpec("ratio_against_reference", ranks=(1,)),
        model="qwen2_moe",
        world_size=4,
    ),
    _v(
        "qwen2_moe_loss_label_shift",
        "step_not_reproduced",
        "peaked",
        FaultSpec("loss_label_shift", ranks=(0,)),
        model="qwen2_moe",
    ),
    _v(
        "loss_mask_not_applied",
        "step_not_reproduced",
        "peaked",
        FaultSpec("loss_mask_not_applied", ranks=LAST),
        model="tiny_moe",
    ),
    _v(
        "advantage_divided_by_variance",
        "outlier_advantage",
        "peaked",
        FaultSpec("advantage_divided_by_variance", ranks=LAST),
        model="tiny_moe",
    ),
    _v(
        "olmoe_advantage_divided_by_variance",
        "outlier_advantage",
        "peaked",
        FaultSpec("advantage_divided_by_variance", ranks=(0,)),
        model="olmoe",
    ),
    _v(
        "routes_previous_step_ws4",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_previous_step", ranks=(2,)),
        model="tiny_moe",
        world_size=4,
    ),
    _v(
        "qwen2_moe_routes_one_layer_broadcast",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_one_layer_broadcast", ranks=LAST),
        model="qwen2_moe",
    ),
    _v(
        "olmoe_routes_previous_step",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_previous_step", ranks=LAST),
        model="olmoe",
    ),
    _v(
        "qwen2_moe_rollout_logprobs_previous_step",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_previous_step", ranks=LAST),
        model="qwen2_moe",
    ),
    _v(
        "olmoe_ref_logprobs_are_nll",
        "bad_ref_logprobs",
        "peaked_kl",
        FaultSpec("ref_logprobs_are_nll", ranks=LAST),
        model="olmoe",
    ),
    _v(
        "label_shift_and_mask_not_applied_ws4",
        "step_not_reproduced",
        "peaked",
        FaultSpec("loss_label_shift", ranks=(0,)),
        FaultSpec("loss_mask_not_applied", ranks=(3,)),
        model="tiny_moe",
        world_size=4,
    ),
)
