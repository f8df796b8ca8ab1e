"""The fault matrix: spikes with a known broken part, captured by the reference trainer, to judge a diagnosis by.

Each `MatrixCase` is a run of the reference trainer with one trainer bug planted during the burst (a preset of
`capture.reference.presets`, plus faults of `capture.fault_injection.faults` of its own), the cause family it plants and
the ranks it hits.
Three provenances:

- `preset`: the family presets (`presets.FAMILY_PRESETS`), one per family;
- `variant`: a family preset's fault with other parameters or ranks;
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
- `held_out_v`: faults of `capture.fault_injection.held_out_v_faults`, a fifth held-out set (eight kinds no earlier
  provenance uses, three of them in the trainer's loss), written and committed before any diagnosis was run on them:
  tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one case with two faults on two ranks.
- `held_out_vi`: faults of `capture.fault_injection.held_out_vi_faults`, a sixth held-out set (eight kinds no earlier
  provenance uses: in the advantages, the stored log-probs, the engine's log-probs, the routing payload and the
  trainer's routing replay), written and committed before any diagnosis was run on them: tiny_moe, qwen2_moe and
  olmoe, world sizes 2 and 4, one case with two faults on two ranks.
- `held_out_vii`: faults of `capture.fault_injection.held_out_vii_faults`, a seventh held-out set (eight kinds no
  earlier provenance uses: in the old and reference log-probs, the REINFORCE baseline, the routing payload, the loss
  mask, and two in what the trainer does with a clean input: its clipping and its routing replay), written and
  committed before any diagnosis was run on them: tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one case with
  two faults on two ranks.
- `held_out_viii`: faults of `capture.fault_injection.held_out_viii_faults`, an eighth held-out set (eight kinds no
  earlier provenance uses: in the old and engine log-probs, the routing payload, the loss mask, the GRPO groups, and
  two in what the trainer does with a clean input: the old log-probs its loss reads and its routing replay's gates),
  written and committed before any diagnosis was run on them: tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4,
  one case with two faults on two ranks.
- `held_out_ix`: faults of `capture.fault_injection.held_out_ix_faults`, a ninth held-out set (six kinds no earlier
  provenance uses: in the tokens, the rewards, the engine log-probs, and three in what the trainer does with a clean
  input: its loss scale, its accumulation divisor and its training forward's tokens), written and committed before any
  diagnosis was run on them: tiny_moe, qwen2_moe and olmoe, world sizes 2 and 4, one case with two faults on two ranks.

`capture_command` is the same run as an `axrl-spike-replay capture` command line. `capture_case` records a case
with `hide_fault`, so the snapshots and the log do not name the preset or the fault:
whatever diagnoses them must find the broken part from the evidence. `benchmarks/bench_diagnosis.py` runs the
matrix; `skills/axrl-spike-replay/evals/evals.json` holds the presets' cases as skill evals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from axrl_spike_replay.capture.reference.presets import (
    FAMILY_PRESETS,
    FAULT_FAMILIES,
    LAST,
    PRESETS,
    FaultSpec,
    get_preset,
)

PROVENANCES = (
    "preset",
    "variant",
    "held_out",
    "unseen",
    "held_out_ii",
    "held_out_iii",
    "held_out_iv",
    "held_out_v",
    "held_out_vi",
    "held_out_vii",
    "held_out_viii",
    "held_out_ix",
)
MATRIX_WORLD_SIZE = 2  # one faulty rank beside a healthy one: the witness a per-rank comparison needs
MATRIX_STEPS = 24  # the burst is at iterations 20-22


@dataclass(frozen=True)
class MatrixCase:
    """One cell of the matrix: a preset, extra faults planted on it, and the answer."""

    name: str
    family: str  # the cause family planted (one of presets.FAULT_FAMILIES)
    preset: str
    provenance: str  # one of PROVENANCES
    faults: tuple[FaultSpec, ...] = ()  # planted on top of the preset's own fault
    world_size: int = MATRIX_WORLD_SIZE
    model: str | None = None  # the one model the case runs on (None: each model the matrix is run on)

    def specs(self) -> list[FaultSpec]:
        """Every fault the case plants: the preset's, then its own."""
        own = get_preset(self.preset).injected
        return [*([own] if own is not None else []), *self.faults]

    def expected_ranks(self, world_size: int) -> list[int]:
        """The data-parallel ranks the planted faults hit; [] when they hit every rank (nothing to single out)."""
        hit: set[int] = set()
        for spec in self.specs():
            if spec.ranks is None:
                return []
            hit.update(r % world_size for r in spec.ranks)
        return [] if len(hit) == world_size else sorted(hit)


