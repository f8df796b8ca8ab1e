"""An engineer analyses a spike's batch: where the rollout/train mismatch and the large advantages sit,
on any RL stack's field names, and what is missing when a stack does not save a field."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.analysis.batch_signals import analyze_snapshot
from axrl_spike_replay.errors import UnsafeFileError
from axrl_spike_replay.testing.synthetic_snapshot import OUTLIER_ADVANTAGE, OUTLIER_LOG_RATIO


def test_planted_outliers_are_found_with_where_they_sit(synthetic) -> None:
    result = analyze_snapshot(synthetic(), top=3)

    top_token = result.outliers["tokens_by_abs_log_ratio_old_vs_rollout"][0]
    assert (top_token["rank"], top_token["sample"], top_token["position"], top_token["turn"]) == (1, 2, 9, 1)
    assert top_token["log_ratio_old_vs_rollout"] == pytest.approx(OUTLIER_LOG_RATIO, abs=1e-5)
    assert top_token["ratio_old_vs_rollout"] == pytest.approx(math.exp(OUTLIER_LOG_RATIO), rel=1e-4)
    assert isinstance(top_token["token_id"], int)
    top_sample = result.outliers["samples_by_abs_advantage"][0]
    assert (top_sample["rank"], top_sample["sample"], top_sample["advantage"]) == (0, 1, OUTLIER_ADVANTAGE)
    adv_token = result.outliers["tokens_by_abs_advantage"][0]
    assert (adv_token["rank"], adv_token["sample"], adv_token["advantage"]) == (0, 1, OUTLIER_ADVANTAGE)
    assert result.outliers["samples_by_abs_log_ratio_old_vs_rollout"][0]["position"] == 9
    assert all(len(v) == 3 for v in result.outliers.values())
    assert result.missing == []


def test_summary_statistics_and_sign_balance_match_the_batch(synthetic) -> None:
    snap = synthetic()
    result = analyze_snapshot(snap)
    advs, masks, lrs = [], [], []
    for rank in (0, 1):
        batch = torch.load(snap / f"batch_rank{rank}.pt", weights_only=True)
        mask = batch["loss_mask"] != 0
        advs.append(batch["advantages"][:, None].expand_as(mask)[mask].double())
        lrs.append((batch["old_logprobs"] - batch["rollout_logprobs"])[mask].double())
        masks.append(mask)
    adv, lr = torch.cat(advs), torch.cat(lrs)

    assert result.samples["count"] == 8 and result.tokens["loss_tokens"] == int(sum(m.sum() for m in masks))
    assert result.samples["loss_tokens"]["min"] == 6 and result.samples["loss_tokens"]["max"] == 10
    assert result.ratio_old_vs_rollout["log_ratio"]["max"] == pytest.approx(float(lr.max()))
    assert result.ratio_old_vs_rollout["abs_log_ratio"]["mean"] == pytest.approx(float(lr.abs().mean()))
    balance = result.sign_balance
    assert balance["positive_total"] == pytest.approx(float(adv.clamp(min=0).sum()))
    assert balance["negative_total"] == pytest.approx(float((-adv).clamp(min=0).sum()))
    assert balance["dominant"] == "negative" and balance["negative_to_positive"] > 1
    assert result.tokens["per_turn"] == {1: 40, 2: 32}
    assert result.rewards["mean"] == pytest.approx(0.5)
    routing = result.routing
    assert routing["available"] and routing["moe_layers"] == [0, 1]
    for layer, load in routing["expert_load"].items():
        routed = sum(r["routed_tokens"][layer] for r in routing["per_rank"])
        assert sum(load) == routed * 2  # top-2 routing: two experts per routed token


def test_golden_capture_agrees_with_a_direct_computation(golden_snapshot: Path, cli) -> None:
    run = cli("analyze", golden_snapshot, "--top", "4", "--json")
    assert run.code == 0
    doc = run.json()
    assert set(doc) >= {"samples", "tokens", "ratio_old_vs_rollout", "advantages", "sign_balance", "outliers"}
    best = (-1.0, None)
    for rank in (0, 1):
        batch = torch.load(golden_snapshot / f"batch_rank{rank}.pt", weights_only=True)
        lr = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs() * (batch["loss_mask"] != 0)
        flat = int(lr.argmax())
        if float(lr.max()) > best[0]:
            best = (float(lr.max()), (rank, flat // lr.shape[1], flat % lr.shape[1]))
    top = doc["outliers"]["tokens_by_abs_log_ratio_old_vs_rollout"][0]
    assert (top["rank"], top["sample"], top["position"]) == best[1]
    assert abs(top["log_ratio_old_vs_rollout"]) == pytest.approx(best[0], rel=1e-5)
    assert len(doc["outliers"]["tokens_by_abs_log_ratio_old_vs_rollout"]) == 4


def test_verl_field_names_give_the_same_analysis(synthetic) -> None:
    canonical = analyze_snapshot(synthetic("canonical"), top=5)
    verl = analyze_snapshot(synthetic("verl"), top=5)

    assert verl.fields == {
        "tokens": "input_ids",
        "loss_mask": "response_mask",
        "advantages": "advantages",
        "old_logprobs": "old_log_probs",
        "ref_logprobs": "ref_log_prob",
        "rollout_logprobs": "rollout_log_probs",
        "rewards": "token_level_rewards",
    }
    where = ("rank", "sample", "position", "token_id", "log_ratio_old_vs_rollout")
    for key in (
        "tokens_by_abs_log_ratio_old_vs_rollout",
        "samples_by_abs_log_ratio_old_vs_rollout",
        "samples_by_abs_advantage",
    ):
        assert [[r[k] for k in where if k in r] for r in verl.outliers[key]] == [
            [r[k] for k in where if k in r] for r in canonical.outliers[key]
        ], key
    assert verl.sign_balance["positive_total"] == pytest.approx(canonical.sign_balance["positive_total"])
    assert verl.sign_balance["negative_total"] == pytest.approx(canonical.sign_balance["negative_total"])
    assert verl.rewards["mean"] == pytest.approx(canonical.rewards["mean"])
    assert verl.advantages["per_token"] is True
    assert verl.missing == []  # verl's batches are single-turn: no turn_index is no gap


def test_openrlhf_names_without_rollout_logprobs_say_what_is_missing(synthetic, cli) -> None:
    snap = synthetic("openrlhf")
    result = analyze_snapshot(snap)

    assert result.fields["tokens"] == "sequences" and result.fields["loss_mask"] == "action_mask"
    assert result.fields["old_logprobs"] == "action_log_probs"
    assert result.fields["ref_logprobs"] == "base_action_log_probs"
    assert result.ratio_old_vs_rollout["available"] is False
    assert result.outliers["tokens_by_abs_log_ratio_old_vs_rollout"] == []
    assert any(m.startswith("rollout_logprobs") and "no rollout-vs-old importance ratio" in m for m in result.missing)
    assert any(m.startswith("rewards") for m in result.missing)
    assert result.outliers["samples_by_abs_advantage"][0]["advantage"] == OUTLIER_ADVANTAGE
    assert result.logprobs["old_vs_ref_kl_k3"] is not None
    out = cli("analyze", snap).out
    assert "missing: rollout_logprobs" in out and "top tokens by |advantage|" in out


def test_the_reference_trainers_single_turn_batch_misses_nothing(golden_snapshot: Path, tmp_path: Path) -> None:
    """`turn_index` is optional: a batch with none on any rank is single-turn, not missing a field; one that has it
    on some ranks only is still reported."""
    assert "turn_index" not in torch.load(golden_snapshot / "batch_rank0.pt", weights_only=True)
    assert analyze_snapshot(golden_snapshot).missing == []
    snap = tmp_path / golden_snapshot.name
    shutil.copytree(golden_snapshot, snap)
    batch = torch.load(snap / "batch_rank0.pt", weights_only=True)
    batch["turn_index"] = torch.zeros_like(batch["loss_mask"], dtype=torch.long)
    torch.save(batch, snap / "batch_rank0.pt")
    assert [m.split(" (")[0] + m.split(")")[1].split(":")[0] for m in analyze_snapshot(snap).missing] == [
        "turn_index not found on ranks [1]"
    ]


def test_a_batch_without_advantages_or_routing_still_analyses(synthetic, tmp_path: Path) -> None:
    snap = tmp_path / "iter_0000042"
    shutil.copytree(synthetic(), snap)
    for rank in (0, 1):
        batch = torch.load(snap / f"batch_rank{rank}.pt", weights_only=True)
        del batch["advantages"]
        torch.save(batch, snap / f"batch_rank{rank}.pt")
        (snap / f"routing_payload_rank{rank}.pt").unlink()

    result = analyze_snapshot(snap)

    assert result.advantages is None and result.sign_balance is None
    assert result.outliers["tokens_by_abs_advantage"] == []
    assert result.outliers["tokens_by_abs_log_ratio_old_vs_rollout"][0]["advantage"] is None
    assert any(m.startswith("advantages") for m in result.missing)
    assert any(m.startswith("routing payloads") for m in result.missing)
    assert result.routing["available"] is False


def test_micro_batches_are_flattened(synthetic, tmp_path: Path) -> None:
    snap = tmp_path / "iter_0000042"
    shutil.copytree(synthetic(), snap)
    for rank in (0, 1):
        batch = torch.load(snap / f"batch_rank{rank}.pt", weights_only=True)
        halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
        torch.save({"micro_batches": halves}, snap / f"batch_rank{rank}.pt")
    top = analyze_snapshot(snap).outliers["tokens_by_abs_log_ratio_old_vs_rollout"][0]
    assert (top["rank"], top["sample"], top["position"]) == (1, 2, 9)


def test_a_malicious_batch_is_refused_and_nothing_runs(synthetic, tmp_path: Path, cli, write_malicious_pt) -> None:
    snap = tmp_path / "iter_0000042"
    shutil.copytree(synthetic(), snap)
    marker = tmp_path / "pwned"
    write_malicious_pt(snap / "batch_rank1.pt", marker)

    with pytest.raises(UnsafeFileError, match=r"batch_rank1\.pt: refused to load"):
        analyze_snapshot(snap)
    run = cli("analyze", snap)
    assert run.code == 2 and "batch_rank1.pt: refused to load" in run.err and "Traceback" not in run.err
    assert not marker.exists()


def test_readable_summary_leads_with_the_mismatch(synthetic, cli) -> None:
    out = cli("analyze", synthetic(), "--top", "2").out
    lines = out.splitlines()
    assert lines[0].startswith("iteration 42: grad norm 40")
    assert any(line.startswith("old-vs-rollout log-ratio log(pi_old/pi_rollout): max |.| 3") for line in lines)
    assert "sign balance: negative" in out and "top tokens by |log(pi_old/pi_rollout)|" in out
    bad = cli("analyze", synthetic(), "--top", "0")
    assert bad.code == 2 and "--top must be >= 1" in bad.err


def test_non_finite_logprobs_rank_first_and_are_counted(synthetic, tmp_path: Path, cli) -> None:
    snap = tmp_path / "iter_0000042"
    shutil.copytree(synthetic(), snap)
    batch = torch.load(snap / "batch_rank0.pt", weights_only=True)
    batch["rollout_logprobs"][3, 7] = float("nan")
    torch.save(batch, snap / "batch_rank0.pt")

    result = analyze_snapshot(snap, top=2)

    first = result.outliers["tokens_by_abs_log_ratio_old_vs_rollout"][0]
    assert (first["rank"], first["sample"], first["position"], first["log_ratio_old_vs_rollout"]) == (0, 3, 7, None)
    assert result.ratio_old_vs_rollout["log_ratio"]["non_finite"] == 1
    assert result.outliers["samples_by_abs_log_ratio_old_vs_rollout"][0]["sample"] == 3
    run = cli("analyze", snap, "--json")
    assert run.code == 0 and run.json()["ratio_old_vs_rollout"]["log_ratio"]["non_finite"] == 1


@pytest.mark.parametrize(
    ("advantages", "dominant"),
    [
        ([1.0, -0.99999999], "balanced"),
        ([1.0, -1.05], "balanced"),
        ([1.0, -1.2], "negative"),
        ([1.3, -1.0], "positive"),
    ],
)
def test_a_side_dominates_only_by_a_clear_margin(advantages: list[float], dominant: str) -> None:
    from axrl_spike_replay.analysis.batch_signals import _sign_balance

    assert _sign_balance(torch.tensor(advantages, dtype=torch.float64))["dominant"] == dominant
