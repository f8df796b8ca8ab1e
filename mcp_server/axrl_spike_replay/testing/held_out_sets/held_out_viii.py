"""The fault matrix's `held_out_viii` cases: faults of `capture.fault_injection.held_out_viii_faults`, an eighth
held-out set (eight kinds no earlier provenance uses: in the old and engine log-probs, the routing payload, the loss
mask, the GRPO groups, and two in what the trainer does with a clean input: the old log-probs its loss reads and its
routing replay's gates), written and committed before any diagnosis was run on them: tiny_moe, qwen2_moe and olmoe,
world sizes 2 and 4, one case with two faults on two ranks.
"""

from __future__ import annotations

from functools import partial

from axrl_spike_replay.capture.reference.presets import LAST, FaultSpec
from axrl_spike_replay.testing.matrix_case import held_out_case

_viii = partial(held_out_case, "held_out_viii")

HELD_OUT_VIII = (
    _viii(
        "old_logprobs_packed_across_sequences",
        "stale_old_logprobs",
        "peaked",
        FaultSpec("old_logprobs_packed_across_sequences", ranks=LAST),
        model="tiny_moe",
    ),
    _viii(
        "qwen2_moe_old_logprobs_from_neighbour_rank",
        "stale_old_logprobs",
        "peaked",
        FaultSpec("old_logprobs_from_neighbour_rank", ranks=LAST),
        model="qwen2_moe",
    ),
    _viii(
        "rollout_logprobs_cumulative",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_cumulative", ranks=LAST),
        model="tiny_moe",
    ),
    _viii(
        "qwen2_moe_rollout_logprobs_cumulative",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_cumulative", ranks=LAST),
        model="qwen2_moe",
    ),
    _viii(
        "routes_from_neighbour_rank_ws4",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_from_neighbour_rank", ranks=(2,)),
        model="tiny_moe",
        world_size=4,
    ),
    _viii(
        "olmoe_routes_from_neighbour_rank",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_from_neighbour_rank", ranks=LAST),
        model="olmoe",
    ),
    _viii(
        "qwen2_moe_loss_mask_attention_plus_response",
        "mask_misalignment",
        "peaked",
        FaultSpec("loss_mask_attention_plus_response", ranks=(0,)),
        model="qwen2_moe",
    ),
    _viii(
        "loss_mask_attention_plus_response_ws4",
        "mask_misalignment",
        "peaked",
        FaultSpec("loss_mask_attention_plus_response", ranks=(3,)),
        model="tiny_moe",
        world_size=4,
    ),
    _viii(
        "advantage_groups_split_at_rank_boundary_ws4",
        "non_finite",
        "peaked",
        FaultSpec("advantage_groups_split_at_rank_boundary", ranks=(1,)),
        model="tiny_moe",
        world_size=4,
    ),
    _viii(
        "replay_gates_uniform",
        "step_not_reproduced",
        "expert_sensitive",
        FaultSpec("replay_gates_uniform", ranks=(0,)),
        model="tiny_moe",
    ),
    _viii(
        "olmoe_loss_old_logprobs_next_micro_batch",
        "step_not_reproduced",
        "peaked",
        FaultSpec("loss_old_logprobs_next_micro_batch", ranks=(0,)),
        model="olmoe",
    ),
    _viii(
        "uniform_gates_and_old_logprobs_next_micro_batch_ws4",
        "step_not_reproduced",
        "expert_sensitive",
        FaultSpec("replay_gates_uniform", ranks=(0,)),
        FaultSpec("loss_old_logprobs_next_micro_batch", ranks=(3,)),
        model="tiny_moe",
        world_size=4,
    ),
)