def _preset_cases() -> list[MatrixCase]:
    return [MatrixCase(name, family, name, "preset") for family, name in FAMILY_PRESETS.items()]


_VARIANTS = (
    MatrixCase(
        "variant:reward_scale_rank0",
        "outlier_advantage",
        "reinforce_baseline",
        "variant",
        (FaultSpec("reward_scale", ranks=(0,), samples=(2,), params={"factor": 1000.0, "offset": 10.0}),),
    ),
    MatrixCase(
        "variant:half_foreign_shard",
        "one_rank_data",
        "peaked",
        "variant",
        (FaultSpec("off_policy_responses", ranks=(0,), params={"fraction": 0.5}),),
    ),
    MatrixCase(
        "variant:mask_two_early",
        "mask_misalignment",
        "peaked",
        "variant",
        (FaultSpec("mask_shift", ranks=(0,), params={"shift": 2}),),
    ),
)

_HELD_OUT = (
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


_UNSEEN = (
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


_HELD_OUT_II = (
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


_HELD_OUT_III = (
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


_HELD_OUT_IV = (
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


def _v(name: str, family: str, preset: str, *faults: FaultSpec, model: str, world_size: int = 2) -> MatrixCase:
    return MatrixCase(f"held_out_v:{name}", family, preset, "held_out_v", faults, world_size=world_size, model=model)


_HELD_OUT_V = (
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


def _vi(name: str, family: str, preset: str, *faults: FaultSpec, model: str, world_size: int = 2) -> MatrixCase:
    return MatrixCase(f"held_out_vi:{name}", family, preset, "held_out_vi", faults, world_size=world_size, model=model)


_HELD_OUT_VI = (
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


def _vii(name: str, family: str, preset: str, *faults: FaultSpec, model: str, world_size: int = 2) -> MatrixCase:
    provenance = "held_out_vii"
    return MatrixCase(f"{provenance}:{name}", family, preset, provenance, faults, world_size=world_size, model=model)


_HELD_OUT_VII = (
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


def _viii(name: str, family: str, preset: str, *faults: FaultSpec, model: str, world_size: int = 2) -> MatrixCase:
    provenance = "held_out_viii"
    return MatrixCase(f"{provenance}:{name}", family, preset, provenance, faults, world_size=world_size, model=model)


_HELD_OUT_VIII = (
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


def _ix(name: str, family: str, preset: str, *faults: FaultSpec, model: str, world_size: int = 2) -> MatrixCase:
    provenance = "held_out_ix"
    return MatrixCase(f"{provenance}:{name}", family, preset, provenance, faults, world_size=world_size, model=model)


_HELD_OUT_IX = (
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


def matrix_cases(provenances: tuple[str, ...] = PROVENANCES) -> list[MatrixCase]:
    """The matrix's cases of the given provenances, presets first."""
    unknown = set(provenances) - set(PROVENANCES)
    if unknown:
        raise ValueError(f"unknown provenance {sorted(unknown)} (known: {', '.join(PROVENANCES)})")
    cases = [
        *_preset_cases(),
        *_VARIANTS,
        *_HELD_OUT,
        *_UNSEEN,
        *_HELD_OUT_II,
        *_HELD_OUT_III,
        *_HELD_OUT_IV,
        *_HELD_OUT_V,
        *_HELD_OUT_VI,
        *_HELD_OUT_VII,
        *_HELD_OUT_VIII,
        *_HELD_OUT_IX,
    ]
    return [c for c in cases if c.provenance in provenances]


def case_faults(case: MatrixCase) -> list[Any]:
    """The case's own faults as `capture.fault_injection.faults` objects (the preset's own fault the trainer builds
    itself)."""
    from axrl_spike_replay.capture.fault_injection.faults import make_fault

    return [make_fault(spec) for spec in case.faults]


def capture_case(
    case: MatrixCase,
    out: str | Path,
    *,
    model: str = "tiny_moe",
    seed: int = 0,
    world_size: int | None = None,
    steps: int = MATRIX_STEPS,
) -> Any:
    """Record `case` under `out` with the fault hidden from the snapshots (a `CaptureResult`); `world_size` None:
    the case's."""
    from axrl_spike_replay.capture.reference.reference_trainer import capture_reference_run

    return capture_reference_run(
        out,
        run=f"{case.name.replace(':', '-')}-s{seed}",
        world_size=case.world_size if world_size is None else world_size,
        steps=steps,
        seed=seed,
        preset=case.preset,
        model=model,
        faults=case_faults(case),
        hide_fault=True,
    )


def capture_command(case: MatrixCase, out: str, *, model: str = "tiny_moe", seed: int = 0) -> str:
    """The CLI command that records `case` as `capture_case` does (the fault hidden from the snapshots)."""
    import json
    import shlex

    words = [
        "axrl-spike-replay", "capture", "--out", out, "--world-size", str(case.world_size),
        "--steps", str(MATRIX_STEPS), "--seed", str(seed), "--preset", case.preset, "--model", model, "--hide-fault",
    ]  # fmt: skip
    for spec in case.faults:
        words += ["--fault", json.dumps(spec.to_dict(), separators=(",", ":"))]
    return shlex.join(words)


def burst_snapshots(result: Any, preset: str) -> list[Path]:
    """The snapshots of `result` taken at the preset's burst iterations (a spike elsewhere is the run's own), the
    largest spike first: a burst of several steps can also trip the detector on a mild step, and which steps do
    depends on the machine's arithmetic, while the burst's largest spike is the one the fault makes."""
    return largest_spike_first(result.snapshot_dirs, result.config["train"].get("burst") or ())


def largest_spike_first(snapshots: Iterable[Path], burst: Iterable[int]) -> list[Path]:
    """The `snapshots` taken at a `burst` iteration, the largest spike first (a non-finite step, NaN or inf norm, is
    the largest spike there is; equal ratios keep the earlier iteration first): what a fresh capture and a kept one
    (`bench_diagnosis --reuse`) both diagnose first."""
    from axrl_spike_replay.snapshot.metadata import read_metadata

    at = set(burst)
    taken = [(read_metadata(p)[0], p) for p in snapshots]
    at_burst = [(meta.spike_ratio, meta.iteration, p) for meta, p in taken if meta.iteration in at]
    return [p for *_, p in sorted(at_burst, key=lambda t: (-t[0] if math.isfinite(t[0]) else -math.inf, t[1]))]


# Cause ids of earlier diagnoses, read as the family each named (a record or report written before the families).
OLD_FAMILY_IDS = {
    "logprob_mismatch": "engine_mismatch",
    "routing_mismatch": "routing_payload",
    "one_rank": "one_rank_data",
    "none_found": "natural_spike",
}


def family_id(name: str) -> str:
    """The cause family `name` denotes: itself, or the family an earlier diagnosis's cause id stood for."""
    return OLD_FAMILY_IDS.get(name, name)


def known_family(name: str) -> bool:
    """Whether `name` (after `family_id`) is one of the families."""
    return family_id(name) in FAULT_FAMILIES


def kinds_taken_before(provenance: str) -> set[str]:
    """The fault kinds a new held-out set must avoid: every preset's and every held-out provenance's before
    `provenance` (from `held_out` on, in `PROVENANCES` order)."""
    earlier = PROVENANCES[PROVENANCES.index("held_out") : PROVENANCES.index(provenance)]
    kinds = {spec.kind for case in matrix_cases(earlier) for spec in case.faults}
    return kinds | {p.injected.kind for p in PRESETS.values() if p.injected is not None}
