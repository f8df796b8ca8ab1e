"""Faults planted by hand in copies of the golden snapshot (recorded as trained, `snapshot_edits.rerecord`, where the
test is of the fault and not of the record), none of them a capture preset: `diagnose` finds which
stored signal is the odd one out, on which rank, from the per-rank comparison with the replay (a witness that
agrees where the named signal does not), names the family of the broken part first, and suggests experiments that
test it and are never no-ops for the snapshot's own config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from snapshot_edits import copy_fixture, diagnosed, edit_batch, no_mismatch, set_loss, shift_routes, stale_old_logprobs

from axrl_spike_replay.diagnosis.diagnose import Diagnosis, diagnose_snapshot
from axrl_spike_replay.diagnosis.families import FAMILIES
from axrl_spike_replay.diagnosis.suggestions.no_ops import no_op_reason
from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.routing_config import RoutingConfig


def _check_suggestions(d: Diagnosis) -> None:
    """Every family is of the shared vocabulary; every suggestion parses and changes the run's config."""
    for cause in d.causes:
        assert cause.family in FAMILIES
        assert 0.0 <= cause.strength <= 1.0
    for item in d.mitigation_items():
        parse_mitigation_args([item])


def test_stale_old_log_probs_on_one_rank_are_named_with_their_rank(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    set_loss(snapshot, is_base_logprobs="old")
    stale_old_logprobs(snapshot, rank=1)
    d = diagnosed(snapshot, model="always")
    top = d.top
    assert top.family == "stale_old_logprobs" and top.ranks == [1] and top.strength == 1.0
    assert top.term == "policy"
    assert any("old agrees with the replay on rank 0" in line for line in top.evidence)  # the rank witness
    assert any("rollout agrees with the replay on rank 1" in line for line in top.evidence)  # the signal witness
    items = d.mitigation_items()
    assert items[:2] == ["recompute=old_logprobs:rank1", "drop_ranks=1"]
    assert "is_base_logprobs=rollout" in items and "is_base_logprobs=old" not in items  # old is already the base
    assert d.reading is not None and [o.signal for o in d.reading.odd] == ["old"]
    _check_suggestions(d)


def test_stale_old_log_probs_that_the_loss_never_reads_are_not_the_cause(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)  # the ratio stays against the rollout log-probs
    stale_old_logprobs(snapshot, rank=1)
    d = diagnosed(snapshot, model="always")
    stale = next(c for c in d.causes if c.family == "stale_old_logprobs")
    assert stale.strength < 0.3 and d.top.family == "natural_spike"
    assert any("do not enter this run's loss" in line for line in stale.evidence)


def test_a_shifted_routing_payload_on_one_rank_is_a_routing_payload_fault_not_a_log_prob_mismatch(
    tmp_path: Path,
) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    shift_routes(snapshot, rank=1)
    d = diagnosed(snapshot, model="always")
    top = d.top
    assert top.family == "routing_payload" and top.ranks == [1] and top.strength == 1.0
    assert any("agree with the model's own routing" in line for line in top.evidence)
    assert {c.family for c in d.causes if c.strength >= 0.3} == {"routing_payload"}
    assert d.mitigation_items()[0] == "recompute=routes:rank1,old_logprobs:rank1"
    assert "routing_replay=off" not in d.mitigation_items()  # no test of the payload (see its why)
    _check_suggestions(d)


def test_a_wrong_reference_on_one_rank_is_named_and_the_kl_term_carries_it(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    set_loss(snapshot, kl_coef=0.1, entropy_coef=0.01)
    # rank 1's reference taken from another sample's tokens, and 8 nats too high on some: k3's exp(ref - logp)
    edit_batch(snapshot, 1, lambda b: b.__setitem__("ref_logprobs", b["ref_logprobs"].roll(1, dims=0) + 8.0))
    d = diagnosed(snapshot, model="always")
    top = d.top
    assert top.family == "bad_ref_logprobs" and top.ranks == [1] and top.strength == 1.0
    assert top.term == "kl" and d.step is not None and d.step.channel is not None
    kl = d.step.channel.term("kl")
    assert kl is not None and kl.share > 0.5
    rank1 = next(x for x in kl.ranks if x.rank == 1)
    assert rank1.share > 0.9 * kl.share  # rank 1's KL carries it
    channel = d.step.channel
    assert {t.term for t in channel.terms} == {"policy", "kl", "entropy", "aux", "z"}
    assert channel.sum_rel_error < 1e-5  # the terms' gradients add up to the loss's own
    assert sum(t.share for t in channel.terms) == pytest.approx(1.0, abs=1e-5)
    assert sum(x.share for t in channel.terms for x in t.ranks) == pytest.approx(1.0, abs=1e-5)
    assert kl.top_tokens and all(t["rank"] == 1 for t in kl.top_tokens)  # through rank 1's tokens
    items = d.mitigation_items()
    assert items[0] == "drop_ranks=1" and "kl_estimator=k2" in items and "kl_clamp=10" in items
    _check_suggestions(d)


def test_a_loss_mask_shifted_into_the_prompt_is_a_mask_fault_not_three_bad_signals(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)

    def response_only(b: dict[str, torch.Tensor]) -> None:  # as trainers that keep log-probs for the response only
        for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
            b[name] = b[name] * b["loss_mask"]

    for rank in (0, 1):
        edit_batch(snapshot, rank, response_only)
    edit_batch(snapshot, 1, lambda b: b.__setitem__("loss_mask", b["loss_mask"].roll(-3, dims=-1)))
    d = diagnosed(snapshot, model="always")
    assert d.top.family == "mask_misalignment" and d.top.ranks == [1]
    assert not {"stale_old_logprobs", "bad_ref_logprobs", "engine_mismatch"} & {c.family for c in d.causes}
    _check_suggestions(d)


def test_the_engine_mismatch_spread_over_ranks_is_separated_from_stale_old_log_probs_by_the_replay(
    tmp_path: Path,
) -> None:
    snapshot = copy_fixture(tmp_path)  # the capture's own fault: rollout log-probs at the wrong temperature
    never = diagnose_snapshot(snapshot, model="never")
    assert never.top.family == "engine_mismatch" and never.top.tied_with == ["stale_old_logprobs"]
    assert never.top.strength <= 0.7  # two families fit the batch alone: neither at full strength
    # the mask measures π/π_rollout, which the batch alone does not give: not suggested on old-vs-rollout figures
    assert not any(item.startswith("ratio_outlier_mask") for item in never.mitigation_items())
    d = diagnosed(snapshot, model="always")
    assert d.top.family == "engine_mismatch" and d.top.strength == 1.0 and d.top.ranks == []
    assert "stale_old_logprobs" not in {c.family for c in d.causes}
    mask = next(e for e in d.next_steps if e.mitigation == "ratio_outlier_mask=token")
    # the figure it quotes is what the mask measures: current vs rollout at the snapshot's weights
    assert d.step is not None
    pairs = [r.pairs["current_vs_rollout"] for r in d.step.signals.ranks]
    measured = sum(p.outside * p.tokens for p in pairs) / sum(p.tokens for p in pairs)
    assert f"{100 * measured:.1f} % of loss tokens" in mask.why
    masked = run_replay(
        replay_request(What(snapshot, mitigations={"ratio_outlier_mask": "token"}), how=How(nproc=1))
    ).footprint
    assert masked is not None and masked.masked_token_fraction == pytest.approx(measured, abs=1e-9)


def test_a_clean_step_has_every_stored_signal_agreeing_and_is_a_natural_spike(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    d = diagnosed(snapshot, model="always")
    assert d.top.family == "natural_spike" and d.top.strength == 0.5
    assert "every stored signal agrees with the replay on every rank" in d.top.evidence
    assert d.reading is not None and d.reading.odd == []


@pytest.mark.parametrize(
    ("item", "loss", "routing", "why"),
    [
        ("is_base_logprobs=old", {}, {}, "as it is"),
        ("is_base_logprobs=rollout", {"is_base_logprobs": "rollout"}, {}, "as it is"),
        ("kl_estimator=k2", {"kl_coef": 0.0}, {}, "no KL term"),
        ("kl_clamp=10", {"kl_coef": 0.0}, {}, "no KL term"),
        ("routing_replay=all", {}, {"replay": "all"}, "as it is"),
        ("current_routing_layers=1", {}, {"replay": "off"}, "routing replay off"),
        ("current_routing_layers=1", {}, {"replay": "all"}, None),
        ("kl_estimator=k2", {"kl_coef": 0.1}, {}, None),
        ("is_base_logprobs=rollout", {}, {}, None),
        ("drop_ranks=1", {}, {}, None),
    ],
)
def test_a_suggestion_that_would_change_nothing_is_named_a_no_op(
    item: str, loss: dict[str, object], routing: dict[str, object], why: str | None
) -> None:
    reason = no_op_reason(item, LossConfig(**loss), RoutingConfig(**routing))  # type: ignore[arg-type]
    assert (reason is None) if why is None else (reason is not None and why in reason)


def test_the_shared_vocabulary_is_what_diagnose_names() -> None:
    from axrl_spike_replay.diagnosis import FAMILIES as EXPORTED
    from axrl_spike_replay.diagnosis.diagnose import RULES

    assert EXPORTED == FAMILIES and len(set(FAMILIES)) == 11
    assert {rule.__name__ for rule in RULES} | {"natural_spike"} == set(FAMILIES)
    # the fault presets (a lower floor, so a copy of their own) plant exactly these families
    from axrl_spike_replay.capture.reference import presets

    assert tuple(getattr(presets, "FAULT_FAMILIES", FAMILIES)) == FAMILIES


def test_two_broken_parts_each_with_a_witness_are_both_named_at_full_strength(tmp_path: Path) -> None:
    """The capture's engine mismatch (every rank) and stale old log-probs on rank 1 (the ratio against them under
    truncated IS): two broken parts, each separated by its own witness, not two readings of one."""
    snapshot = copy_fixture(tmp_path)
    set_loss(snapshot, is_base_logprobs="old", mismatch_token_clip_max=2.0)
    stale_old_logprobs(snapshot, rank=1)
    d = diagnosed(snapshot, model="always")
    strong = {c.family: c for c in d.causes if c.strength == 1.0}
    assert set(strong) == {"engine_mismatch", "stale_old_logprobs"}
    assert strong["stale_old_logprobs"].ranks == [1] and strong["engine_mismatch"].ranks == []
    assert all(not c.tied_with for c in strong.values())


def _drift_reference(snapshot: Path, nats: float = 1.5) -> None:
    """Every rank's reference as a model the policy has moved away from (what the KL term bounds): the stored
    values are right for that model, the distance to the replay is alike on every rank."""
    for rank in (0, 1):
        generator = torch.Generator().manual_seed(rank)

        def drift(b: dict[str, torch.Tensor], g: torch.Generator = generator) -> None:
            ref = b["ref_logprobs"]
            noise = torch.randn(ref.shape, generator=g, dtype=ref.dtype)
            b["ref_logprobs"] = (ref - nats + 0.5 * noise).clamp(max=0.0)

        edit_batch(snapshot, rank, drift)


def test_a_reference_the_policy_drifted_from_alike_on_every_rank_is_not_a_broken_reference(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    set_loss(snapshot, kl_coef=0.1)
    _drift_reference(snapshot)
    d = diagnosed(snapshot, model="always")
    ref = next(c for c in d.causes if c.family == "bad_ref_logprobs")
    assert ref.strength < 0.3 and ref.ranks == []  # old and rollout agreeing on a rank is no witness against a drift
    assert d.top.family == "natural_spike" and d.top.strength >= 0.3  # a drift singles out no broken part
    assert any("no stored signal is singled out on a rank (ref off alike" in line for line in d.top.evidence)
    assert "drop_ranks=0" not in d.mitigation_items() and "drop_ranks=1" not in d.mitigation_items()
    assert d.reading is not None
    odd = d.reading.odd_signal("ref")
    assert odd is not None and odd.spread and not odd.separated
    _check_suggestions(d)


def test_a_mask_shifted_on_one_rank_is_not_read_as_a_wrong_reference_on_the_healthy_rank(tmp_path: Path) -> None:
    """The reference drifted alike on both ranks; rank 1's mask shifted into the prompt. Leaving the mask-broken
    rank out of the comparison must not leave the healthy rank's drift standing alone as a 'wrong reference'."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    set_loss(snapshot, kl_coef=0.1)
    _drift_reference(snapshot)

    def response_only(b: dict[str, torch.Tensor]) -> None:  # as trainers that keep log-probs for the response only
        for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
            b[name] = b[name] * b["loss_mask"]

    for rank in (0, 1):
        edit_batch(snapshot, rank, response_only)
    edit_batch(snapshot, 1, lambda b: b.__setitem__("loss_mask", b["loss_mask"].roll(-3, dims=-1)))
    d = diagnosed(snapshot, model="always")
    assert d.top.family == "mask_misalignment" and d.top.ranks == [1]
    likely = {c.family for c in d.causes if c.strength >= 0.3}
    assert "bad_ref_logprobs" not in likely and "one_rank_data" not in likely
    assert "drop_ranks=0" not in d.mitigation_items()  # the healthy rank is no suspect
    _check_suggestions(d)


def test_a_reference_wrong_on_one_rank_whose_kl_term_the_loss_barely_reads_is_not_the_cause(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    set_loss(snapshot, kl_coef=1e-6)
    edit_batch(snapshot, 1, lambda b: b.__setitem__("ref_logprobs", b["ref_logprobs"].roll(1, dims=0) + 8.0))
    d = diagnosed(snapshot, model="always")
    ref = next(c for c in d.causes if c.family == "bad_ref_logprobs")
    assert ref.ranks == [1] and ref.strength < 0.3  # singled out on rank 1, but its KL term carries ~nothing
    assert any("barely reads the reference" in line for line in ref.evidence)
    assert d.top.family != "bad_ref_logprobs"


def test_a_dual_clip_that_binds_on_no_token_is_not_suggested(tmp_path: Path) -> None:
    """Every advantage negative, the ratio against the old log-probs 1 on every token (the replay is on-policy):
    the dual clip caps only tokens whose ratio exceeds c, so it would change nothing and is not suggested."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    set_loss(snapshot, is_base_logprobs="old")
    for rank in (0, 1):
        edit_batch(snapshot, rank, lambda b: b.__setitem__("advantages", -b["advantages"].abs() - 0.5))
    d = diagnosed(snapshot, model="always")
    cause = next(c for c in d.causes if c.family == "negative_advantage_dominance")
    assert cause.strength == 1.0
    assert not any(e.mitigation.startswith("dual_clip_c") for e in cause.experiments)
    assert any("dual_clip_c=3 would change nothing" in line for line in cause.evidence)
    # the claim is the replay's: the dual clip leaves the gradient as it is
    base = run_replay(replay_request(What(snapshot), how=How(nproc=1))).grad_norm
    clipped = run_replay(replay_request(What(snapshot, mitigations={"dual_clip_c": 3.0}), how=How(nproc=1))).grad_norm
    assert clipped == pytest.approx(base, rel=1e-6)


def test_a_rank_whose_per_parameter_norms_overflowed_under_a_finite_global_norm_is_no_non_finite_fault(
    tmp_path: Path,
) -> None:
    """A gradient of 1e30 is finite, but its float32 per-parameter norm overflows to inf. The recorded global norm
    (the DP-reduced gradient, which holds every rank's) is finite, so no rank's gradient was non-finite: the
    overflowed norm is not a finding, and the step's finite inputs name no non-finite cause."""
    import json

    from snapshot_edits import edit_grad_info

    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    meta_path = snapshot / "axrl_metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["grad_norm"], meta["spike_ratio"] = 1e30, 1e30 / meta["median_norm"]  # as the capture's float64 norm
    meta_path.write_text(json.dumps(meta))

    def overflow(info: dict[str, object]) -> None:
        norms = info["param_grad_norms"]
        assert isinstance(norms, dict)
        norms[next(iter(norms))] = float("inf")

    edit_grad_info(snapshot, 1, overflow)
    d = diagnose_snapshot(snapshot, model="never")
    assert "non_finite" not in {c.family for c in d.causes}


def _truncate_mask(snapshot: Path, rank: int, keep: int) -> None:
    """Rank `rank`'s loss mask cut after each sample's first `keep` loss tokens; every stored signal left as it is
    (the engine generated the rest and scored it; the loss leaves it out)."""

    def edit(b: dict[str, torch.Tensor]) -> None:
        mask = b["loss_mask"]
        b["loss_mask"] = mask * (mask.cumsum(dim=-1) <= keep).to(mask.dtype)

    edit_batch(snapshot, rank, edit)


def test_a_loss_mask_truncated_on_one_rank_with_nothing_else_out_of_line_is_a_mask_fault(tmp_path: Path) -> None:
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    _truncate_mask(snapshot, rank=1, keep=2)
    d = diagnosed(snapshot, model="always")
    top = d.top
    assert top.family == "mask_misalignment" and top.ranks == [1] and top.strength > 0.5
    assert any("the loss mask stops before the last token the engine generated" in line for line in top.evidence)
    assert d.reading is not None and d.reading.truncated == [1]
    assert d.reading.tails[1][0] == 1.0 and d.reading.tails[0][0] == 0.0
    assert "drop_ranks=1" in d.mitigation_items()
    assert "one_rank_data" not in {c.family for c in d.causes if c.strength >= 0.3}
    _check_suggestions(d)


def test_masks_that_stop_short_alike_on_every_rank_single_out_no_rank(tmp_path: Path) -> None:
    """Every rank's loss leaves the same tail out (a last turn the run never trains on): the run's own masking."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    for rank in (0, 1):
        _truncate_mask(snapshot, rank=rank, keep=4)
    d = diagnosed(snapshot, model="always")
    assert d.reading is not None and d.reading.truncated == [] and d.reading.tails[0][0] == 1.0
    assert "mask_misalignment" not in {c.family for c in d.causes}


def test_a_reference_off_alike_by_level_but_whose_kl_term_carries_the_spike_on_one_rank_is_named_there(
    tmp_path: Path,
) -> None:
    """Every rank's reference drifted alike from the policy; rank 1's reference worker also scored a third of its
    tokens with an over-confident model (log-prob -0.05). By level the reference is off alike on both ranks, but
    k3's exp(ref - log π) makes rank 1's KL term carry the gradient while its data is as likely to the policy: the
    per-rank channel singles its reference out."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    set_loss(snapshot, kl_coef=1.0)
    _drift_reference(snapshot)
    g = torch.Generator().manual_seed(1)

    def confident(b: dict[str, torch.Tensor]) -> None:
        ref = b["ref_logprobs"]
        hit = torch.rand(ref.shape, generator=g) < 0.3
        b["ref_logprobs"] = torch.where(hit, torch.full_like(ref, -0.05), ref)

    edit_batch(snapshot, 1, confident)
    d = diagnosed(snapshot, model="always")
    assert d.reading is not None
    levels = d.reading.levels["ref"]
    assert levels[1].level < 3 * levels[0].level  # the stored values alone do not separate it
    top = d.top
    assert top.family == "bad_ref_logprobs" and top.ranks == [1] and top.strength >= 0.9 and top.term == "kl"
    assert any("the KL term on rank 1 carries" in line for line in top.evidence)
    items = d.mitigation_items()
    assert items[0] == "drop_ranks=1" and "kl_estimator=k2" in items
    _check_suggestions(d)


def test_a_reward_on_another_scale_is_an_outlier_beside_a_group_whose_one_right_answer_reads_as_z_12(
    tmp_path: Path,
) -> None:
    """Rank 1's verifier returned one reward x100 (advantage 106); on rank 0 one GRPO group holds a lone right
    answer whose robust z (12) also passes the threshold. Two past it is not "a few" of 16, but one stands 250x
    beyond the other: that one is the outlier."""
    snapshot = copy_fixture(tmp_path)
    no_mismatch(snapshot)
    advantages = {
        0: [-0.032, -0.064, 0.124, -0.032, -0.032, -0.001, -0.032, -0.032],
        1: [0.03, -0.001, 0.03, 106.186, -0.064, -0.001, 0.03, -0.032],
    }
    for rank, values in advantages.items():

        def edit(b: dict[str, torch.Tensor], values: list[float] = values) -> None:
            b["advantages"] = torch.tensor(values, dtype=b["advantages"].dtype).reshape(b["advantages"].shape)
            b["group_index"] = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])

        edit_batch(snapshot, rank, edit)
    d = diagnose_snapshot(snapshot, model="never")
    cause = next((c for c in d.causes if c.family == "outlier_advantage"), None)
    assert cause is not None and cause.figures["samples"] == [[1, 3]]
    assert d.top.family == "outlier_advantage"
