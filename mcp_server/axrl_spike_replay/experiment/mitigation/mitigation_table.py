"""Every named replay-only mitigation, declared once (`experiment.mitigation.mitigations` says what a declaration holds
and parses, normalises and applies configs of them)."""

from __future__ import annotations

from axrl_spike_replay.experiment.mitigation.mitigation_declaration import Advice, Mitigation
from axrl_spike_replay.experiment.mitigation.mitigation_values import (
    FIRST_MOE_LAYER,
    apply_advantage_outlier,
    apply_current_routing_layers,
    apply_drop_ranks,
    apply_drop_samples,
    apply_initial_model,
    apply_keep_ranks,
    apply_ratio_mask,
    apply_recompute,
    apply_routing_replay,
    mask_id,
    outlier_id,
    pairs_id,
    parse_above_one,
    parse_advantage_outlier,
    parse_choice,
    parse_flag,
    parse_layers,
    parse_non_negative,
    parse_path,
    parse_positive,
    parse_ratio_mask,
    path_id,
    ranks_id,
    recompute_id,
    set_loss,
)
from axrl_spike_replay.experiment.mitigation.objective_mitigations import OBJECTIVES
from axrl_spike_replay.experiment.mitigation.rank_scope import OPTIONAL, REQUIRED
from axrl_spike_replay.experiment.mitigation.recompute import parse_recompute
from axrl_spike_replay.experiment.mitigation.trainer_settings import (
    NO_MEGATRON_FLAG,
    NO_TRL_ROUTING,
    TrainerSetting,
    flow,
    none,
    override,
    per_value,
    run_config_key,
    verl_kl,
    verl_rejection,
)
from axrl_spike_replay.training.loss_config import (
    KL_ESTIMATORS,
    LOGPROB_BASES,
    LOSS_AGG_MODES,
)
from axrl_spike_replay.training.routing_config import ROUTING_REPLAY_MODES
from axrl_spike_replay.training.sample_masks import parse_pairs, parse_ranks

