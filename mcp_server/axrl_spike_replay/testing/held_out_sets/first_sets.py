"""The first held-out sets of the fault matrix, each written and measured before the rules that read it.

- `held_out`: a built-in fault no preset uses (another way to break the same part), planted on a healthy base
  preset (`peaked`, `expert_sensitive`). A diagnosis built on the presets alone has not seen these.
- `unseen`: faults of `capture.fault_injection.unrecorded_faults` (a kind no preset uses, most of a family no earlier
  rule read: steps that do not reproduce), written and measured before the rules that read them; on two architectures
  and two world sizes, one case with two faults on two ranks. Each names its own model and world size.
- `held_out_ii`: faults of `capture.fault_injection.held_out_faults`, a second held-out set (kinds no preset, no
  `held_out` and no `unseen` case uses: the stored old log-probs at the sampling temperature, shard-local expert ids, an
  advantage std over an axis of length one, an L2 penalty in one rank's gradients, a stale layer shard after a resume, a
  loss mask over the prompt), written and committed before any rule was run on them: on two architectures and two world
  sizes, one case with two faults on two ranks.
- `held_out_iii`: faults of `capture.fault_injection.held_out_iii_faults`, a third held-out set (eight kinds no
  earlier provenance uses), written and committed before any diagnosis was run on them: tiny_moe and qwen2_moe,
  world sizes 2 and 4, one case with two faults on two ranks.
- `held_out_iv`: faults of `capture.fault_injection.held_out_iv_faults`, a fourth held-out set (ten kinds no earlier
  provenance uses), written and committed before any diagnosis was run on them: tiny_moe and qwen2_moe, world sizes
  2 and 4, one case with two faults on two ranks.
"""

from __future__ import annotations

from axrl_spike_replay.capture.reference.presets import LAST, FaultSpec
from axrl_spike_replay.testing.matrix_case import MatrixCase

HELD_OUT = (
    MatrixCase(
        "held_out:old_logprobs_shifted",
        "stale_old_logprobs",
        "peaked",
        "held_out",
        (FaultSpec("logprob_shift", ranks=LAST, params={"signal": "old_logprobs"}),),
    ),
    MatrixCase(
        "held_out:old_logprobs_previous_step",
        "stale_old_logprobs",
        "peaked",
        "held_out",
        (FaultSpec("logprob_stale_buffer", ranks=LAST, params={"signal": "old_logprobs"}),),
    ),
    MatrixCase(
        "held_out:ref_logprobs_shifted",
        "bad_ref_logprobs",
        "peaked_kl",
        "held_out",
        (FaultSpec("logprob_shift", ranks=LAST, params={"signal": "ref_logprobs"}),),
    ),
    MatrixCase(
        "held_out:stale_engine_weights",
        "engine_mismatch",
        "peaked_rollout_ratio",
        "held_out",
        (FaultSpec("rollout_stale_engine"),),
    ),
    MatrixCase(
        "held_out:old_logprobs_out_of_order",
        "stale_old_logprobs",
        "peaked",
        "held_out",
        (FaultSpec("logprob_permuted", ranks=LAST, params={"signal": "old_logprobs"}),),
    ),
    MatrixCase(
        "held_out:ref_from_wrong_weights",
        "bad_ref_logprobs",
        "peaked_kl",
        "held_out",
        (FaultSpec("logprob_wrong_model", ranks=LAST, params={"signal": "ref_logprobs"}),),
    ),
    MatrixCase(
        "held_out:routes_out_of_order",
        "routing_payload",
        "expert_sensitive",
        "held_out",
        (FaultSpec("routes_permuted", ranks=LAST),),
    ),
    MatrixCase(
        "held_out:routes_stale_expert_table",
        "routing_payload",
        "expert_sensitive",
        "held_out",
        (FaultSpec("routes_stale_layer", ranks=(0,)),),
    ),
    MatrixCase(
        "held_out:engine_neg_inf_logprob",
        "non_finite",
        "peaked_rollout_ratio",
        "held_out",
        (FaultSpec("rollout_logprob_neg_inf", ranks=LAST, samples=(1,)),),
    ),
)


