"""The fault matrix's `held_out_vi` cases: faults of `capture.fault_injection.held_out_vi_faults`, a sixth held-out set
(eight kinds no earlier provenance uses: in the advantages, the stored log-probs, the engine's log-probs, the routing
payload and the trainer's routing replay), written and committed before any diagnosis was run on them: tiny_moe,
qwen2_moe and olmoe, world sizes 2 and 4, one case with two faults on two ranks.
"""

from __future__ import annotations

from functools import partial

from axrl_spike_replay.capture.reference.presets import LAST, FaultSpec
from axrl_spike_replay.testing.matrix_case import held_out_case

_vi = partial(held_out_case, "held_out_vi")

HELD_OUT_VI = (
    _vi(
        "advantage_mean_not_subtracted",
        "outlier_advantage",
        "peaked",
        FaultSpec("advantage_mean_not_subtracted", ranks=LAST),
        model="tiny_moe",
    ),
    _vi(
        "old_logprobs_sequence_sum",
        "stale_old_logprobs",
        "peaked",
        FaultSpec("old_logprobs_sequence_sum", ranks=LAST),
        model="tiny_moe",
    ),
    _vi(
        "qwen2_moe_ref_logprobs_are_entropy",
        "bad_ref_logprobs",
        "peaked_kl",
        FaultSpec("ref_logprobs_are_entropy", ranks=LAST),
        model="qwen2_moe",
    ),
    _vi(
        "ref_logprobs_of_argmax_ws4",
        "bad_ref_logprobs",
        "peaked_kl",
        FaultSpec("ref_logprobs_of_argmax", ranks=(3,)),
        model="tiny_moe",
        world_size=4,
    ),
    _vi(
        "qwen2_moe_rollout_logprobs_first_sequence",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_first_sequence", ranks=LAST),
        model="qwen2_moe",
    ),
    _vi(
        "routes_token_major_view_ws4",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_token_major_view", ranks=(1,)),
        model="tiny_moe",
        world_size=4,
    ),
    _vi(
        "olmoe_routes_token_major_view",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_token_major_view", ranks=LAST),
        model="olmoe",
    ),
    _vi(
        "qwen2_moe_routes_layer_off_by_one",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_layer_off_by_one", ranks=(0,)),
        model="qwen2_moe",
    ),
    _vi(
        "replay_routes_offset_by_micro_batch",
        "step_not_reproduced",
        "expert_sensitive",
        FaultSpec("replay_routes_offset_by_micro_batch", ranks=(0,)),
        model="tiny_moe",
    ),
    _vi(
        "token_major_view_and_layer_off_by_one_ws4",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_token_major_view", ranks=(0,)),
        FaultSpec("routes_layer_off_by_one", ranks=(3,)),
        model="tiny_moe",
        world_size=4,
    ),
)