MITIGATIONS: dict[str, Mitigation] = {
    m.name: m
    for m in (
        Mitigation(
            "mismatch_token_clip_max",
            "loss",
            "float C > 0",
            "truncated importance sampling against the rollout engine: per-token loss weighted by "
            "min(exp(old - rollout), C), ratio taken against the old logprobs",
            parse_positive,
            set_loss("mismatch_token_clip_max"),
            advice=(
                Advice(
                    "mismatch",
                    "`mismatch_token_clip_max: 2` first (the standard truncated-IS fix); then 1.5 / 5 to see the "
                    "slope.",
                ),
            ),
            caveat=(
                "when the rollout and trainer logprobs agree (no mismatch) it only down-weights ordinary "
                "tokens; a cap too low biases the gradient towards the rollout policy"
            ),
            settings=(
                run_config_key("loss.mismatch_token_clip_max"),
                override(
                    "algorithm.rollout_correction.rollout_is=token "
                    "algorithm.rollout_correction.rollout_is_threshold={value}",
                    "verl's token-level truncated importance sampling in decoupled mode: the same weights",
                ),
                override(
                    "vllm_importance_sampling_mode=token_truncate vllm_importance_sampling_clip_max={value}",
                    "TRL's token truncation, with use_vllm (TRL corrects only what vLLM generated)",
                    "trl",
                ),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "ratio_outlier_mask",
            "loss",
            "true | token | sequence | {level, low, high, base}",
            "mask tokens (or whole sequences, by the geometric mean) whose importance ratio against the rollout "
            "(or old) logprobs leaves [low, high]; defaults level=token low=0.5 high=2.0 base=rollout",
            parse_ratio_mask,
            apply_ratio_mask,
            advice=(
                Advice(
                    "mismatch",
                    "`ratio_outlier_mask: token` (or `sequence` when whole responses are off) — masks instead of "
                    "clipping.",
                ),
            ),
            bare=True,
            id_value=mask_id,
            caveat=(
                "when many tokens leave [low, high] it masks much of the batch (check the footprint); it "
                "hides the mismatch rather than fixing the engine"
            ),
            settings=(
                run_config_key("loss.ratio_outlier_mask"),
                TrainerSetting(
                    "verl",
                    verl_rejection,
                    "verl's rejection sampling, whose k1 bounds are on pi_rollout/pi_old: ours on pi/pi_rollout, "
                    "inverted; base old and low 0 have no verl form",
                ),
                none(
                    "trl",
                    "no GRPOConfig setting: TRL's masks are on pi_old/pi_rollout (mitigation rollout_correction "
                    "token_mask), not on the current policy's ratio",
                ),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "advantage_clip",
            "loss",
            "float A > 0",
            "clamp advantages to [-A, A]",
            parse_positive,
            set_loss("advantage_clip"),
            advice=(Advice("negative_advantages", "`advantage_clip: 1` (or the group std of advantages)."),),
            caveat=(
                "it clips every large advantage, healthy ones included; with well-normalised advantages "
                "(|A| mostly under the clip) it changes little and hides a mis-scaled reward"
            ),
            settings=(
                run_config_key("loss.advantage_clip"),
                none("verl", "no setting in verl 0.9.1: clamp the advantages where they are computed (a patch)"),
                none("trl", "no GRPOConfig setting: clamp the advantages where TRL computes them (a patch)"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "log_ratio_clip",
            "loss",
            "float c > 0",
            "clamp the policy log-ratio to [-c, c] before exponentiating",
            parse_positive,
            set_loss("log_ratio_clip"),
            advice=(Advice("mismatch", "`log_ratio_clip: 5` — a blunt guard against overflow in exp()."),),
            caveat="a blunt guard: it changes every token whose ratio is far from 1, healthy policy moves included",
            settings=(
                run_config_key("loss.log_ratio_clip"),
                none(
                    "verl",
                    "no setting in verl 0.9.1: compute_policy_loss_vanilla clamps the log-ratio at +-20, fixed in its "
                    "code (a patch there)",
                ),
                none("trl", "no GRPOConfig setting: TRL's _compute_loss has no log-ratio clamp (a patch there)"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "loss_agg_mode",
            "loss",
            " | ".join(LOSS_AGG_MODES),
            "how per-token losses reduce to the rank's loss (the denominator)",
            parse_choice(LOSS_AGG_MODES),
            set_loss("loss_agg_mode", str),
            advice=(
                Advice(
                    "negative_advantages",
                    "`loss_agg_mode: seq-mean-token-mean` — stops long responses from dominating the token mean.",
                ),
            ),
            caveat=(
                "it changes the weighting of every sample, so the run's loss is no longer comparable with"
                " its earlier steps"
            ),
            settings=(
                run_config_key("loss.loss_agg_mode"),
                override("actor_rollout_ref.actor.loss_agg_mode={value}"),
                per_value(
                    "trl",
                    {
                        "token-mean": "loss_type=dapo",
                        "seq-mean-token-mean": "loss_type=grpo",
                        "seq-mean-token-sum": "loss_type=luspo",
                        "seq-mean-token-sum-norm": "loss_type=dr_grpo",
                    },
                    "TRL's loss_type sets the aggregation (mitigation trl_loss_type on a TRL snapshot)",
                ),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "is_base_logprobs",
            "loss",
            " | ".join(LOGPROB_BASES),
            "which logprobs the PPO ratio is taken against",
            parse_choice(LOGPROB_BASES),
            set_loss("is_base_logprobs", str),
            advice=(
                Advice(
                    "mismatch",
                    "`is_base_logprobs: rollout` — if the ratio against the rollout is what blows up, this shows it.",
                ),
            ),
            caveat=(
                "it changes which policy the update is importance-weighted against for the whole run, not"
                " just the spike"
            ),
            settings=(
                run_config_key("loss.is_base_logprobs"),
                per_value(
                    "verl",
                    {
                        "old": "algorithm.rollout_correction.bypass_mode=false",
                        "rollout": "algorithm.rollout_correction.bypass_mode=true",
                    },
                    "decoupled mode, verl's default, takes the PPO ratio against old_log_probs; bypass mode "
                    "against the rollout's, with verl's bypass loss",
                ),
                none("trl", "no setting: TRL's ratio is always against its old log-probs"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "clip_eps_low",
            "loss",
            "float >= 0",
            "PPO clip range below 1 (ratio >= 1 - eps)",
            parse_non_negative,
            set_loss("clip_eps_low"),
            advice=(Advice("policy_drift", "a tighter `clip_eps_low` (e.g. 0.1)."),),
            caveat="a tighter clip slows learning on every step, not only the spike",
            settings=(
                run_config_key("loss.clip_eps_low"),
                override("actor_rollout_ref.actor.clip_ratio_low={value}"),
                override("epsilon={value}", trainer="trl"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "clip_eps_high",
            "loss",
            "float >= 0",
            "PPO clip range above 1 (ratio <= 1 + eps)",
            parse_non_negative,
            set_loss("clip_eps_high"),
            advice=(Advice("policy_drift", "a tighter `clip_eps_high` (e.g. 0.1)."),),
            caveat="a tighter clip slows learning on every step, not only the spike",
            settings=(
                run_config_key("loss.clip_eps_high"),
                override("actor_rollout_ref.actor.clip_ratio_high={value}"),
                override("epsilon_high={value}", trainer="trl"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "dual_clip_c",
            "loss",
            "float > 1",
            "dual clip: negative-advantage loss capped at -A * c",
            parse_above_one,
            set_loss("dual_clip_c"),
            advice=(
                Advice(
                    "negative_advantages",
                    "`dual_clip_c: 3` — caps the loss of negative-advantage tokens with large ratios.",
                ),
            ),
            caveat="only negative-advantage tokens are capped; a spike from positive advantages is untouched",
            settings=(
                run_config_key("loss.dual_clip_c"),
                override("actor_rollout_ref.actor.clip_ratio_c={value}", "verl's dual clip, on by default with c = 3"),
                override("delta={value}", "TRL's two-sided clip: the same loss when delta >= 1 + epsilon_high", "trl"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "kl_coef",
            "loss",
            "float >= 0",
            "weight of the k3 KL penalty against the reference policy",
            parse_non_negative,
            set_loss("kl_coef"),
            advice=(
                Advice("policy_drift", "`kl_coef` up."),
                Advice(
                    "kl",
                    "`kl_coef: 0` — takes the KL term out: if the spike goes, the KL term (its reference, or the "
                    "routes it was taken under) carries it; keep a smaller coefficient, or fix the estimator or clamp.",
                ),
            ),
            caveat="a stronger KL pull slows learning on every step",
            settings=(
                run_config_key("loss.kl_coef"),
                TrainerSetting(
                    "verl",
                    verl_kl,
                    "the KL loss against the reference policy; kl_loss_type low_var_kl is k3",
                ),
                override("beta={value}", "TRL's KL term is k3, unclamped (use_bias_correction_kl)", "trl"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "entropy_coef",
            "loss",
            "float >= 0",
            "weight of the entropy bonus",
            parse_non_negative,
            set_loss("entropy_coef"),
            caveat="it changes exploration for the whole run",
            settings=(
                run_config_key("loss.entropy_coef"),
                override("actor_rollout_ref.actor.entropy_coeff={value}"),
                override("entropy_coef={value}", trainer="trl"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "aux_loss_coef",
            "loss",
            "float >= 0",
            "weight of the MoE load-balancing loss",
            parse_non_negative,
            set_loss("aux_loss_coef"),
            advice=(Advice("routing", "`aux_loss_coef` up (x10) — if the router logits themselves explode."),),
            caveat="a stronger balancing loss trades model quality for balance on every step",
            settings=(
                run_config_key("loss.aux_loss_coef"),
                override(
                    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff={value}",
                    "Megatron engine: a Megatron-core TransformerConfig field",
                ),
                override(
                    "actor_rollout_ref.model.override_config.router_aux_loss_coef={value}",
                    "FSDP engine: the HF model config's field, in qwen*_moe, mixtral, olmoe",
                ),
                override(
                    'model_init_kwargs={{"router_aux_loss_coef": {value}, "output_router_logits": true}}',
                    "the policy's transformers config, whose router loss GRPOTrainer adds",
                    "trl",
                ),
                override("--moe-aux-loss-coeff {value}", trainer="megatron"),
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "z_loss_coef",
            "loss",
            "float >= 0",
            "weight of the router z-loss",
            parse_non_negative,
            set_loss("z_loss_coef"),
            advice=(Advice("routing", "`z_loss_coef` up (x10) — if the router logits themselves explode."),),
            caveat="a stronger z-loss constrains the router on every step",
            settings=(
                run_config_key("loss.z_loss_coef"),
                override(
                    "actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff={value}",
                    "Megatron engine: a Megatron-core TransformerConfig field",
                ),
                none("trl", "no setting: TRL adds no router z-loss"),
                override("--moe-z-loss-coeff {value}", trainer="megatron"),
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "loss_scale",
            "loss",
            "float s > 0, scoped to ranks: s@R (e.g. 2@1)",
            "multiply the named saved ranks' whole loss (policy and router terms) by s — a hypothesis about one rank's "
            "loss (a rank that weighted its loss differently, counted its micro-batches twice), judged against the "
            "recording",
            parse_positive,
            set_loss("loss_scale"),
            caveat="a hypothesis about what a rank computed, never a fix: scaling a loss only scales its gradient",
            settings=(
                none("axrl", "a hypothesis about one rank's loss, no training setting"),
                none("verl", "a hypothesis about one rank's loss, no training setting"),
                none("trl", "a hypothesis about one rank's loss, no training setting"),
                none("megatron", "a hypothesis about one rank's loss, no training setting"),
            ),
            per_rank=REQUIRED,
        ),
        Mitigation(
            "routing_replay",
            "routing",
            " | ".join(ROUTING_REPLAY_MODES),
            "replay recorded expert routes on all tokens, on loss tokens only (current routing elsewhere), or off",
            parse_choice(ROUTING_REPLAY_MODES),
            apply_routing_replay,
            advice=(
                Advice("routing", "`routing_replay: loss_tokens` — replay only where the loss is taken."),
                Advice(
                    "routing",
                    "`routing_replay: off` — **diagnostic only**, and no test of the routes on its own: the stored "
                    "old and reference log-probs were computed under the replayed routes, so turning replay off "
                    "moves the policy away from them and the spike can grow even when the recorded routes are the "
                    "broken part; test a rank's routes by dropping or recomputing them on that rank (see the fault "
                    "matrix below). Never write it up as a fix.",
                ),
            ),
            caveat="`off` is a diagnostic only; replaying routes the rollout engine did not use hides a routing bug",
            settings=(
                run_config_key("routing.replay"),
                per_value(
                    "verl",
                    {
                        "all": "actor_rollout_ref.actor.megatron.router_replay.mode=R3 "
                        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                        "off": "actor_rollout_ref.actor.megatron.router_replay.mode=disabled",
                    },
                    "Megatron engine: R3 replays the rollout's routes in training; verl has no loss-tokens-only mode",
                ),
                NO_TRL_ROUTING,
                per_value(
                    "megatron",
                    {"all": "--moe-enable-routing-replay", "off": "(leave out --moe-enable-routing-replay)"},
                    "the RL trainer records the rollout's routes and hands them to the router; no loss-tokens mode",
                ),
            ),
        ),
        Mitigation(
            "current_routing_layers",
            "routing",
            "MoE layer ids (absolute decoder layers), e.g. 1 or 0,1; or first",
            "these MoE layers route on current scores while the others replay the recorded routes; `first` is "
            "the model's first MoE layer, resolved against the snapshot's model (layer 1 of deepseek_v3, whose "
            "layer 0 is dense) and recorded in the result's `resolved_mitigations`",
            parse_layers,
            apply_current_routing_layers,
            advice=(
                Advice(
                    "routing",
                    "`current_routing_layers: first` — current routing in the first MoE layer, replay elsewhere "
                    "(the seed workflow's config, on any architecture).",
                ),
                Advice(
                    "routing",
                    "`current_routing_layers: [<the layer>]` — current routing in the layer that spikes, replay "
                    "elsewhere.",
                ),
            ),
            caveat="it mixes recorded and current routes; use it to locate a layer, then fix that layer's routing",
            settings=(
                TrainerSetting(
                    "axrl",
                    lambda value: (
                        None if value == FIRST_MOE_LAYER else f"routing.current_routing_layers: {flow(value)}"
                    ),
                    "layer ids; a replay resolves `first` against the model and records them as resolved_mitigations",
                ),
                none("verl", "no setting: verl replays the routes of every MoE layer alike (a patch)"),
                NO_TRL_ROUTING,
                none("megatron", "no flag: routing replay covers every MoE layer alike (a patch)"),
            ),
        ),
        Mitigation(
            "balance_negative_advantages",
            "loss",
            "true | false",
            "scale negative advantages so their total magnitude matches the positives'",
            parse_flag,
            set_loss("balance_negative_advantages", bool),
            advice=(Advice("negative_advantages", "`balance_negative_advantages: true`."),),
            bare=True,
            caveat=(
                "it rescales every negative advantage of the batch; when negatives are rightly dominant "
                "(a bad batch of answers) it weakens a real signal"
            ),
            settings=(
                run_config_key("loss.balance_negative_advantages"),
                none("verl", "no setting in verl 0.9.1: rescale the advantages where they are computed (a patch)"),
                none("trl", "no GRPOConfig setting: rescale the advantages where TRL computes them (a patch)"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "advantage_outlier_mask",
            "loss",
            "float T > 0, or {threshold: T, scope: batch | group}",
            "mask whole samples whose advantage (mean over its loss tokens) is a robust outlier in the saved rank's "
            "batch (or its prompt group): |A - median| / (1.4826 * MAD) > T",
            parse_advantage_outlier,
            apply_advantage_outlier,
            advice=(
                Advice(
                    "outlier_advantage",
                    "`advantage_outlier_mask: 5` — masks the few samples whose advantage is > 5 robust standard "
                    "deviations from their batch's median; `{threshold: 5, scope: group}` judges each prompt group.",
                ),
                Advice("outlier_advantage", "`advantage_clip: 1` — clamps instead of masking (keeps the sample)."),
            ),
            id_value=outlier_id,
            caveat=(
                "when the outlier advantage is right (a rare but real reward) it throws that signal away;"
                " a threshold too low masks ordinary samples (check the footprint); fix the reward or "
                "advantage scaling where it went wrong"
            ),
            settings=(
                none(
                    "axrl",
                    "no run_config key: a replay-only sample filter; drop such samples where advantages are "
                    "computed (a patch to the trainer)",
                ),
                none("verl", "no setting in verl 0.9.1: drop such samples where advantages are computed (a patch)"),
                none("trl", "no GRPOConfig setting: drop such samples where TRL computes advantages (a patch)"),
                NO_MEGATRON_FLAG,
            ),
        ),
        Mitigation(
            "drop_samples",
            "loss",
            "rank:sample pairs, e.g. 0:3,1:2",
            "leave the named samples (saved rank : sample index) out of the loss — a diagnostic: is the spike "
            "those samples?",
            parse_pairs,
            apply_drop_samples,
            advice=(
                Advice(
                    "outlier_advantage",
                    "`drop_samples: <rank:sample of attribution's top samples>` — **diagnostic only**: if leaving "
                    "them out clears the spike, the cause is in those samples; find the mechanism, never write it "
                    "up as a fix.",
                ),
            ),
            id_value=pairs_id,
            diagnostic="it leaves hand-picked samples out of one replayed step: it locates the cause but is no rule "
            "a trainer could apply to the next batch",
            caveat="never as a fix: it names samples of one step by hand",
        ),
        Mitigation(
            "drop_ranks",
            "loss",
            "saved DP rank ids, e.g. 1 or 0,2",
            "leave every sample of the named saved ranks out of the loss (the DP mean still divides by the saved world "
            "size) — a diagnostic: is the spike that rank's batch or one of its stored signals?",
            parse_ranks,
            apply_drop_ranks,
            advice=(
                Advice(
                    "one_rank",
                    "`drop_ranks: <the rank diagnose names>` — **diagnostic only**: if leaving that rank out clears "
                    "the spike, the cause is on that rank; then find which of its stored signals is broken.",
                ),
            ),
            id_value=ranks_id,
            diagnostic="it leaves whole ranks of one replayed step out: it locates the cause, no trainer rule",
            caveat="never as a fix: it throws away a rank's batch",
        ),
        Mitigation(
            "keep_ranks",
            "loss",
            "saved DP rank ids, e.g. 0,2",
            "keep only the named saved ranks' samples in the loss (the others' samples left out; the DP mean still "
            "divides by the saved world size) — a diagnostic",
            parse_ranks,
            apply_keep_ranks,
            id_value=ranks_id,
            diagnostic="it leaves whole ranks of one replayed step out: it locates the cause, no trainer rule",
            caveat="never as a fix: it throws away the other ranks' batches",
        ),
        Mitigation(
            "recompute",
            "signals",
            "old_logprobs[:rankR] | rollout_logprobs[:rankR] | routes[:rankR][:layerL], comma-separated",
            "replace a stored signal by what the snapshot's weights give on the named ranks (every rank without "
            ":rankR): `old_logprobs` by the replay's own log-probs (the trainer's old log-probs at these weights), "
            "`rollout_logprobs` likewise (an engine that agreed with the trainer), `routes` by the model's own "
            "routing (every MoE layer without :layerL) — a diagnostic: is that stored signal the broken part?",
            parse_recompute,
            apply_recompute,
            advice=(
                Advice(
                    "stored_signal",
                    "`recompute: old_logprobs:rank<R>` — **diagnostic only**: if the spike goes, rank R's stored old "
                    "log-probs were stale or misaligned (recompute them in the trainer at the step's weights).",
                ),
                Advice(
                    "stored_signal",
                    "`recompute: routes:rank<R>,old_logprobs:rank<R>` — **diagnostic only**: rank R routes as the "
                    "model does, with the old log-probs taken under those routes; if the spike goes, rank R's routing "
                    "payload was the broken part. Without `old_logprobs` the stored old log-probs (computed under the "
                    "recorded routes) disagree with the new routes and the spike grows whatever the payload: that "
                    "growth is no evidence for the payload.",
                ),
            ),
            id_value=recompute_id,
            diagnostic="it replaces a stored signal of one replayed step: it says which signal is broken, the fix is "
            "in the trainer that stored it",
            caveat="never as a fix: the trainer must store the right signal",
        ),
        Mitigation(
            "kl_estimator",
            "loss",
            " | ".join(KL_ESTIMATORS),
            "the KL estimator of the KL term, as verl's `kl_penalty` computes it: k1/kl (log p - log ref), abs, "
            "k2/mse (half the squared log-ratio), k3/low_var_kl (exp(ref - logp) - (ref - logp) - 1, clamped at +-10 "
            "as verl does; the axrl convention's own k3 is unclamped), a trailing + takes k2's gradient",
            parse_choice(KL_ESTIMATORS),
            set_loss("kl_estimator", str),
            advice=(
                Advice(
                    "kl",
                    "`kl_estimator: k2` (or `k1`) — when the KL term carries the spike through k3's exp(ref - logp) "
                    "on a few tokens: k2's gradient grows linearly in the log-ratio, k1's not at all.",
                ),
            ),
            caveat="k1's and abs's gradients ignore how far the policy is from the reference; k3 without a clamp "
            "explodes where ref - logp is tens of nats",
            settings=(
                run_config_key("loss.kl_estimator"),
                override("actor_rollout_ref.actor.kl_loss_type={value}", "verl's actor KL loss estimator"),
                none("trl", "no setting: TRL's KL term is k3 (weighted by the ratio under use_bias_correction_kl)"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "kl_clamp",
            "loss",
            "float C > 0",
            "clamp each token's KL estimate to [-C, C] (a clamped token's KL has no gradient), as verl clamps k3 / "
            "low_var_kl at 10; C replaces verl's 10 and bounds the other estimators alike",
            parse_positive,
            set_loss("kl_clamp"),
            advice=(
                Advice(
                    "kl",
                    "`kl_clamp: 10` (verl's own bound; under verl's k3 a smaller C) — when a few tokens' "
                    "exp(ref - logp) carries the KL term's gradient.",
                ),
            ),
            caveat="it silences the KL term exactly where the policy left the reference furthest",
            settings=(
                run_config_key("loss.kl_clamp"),
                none(
                    "verl",
                    "no setting in verl 0.9.1: core_algos.kl_penalty_forward clamps k3 / low_var_kl at +-10, fixed "
                    "in its code (a patch there; or kl_loss_type=low_var_kl where another estimator is used)",
                ),
                none("trl", "no setting: TRL's k3 is unclamped (a patch to _compute_loss)"),
                NO_MEGATRON_FLAG,
            ),
            per_rank=OPTIONAL,
        ),
        Mitigation(
            "initial_model",
            "weights",
            "path to a DCP checkpoint dir or a snapshot dir",
            "replay from other weights (e.g. the run's initial model) instead of the snapshot's",
            parse_path,
            apply_initial_model,
            advice=(
                Advice(
                    "from_the_start",
                    "`initial_model: <the run's initial checkpoint>` — if the spike reproduces from the initial "
                    "weights, the batch (data) is the cause, not the drifted policy.",
                ),
            ),
            id_value=path_id,
            caveat="a diagnostic: it says whether the batch or the drifted policy causes the spike, it is no fix",
            settings=(
                none("axrl", "a diagnostic (batch or drifted policy?), no training setting"),
                none("verl", "a diagnostic (batch or drifted policy?), no training setting"),
                none("trl", "a diagnostic (batch or drifted policy?), no training setting"),
                none("megatron", "a diagnostic (batch or drifted policy?), no training setting"),
            ),
        ),
        *OBJECTIVES,
    )
}
