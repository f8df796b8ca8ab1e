"""The newer policy objectives under the verl and axrl conventions (`loss.policy_loss_mode`: gspo, cispo, sapo)
against verl 0.9.1's own registered policy losses, run end to end by its `ppo_loss` with
`policy_loss.loss_mode` set, on the same float64 rank batches as the verl cross-check (verl_cases.py): every
aggregation, both normalisations, asymmetric clips, SAPO's temperatures, with verl's rollout correction, KL and
entropy terms. Loss and gradient agree within 1e-6 relative on each rank, over 5 seeds.

Under `verl` the batches keep their log-ratios past verl's clamps (+-20 on the token ratio; GSPO's combined ratio
above 10 is reached by a planted sequence), which the convention reproduces. Under `axrl` the same objectives carry
no clamp of their own, so they are checked against verl on the same batches with every log-ratio within the clamps
(there the two are the same function), and shown to differ where a clamp bites.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from verl_cases import DP, Case, compare, rank_batch

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.training.loss_config import LossConfig

TOLERANCE = 1e-6
SEEDS = (0, 1, 2, 3, 4)


@pytest.fixture(scope="module")
def verl() -> dict[str, Any]:
    from verl_peer import load_verl, skip_unless_installed

    skip_unless_installed()
    peer = load_verl()
    assert peer["version"] == "0.9.1"
    return peer


def _case(objective: str, **kwargs: Any) -> Case:
    ours = {"policy_loss_mode": objective, **kwargs.pop("ours", {})}
    return Case(ours, loss_mode=objective, **kwargs)


def _cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for mode in ("gspo", "cispo", "sapo"):
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
            cases[f"{mode} {agg} global"] = _case(mode, mode=agg)
        cases[f"{mode} token-mean per_rank"] = _case(mode, normalization="per_rank")
        cases[f"{mode} clip 0.2/0.28"] = _case(mode, ours={"clip_eps_high": 0.28}, clip=(0.2, 0.28))
        cases[f"{mode} token TIS 2"] = _case(
            mode, ours={"rollout_is": "token", "rollout_is_threshold": 2.0}, rollout_is=("token", 2.0)
        )
        cases[f"{mode} RS seq_mean_k3 + KL k3 + entropy"] = _case(
            mode,
            mode="seq-mean-token-mean",
            ours={"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.5, "kl_coef": 0.05, "entropy_coef": 0.01},
            rollout_rs=("seq_mean_k3", 0.5),
            kl=("k3", 0.05),
            entropy_coeff=0.01,
        )
    cases["cispo clip 1.0/4.0 (weights capped at 5 only)"] = _case(
        "cispo", ours={"clip_eps_low": 1.0, "clip_eps_high": 4.0}, clip=(1.0, 4.0)
    )
    cases["sapo temperatures 0.5/2"] = _case("sapo", ours={"sapo_tau_pos": 0.5, "sapo_tau_neg": 2.0}, taus=(0.5, 2.0))
    cases["gspo sequence TIS 5"] = _case(
        "gspo", ours={"rollout_is": "sequence", "rollout_is_threshold": 5.0}, rollout_is=("sequence", 5.0)
    )
    return cases


CASES = _cases()


def _past_gspo_clamp(seed: int) -> list[dict[str, torch.Tensor]]:
    """The cross-check's batches with one more sequence whose mean log-ratio is past GSPO's clamp at 10."""
    ranks = [rank_batch(r, seed) for r in range(DP)]
    # rank 1's row 6 is one token long: a log-ratio of +12 is its sequence's mean; a negative advantage leaves its
    # ratio unclipped (PPO's max picks -A * ratio), so the clamp decides its loss
    ranks[1]["old_log_probs"][6, 0] = ranks[1]["log_probs"][6, 0] - 12.0
    ranks[1]["advantages"][6] = -ranks[1]["advantages"][6].abs() - 0.5
    return ranks


def _within_clamps(seed: int) -> list[dict[str, torch.Tensor]]:
    """The cross-check's batches with every log-ratio within +-5 (verl's clamps never bite)."""
    ranks = [rank_batch(r, seed) for r in range(DP)]
    for r in ranks:
        r["old_log_probs"] = r["log_probs"] + (r["old_log_probs"] - r["log_probs"]).clamp(-5.0, 5.0)
        r["rollout_log_probs"] = r["old_log_probs"] + (r["rollout_log_probs"] - r["old_log_probs"]).clamp(-5.0, 5.0)
    return ranks


@pytest.mark.parametrize("name", list(CASES))
def test_the_verl_convention_matches_verls_own_policy_loss(name: str, verl: dict[str, Any]) -> None:
    for seed in SEEDS:
        for ranks in (None, _past_gspo_clamp(seed)):
            figures = compare(CASES[name], verl, seed, ranks)
            assert figures["loss_rel"] <= TOLERANCE, (seed, figures)
            assert figures["grad_rel"] <= TOLERANCE, (seed, figures)


def _as_axrl(case: Case) -> Case:
    """The case under convention axrl. axrl's SAPO aggregates by loss_agg_mode (verl's always takes
    seq-mean-token-mean), so the case names it; and axrl's global sequence count leaves out empty responses where
    verl's counts them (the normalisation's own difference, tests/replay/test_global_normalization_replay.py), so a
    sequence-mean case is taken per rank."""
    ours = {**case.ours, "convention": "axrl"}
    if case.loss_mode == "sapo":
        ours["loss_agg_mode"] = "seq-mean-token-mean"
        case = replace(case, mode="seq-mean-token-mean")
    if case.mode != "token-mean":
        ours["normalization"] = "per_rank"
        case = replace(case, normalization="per_rank")
    return replace(case, ours=ours)


AXRL_CASES = [n for n, c in CASES.items() if "rollout_rs" not in c.ours and "sum-norm" not in n]


@pytest.mark.parametrize("name", AXRL_CASES)
def test_the_axrl_convention_is_verls_objective_where_verls_clamps_do_not_bite(name: str, verl: dict[str, Any]) -> None:
    case = _as_axrl(CASES[name])
    for seed in SEEDS:
        figures = compare(case, verl, seed, _within_clamps(seed))
        assert figures["loss_rel"] <= TOLERANCE, (seed, figures)
        assert figures["grad_rel"] <= TOLERANCE, (seed, figures)


def test_the_batches_reach_gspos_clamp_and_the_axrl_convention_has_none(verl: dict[str, Any]) -> None:
    """Where GSPO's clamp at 10 bites, axrl (unclamped) and verl differ; the verl convention matches verl there (the
    first test). CISPO's and SAPO's +-20 clamp cannot show: past e^20 CISPO's weight is clipped and SAPO's gate is
    1 (to float64 precision) either way."""
    for seed in SEEDS:
        axrl = compare(_as_axrl(CASES["gspo token-mean per_rank"]), verl, seed, _past_gspo_clamp(seed))
        assert axrl["loss_rel"] > 1e-2 and axrl["grad_rel"] > 1e-2, (seed, axrl)


def test_each_objective_changes_the_loss_on_these_batches(verl: dict[str, Any]) -> None:
    vanilla = compare(Case({}), verl, 0)["verl"]
    for mode in ("gspo", "cispo", "sapo"):
        assert abs(compare(_case(mode), verl, 0)["verl"] - vanilla) > 1e-3 * abs(vanilla), mode
    default = compare(_case("sapo"), verl, 0)["verl"]
    assert abs(compare(CASES["sapo temperatures 0.5/2"], verl, 0)["verl"] - default) > 1e-3 * abs(default)


@pytest.mark.parametrize("convention", ["axrl", "verl"])
def test_settings_the_objectives_do_not_read_are_refused_naming_why(convention: str) -> None:
    with pytest.raises(ConfigError, match=r"dual_clip_c has no meaning with policy_loss_mode gspo"):
        LossConfig(convention=convention, policy_loss_mode="gspo", dual_clip_c=3.0)
    with pytest.raises(ConfigError, match=r"policy_loss_mode must be one of"):
        LossConfig(convention=convention, policy_loss_mode="vespo")
    with pytest.raises(ConfigError, match=r"sapo_tau_neg must be a finite number > 0"):
        LossConfig(convention=convention, policy_loss_mode="sapo", sapo_tau_neg=0.0)


def test_under_the_trl_convention_the_objective_is_trls_own_setting() -> None:
    with pytest.raises(ConfigError, match=r"policy_loss_mode has no meaning under convention trl.*loss_type"):
        LossConfig(convention="trl", policy_loss_mode="cispo")
    with pytest.raises(ConfigError, match=r"sapo_tau_pos has no meaning under convention trl.*sapo_temperature"):
        LossConfig(convention="trl", sapo_tau_pos=2.0)