UNSEEN = (
    MatrixCase(
        "unseen:grad_accumulation_not_divided",
        "step_not_reproduced",
        "peaked",
        "unseen",
        (FaultSpec("grad_scale", ranks=LAST, params={"factor": 16.0}),),
    ),
    MatrixCase(
        "unseen:one_layer_grad_scaled_ws4",
        "step_not_reproduced",
        "peaked",
        "unseen",
        (FaultSpec("layer_grad_scale", ranks=(2,), params={"layers": [1], "factor": 1024.0}),),
        world_size=4,
    ),
    MatrixCase(
        "unseen:expert_grads_summed",
        "step_not_reproduced",
        "peaked",
        "unseen",
        (FaultSpec("family_grad_sum", ranks=(0,), params={"family": "experts", "factor": 64.0}),),
    ),
    MatrixCase(
        "unseen:loss_summed_over_micro_batches",
        "step_not_reproduced",
        "peaked",
        "unseen",
        (FaultSpec("loss_sum_not_mean", ranks=LAST, params={"factor": 16.0}),),
    ),
    MatrixCase(
        "unseen:advantages_stored_before_scale",
        "step_not_reproduced",
        "peaked",
        "unseen",
        (FaultSpec("stored_advantages_before_scale", ranks=LAST, params={"factor": 32.0}),),
    ),
    MatrixCase(
        "unseen:layer_scale_and_stale_stored_batch_ws4",
        "step_not_reproduced",
        "peaked",
        "unseen",
        (
            FaultSpec("layer_grad_scale", ranks=(0,), params={"layers": [0], "factor": 1024.0}),
            FaultSpec("stored_batch_previous", ranks=(3,)),
        ),
        world_size=4,
    ),
    MatrixCase(
        "unseen:qwen2_moe_grad_accumulation_not_divided",
        "step_not_reproduced",
        "peaked",
        "unseen",
        (FaultSpec("grad_scale", ranks=LAST, params={"factor": 16.0}),),
        model="qwen2_moe",
    ),
    MatrixCase(
        "unseen:qwen2_moe_loss_summed_ws4",
        "step_not_reproduced",
        "peaked",
        "unseen",
        (FaultSpec("loss_sum_not_mean", ranks=(1,), params={"factor": 32.0}),),
        world_size=4,
        model="qwen2_moe",
    ),
)


