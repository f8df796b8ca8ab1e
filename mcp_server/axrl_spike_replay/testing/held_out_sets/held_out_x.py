"""The fault matrix's `held_out_x` cases: faults of `capture.fault_injection.held_out_x_faults`, a tenth held-out set
(six kinds no earlier provenance uses: in the old log-probs, the routing payload, two in the engine's log-probs, and
two in what the trainer does with a clean input: its embedding scale and its expert-parallel index),
written and committed before any diagnosis was run on them: tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one
case with two faults on two ranks.
"""

from __future__ import annotations

from functools import partial

from axrl_spike_replay.capture.reference.presets import LAST, FaultSpec
from axrl_spike_replay.testing.matrix_case import held_out_case

_x = partial(held_out_case, "held_out_x")

HELD_OUT_X = (
    _x(
        "old_logprobs_context_parallel_unrestored",
        "stale_old_logprobs",
        "peaked",
        FaultSpec("old_logprobs_context_parallel_unrestored", ranks=LAST),
        model="tiny_moe",
    ),
    _x(
        "olmoe_old_logprobs_context_parallel_unrestored",
        "stale_old_logprobs",
        "peaked",
        FaultSpec("old_logprobs_context_parallel_unrestored", ranks=(0,)),
        model="olmoe",
    ),
    _x(
        "routes_topk_ascending_ws4",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_topk_ascending", ranks=(3,)),
        model="tiny_moe",
        world_size=4,
    ),
    _x(
        "qwen2_moe_routes_topk_ascending",
        "routing_payload",
        "expert_sensitive",
        FaultSpec("routes_topk_ascending", ranks=(0,)),
        model="qwen2_moe",
    ),
    _x(
        "qwen2_moe_rollout_logprobs_reversed",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_reversed", ranks=LAST),
        model="qwen2_moe",
    ),
    _x(
        "olmoe_rollout_logprobs_reversed",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_reversed", ranks=(0,)),
        model="olmoe",
    ),
    _x(
        "rollout_logprobs_tp_shard_swapped_ws4",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_tp_shard_swapped", ranks=(2,)),
        model="tiny_moe",
        world_size=4,
    ),
    _x(
        "qwen2_moe_rollout_logprobs_tp_shard_swapped",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_tp_shard_swapped", ranks=LAST),
        model="qwen2_moe",
    ),
    _x(
        "train_forward_embedding_multiplier_ws4",
        "step_not_reproduced",
        "peaked",
        FaultSpec("train_forward_embedding_multiplier", ranks=(2,)),
        model="tiny_moe",
        world_size=4,
    ),
    _x(
        "qwen2_moe_train_forward_embedding_multiplier",
        "step_not_reproduced",
        "expert_sensitive",
        FaultSpec("train_forward_embedding_multiplier", ranks=LAST),
        model="qwen2_moe",
    ),
    _x(
        "expert_local_index_off_by_one_ws4",
        "step_not_reproduced",
        "expert_sensitive",
        FaultSpec("expert_local_index_off_by_one", ranks=(1,)),
        model="tiny_moe",
        world_size=4,
    ),
    _x(
        "olmoe_expert_local_index_off_by_one",
        "step_not_reproduced",
        "expert_sensitive",
        FaultSpec("expert_local_index_off_by_one", ranks=(0,)),
        model="olmoe",
    ),
    _x(
        "olmoe_rollout_logprobs_reversed_and_tp_shard_swapped_ws4",
        "engine_mismatch",
        "peaked_rollout_ratio",
        FaultSpec("rollout_logprobs_reversed", ranks=(0,)),
        FaultSpec("rollout_logprobs_tp_shard_swapped", ranks=(3,)),
        model="olmoe",
        world_size=4,
    ),
)