HELD_OUT_II = (
    MatrixCase(
        "held_out_ii:old_logprobs_at_sampling_temperature",
        "stale_old_logprobs",
        "peaked",
        "held_out_ii",
        (FaultSpec("old_logprobs_at_temperature", ranks=LAST, params={"temperature": 0.25}),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_ii:routes_local_expert_ids_ws4",
        "routing_payload",
        "expert_sensitive",
        "held_out_ii",
        (FaultSpec("routes_local_expert_ids", ranks=(2,), params={"ep": 2}),),
        world_size=4,
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_ii:mask_covers_prompt",
        "mask_misalignment",
        "peaked",
        "held_out_ii",
        (FaultSpec("mask_covers_prompt", ranks=LAST),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_ii:qwen2_moe_advantage_std_singleton_axis",
        "outlier_advantage",
        "peaked",
        "held_out_ii",
        (FaultSpec("advantage_std_singleton_axis", ranks=(0,), params={"eps": 1e-4}),),
        model="qwen2_moe",
    ),
    MatrixCase(
        "held_out_ii:qwen2_moe_weight_decay_in_grad",
        "step_not_reproduced",
        "peaked",
        "held_out_ii",
        (FaultSpec("weight_decay_in_grad", ranks=LAST, params={"weight_decay": 0.5}),),
        model="qwen2_moe",
    ),
    MatrixCase(
        "held_out_ii:stale_layer_shard_and_weight_decay_ws4",
        "step_not_reproduced",
        "peaked",
        "held_out_ii",
        (
            FaultSpec("stale_layer_shard", ranks=(1,), params={"layers": [0]}),
            FaultSpec("weight_decay_in_grad", ranks=(3,), params={"weight_decay": 1.0}),
        ),
        world_size=4,
        model="tiny_moe",
    ),
)


HELD_OUT_III = (
    MatrixCase(
        "held_out_iii:ref_logprobs_vocab_shard",
        "bad_ref_logprobs",
        "peaked_kl",
        "held_out_iii",
        (FaultSpec("ref_logprobs_vocab_shard", ranks=LAST, params={"shards": 8}),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iii:old_logprobs_softmax_over_positions",
        "stale_old_logprobs",
        "peaked",
        "held_out_iii",
        (FaultSpec("old_logprobs_softmax_over_positions", ranks=(0,)),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iii:rollout_logprobs_repetition_penalty",
        "engine_mismatch",
        "peaked_rollout_ratio",
        "held_out_iii",
        (FaultSpec("rollout_logprobs_repetition_penalty", params={"penalty": 2.0}),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iii:routes_layers_reversed_ws4",
        "routing_payload",
        "expert_sensitive",
        "held_out_iii",
        (FaultSpec("routes_layers_reversed", ranks=(1,)),),
        world_size=4,
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iii:stop_tail_in_mask",
        "mask_misalignment",
        "peaked",
        "held_out_iii",
        (FaultSpec("stop_tail_in_mask", ranks=LAST, params={"keep": 4, "pad": 15}),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iii:qwen2_moe_reward_log_of_zero",
        "non_finite",
        "peaked",
        "held_out_iii",
        (FaultSpec("reward_log_of_zero", ranks=(0,)),),
        model="qwen2_moe",
    ),
    MatrixCase(
        "held_out_iii:qwen2_moe_grads_not_zeroed",
        "step_not_reproduced",
        "peaked",
        "held_out_iii",
        (FaultSpec("grads_not_zeroed", ranks=LAST, params={"family": "all"}),),
        model="qwen2_moe",
    ),
    MatrixCase(
        "held_out_iii:grads_not_zeroed_and_expert_accumulated_ws4",
        "step_not_reproduced",
        "peaked",
        "held_out_iii",
        (
            FaultSpec("grads_not_zeroed", ranks=(0,), params={"family": "experts"}),
            FaultSpec("expert_grad_accumulated", ranks=(3,), params={"expert": 1, "times": 64.0}),
        ),
        world_size=4,
        model="tiny_moe",
    ),
)


HELD_OUT_IV = (
    MatrixCase(
        "held_out_iv:ref_logprobs_unnormalised",
        "bad_ref_logprobs",
        "peaked_kl",
        "held_out_iv",
        (FaultSpec("ref_logprobs_unnormalised", ranks=LAST),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iv:old_logprobs_adapter_disabled",
        "stale_old_logprobs",
        "peaked",
        "held_out_iv",
        (FaultSpec("old_logprobs_adapter_disabled", ranks=(0,)),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iv:routes_read_before_copy_ws4",
        "routing_payload",
        "expert_sensitive",
        "held_out_iv",
        (FaultSpec("routes_read_before_copy", ranks=(2,)),),
        world_size=4,
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iv:advantage_std_without_eps",
        "non_finite",
        "peaked",
        "held_out_iv",
        (FaultSpec("advantage_std_without_eps", ranks=LAST),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iv:engine_sampling_temperature",
        "one_rank_data",
        "peaked",
        "held_out_iv",
        (FaultSpec("engine_sampling_temperature", ranks=LAST, params={"temperature": 3.0}),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iv:advantages_summed_over_positions",
        "outlier_advantage",
        "peaked",
        "held_out_iv",
        (FaultSpec("advantages_summed_over_positions", ranks=(0,)),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iv:positions_not_reset_after_packing",
        "step_not_reproduced",
        "peaked",
        "held_out_iv",
        (FaultSpec("positions_not_reset_after_packing", ranks=LAST, params={"offset": 14}),),
        model="tiny_moe",
    ),
    MatrixCase(
        "held_out_iv:qwen2_moe_loss_mask_inverted",
        "mask_misalignment",
        "peaked",
        "held_out_iv",
        (FaultSpec("loss_mask_inverted", ranks=LAST),),
        model="qwen2_moe",
    ),
    MatrixCase(
        "held_out_iv:qwen2_moe_rollout_logprobs_base2",
        "engine_mismatch",
        "peaked_rollout_ratio",
        "held_out_iv",
        (FaultSpec("rollout_logprobs_base2"),),
        model="qwen2_moe",
    ),
    MatrixCase(
        "held_out_iv:qwen2_moe_entropy_bonus_summed",
        "step_not_reproduced",
        "peaked",
        "held_out_iv",
        (FaultSpec("entropy_bonus_summed", ranks=LAST, params={"coef": 0.05}),),
        model="qwen2_moe",
    ),
    MatrixCase(
        "held_out_iv:positions_and_entropy_bonus_ws4",
        "step_not_reproduced",
        "peaked",
        "held_out_iv",
        (
            FaultSpec("positions_not_reset_after_packing", ranks=(0,), params={"offset": 14}),
            FaultSpec("entropy_bonus_summed", ranks=(3,), params={"coef": 0.05}),
        ),
        world_size=4,
        model="tiny_moe",
    ),
)
