"""A rank's step micro-batch by micro-batch, against verl 0.9.1's own engine code on the same float64 batches.

verl's side is its installed code end to end: `prepare_micro_batches` (workers/engine/utils.py) splits the rank's
mini-batch (fixed `micro_batch_size_per_gpu`, or `use_dynamic_bsz` with `max_token_len_per_gpu` through
`rearrange_micro_batches` and its Karmarkar-Karp balancing), `ppo_loss` runs on each micro-batch, and the losses'
gradients add up as its FSDP engine's `forward_backward_batch` backpropagates them (no rescaling). Ours is
`training.micro_batches`' plan, each micro-batch cut by `take` and its loss scaled as planned — what the replay's
micro-batch loop (`replay.compute.rank_passes.forward_group`) does around the model.

The batches (verl_cases.rank_batch: responses of 0 to 9 tokens) make the micro-batches uneven in tokens and
sequences, so a per-micro-batch normalisation shows: the flattened rank (one micro-batch) is held to differ from
verl there, and to agree where verl's global counts make the split immaterial.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from verl_cases import BATCH, DP, PROMPT, RESPONSE, Case, _ours_layout, _response_lengths, _unpadded, rank_batch

from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.loss_normalization import GlobalCounts
from axrl_spike_replay.training.micro_batches import MicroBatchSpec, plan_micro_batches, take, token_budget_rows
from axrl_spike_replay.training.policy_loss import local_counts, policy_loss

TOLERANCE = 1e-7
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")
SPLITS = {  # ours, verl's engine knobs
    "fixed 1 (7 micro-batches)": (MicroBatchSpec(split="size", size=1), {"micro_batch_size_per_gpu": 1}),
    "dynamic 20 tokens": (
        MicroBatchSpec(split="token_budget", max_token_len=20),
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 20},
    ),
    "dynamic 30 tokens": (
        MicroBatchSpec(split="token_budget", max_token_len=30),
        {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30},
    ),
}


@pytest.fixture(scope="module")
def verl() -> dict[str, Any]:
    from verl_peer import load_verl, skip_unless_installed

    skip_unless_installed()
    peer = load_verl()
    assert peer["version"] == "0.9.1"
    return peer


def _attention(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.ones(BATCH, PROMPT), (torch.arange(RESPONSE) < lengths[:, None]).float()], 1).long()


def _counts(case: Case, ranks: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    if case.normalization != "global":
        return {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None}  # a rank alone
    tokens = int(sum(int(r["response_mask"].sum()) for r in ranks))
    return {"dp_size": DP, "batch_num_tokens": tokens, "global_batch_size": BATCH * len(ranks)}


def verl_rank(case: Case, ranks: list[dict[str, torch.Tensor]], rank: int, split: dict[str, Any], verl: Any):
    """(loss, d loss / d response logprobs [B, R], rows of each micro-batch) of one rank by verl's engine code."""
    from tensordict import TensorDict
    from verl_peer import ActorConfigStandIn

    r = ranks[rank]
    lengths = _response_lengths(r["response_mask"])
    fields = {
        "prompts": torch.ones(BATCH, PROMPT, dtype=torch.long),
        "responses": torch.ones(BATCH, RESPONSE, dtype=torch.long),
        "input_ids": torch.ones(BATCH, PROMPT + RESPONSE, dtype=torch.long),
        "attention_mask": _attention(lengths),
        "response_mask": r["response_mask"],
        "old_log_probs": r["old_log_probs"],
        "advantages": r["advantages"],
        "row": torch.arange(BATCH),
    }
    data = TensorDict(fields, batch_size=[BATCH])
    utils = verl["engine_utils"]
    utils.tu.assign_non_tensor(data, use_dynamic_bsz=bool(split.get("use_dynamic_bsz")), **_counts(case, ranks))
    if "max_token_len_per_gpu" in split:
        utils.tu.assign_non_tensor(data, max_token_len_per_gpu=split["max_token_len_per_gpu"])
    else:
        utils.tu.assign_non_tensor(data, micro_batch_size_per_gpu=split["micro_batch_size_per_gpu"])
    micro_batches, _ = utils.prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=True)
    grad = torch.zeros(BATCH, RESPONSE, dtype=torch.float64)
    total, rows_of = 0.0, []
    for micro in micro_batches:
        rows = micro["row"].tolist()
        rows_of.append(rows)
        log_probs, positions, on = _unpadded(r["log_probs"][rows], lengths[rows])
        log_probs.requires_grad_(True)
        config = ActorConfigStandIn(
            clip_low=case.clip[0], clip_high=case.clip[1], clip_ratio_c=case.clip_ratio_c, loss_agg_mode=case.mode
        )
        loss, _ = verl["losses"].ppo_loss(config, {"log_probs": log_probs}, micro)
        if not micro["response_mask"].any() and case.normalization != "global":
            # a micro-batch of empty responses, normalised by its own counts: verl's 0/0 is NaN, which our
            # convention makes the 0 it stands for (verl_convention.agg_loss); it adds nothing either way
            assert not torch.isfinite(loss.detach()) or float(loss.detach()) == 0.0
            continue
        loss.backward()  # forward_backward_batch: each micro-batch's loss as it is
        assert log_probs.grad is not None
        part = torch.zeros(len(rows), RESPONSE, dtype=torch.float64)
        part[on] = log_probs.grad[positions]
        grad[rows] += part
        total += float(loss.detach())
    return total, grad, rows_of


def ours_rank(case: Case, ranks: list[dict[str, torch.Tensor]], rank: int, spec: MicroBatchSpec):
    """(loss, d loss / d response logprobs [B, R], rows of each micro-batch) of one rank by our micro-batch plan."""
    cfg = LossConfig(convention="verl", normalization=case.normalization, loss_agg_mode=case.mode)
    batches = [_ours_layout(r) for r in ranks]
    counts = None
    if case.normalization == "global":
        counts = GlobalCounts(
            DP, sum(local_counts(b, cfg)[0] for b in batches), sum(local_counts(b, cfg)[1] for b in batches)
        )
    batch = batches[rank]
    logprobs = batch.pop("logprobs").requires_grad_(True)
    batch.pop("entropy")
    batch["tokens"] = torch.ones(BATCH, PROMPT + RESPONSE, dtype=torch.long)
    batch["attention_mask"] = _attention(_response_lengths(ranks[rank]["response_mask"]))
    plan = plan_micro_batches(batch, spec, cfg.to_dict(), "batch_rank0.pt")
    total = torch.zeros((), dtype=torch.float64)
    for mb in plan:
        part = take(batch, mb)
        total = total + policy_loss(logprobs[list(mb.rows)], part, cfg, counts=counts).loss * mb.scale
    total.backward()
    assert logprobs.grad is not None
    return float(total.detach()), logprobs.grad[:, PROMPT:].clone(), [list(mb.rows) for mb in plan]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.parametrize("normalization", ["global", "per_rank"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", list(SPLITS))
def test_micro_batched_rank_matches_verls_engine(split: str, mode: str, normalization: str, verl: Any) -> None:
    """Every loss_agg_mode, verl's global counts and a rank's own, fixed and dynamic sizes: the same micro-batches
    (verl's balancing, reproduced), the same summed loss and the same gradient, on both ranks."""
    spec, knobs = SPLITS[split]
    case = Case({}, mode=mode, normalization=normalization)
    ranks = [rank_batch(r, seed=1) for r in range(DP)]
    for rank in range(DP):
        loss_v, grad_v, rows_v = verl_rank(case, ranks, rank, knobs, verl)
        loss_o, grad_o, rows_o = ours_rank(case, ranks, rank, spec)
        assert rows_o == rows_v, "the same micro-batches, in verl's order"
        assert len(rows_o) > 1 and len({len(rows) for rows in rows_o}) >= (1 if spec.split == "size" else 2)
        assert abs(loss_o - loss_v) <= TOLERANCE * max(abs(loss_v), 1e-300), (loss_o, loss_v)
        assert _rel(grad_o, grad_v) <= TOLERANCE


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_flattened_rank_differs_from_verl_where_micro_batches_normalise_on_their_own(mode: str, verl: Any) -> None:
    """With a rank's own counts, each of verl's micro-batches is normalised by its own tokens or sequences: the
    flattened rank (the replay before micro-batches) gives another gradient, the micro-batched one verl's. Under
    verl's global counts the split is immaterial, and the flattened rank agrees."""
    ranks = [rank_batch(r, seed=1) for r in range(DP)]
    spec, knobs = SPLITS["dynamic 20 tokens"]
    flat = MicroBatchSpec(split="whole")
    own = Case({}, mode=mode, normalization="per_rank")
    _, grad_v, _ = verl_rank(own, ranks, 0, knobs, verl)
    assert _rel(ours_rank(own, ranks, 0, spec)[1], grad_v) <= TOLERANCE
    assert _rel(ours_rank(own, ranks, 0, flat)[1], grad_v) > 0.05, "flattened: not the trainer's gradient"
    shared = Case({}, mode=mode, normalization="global")
    _, grad_g, _ = verl_rank(shared, ranks, 0, knobs, verl)
    assert _rel(ours_rank(shared, ranks, 0, flat)[1], grad_g) <= TOLERANCE


def test_token_budget_partitions_are_verls_on_many_batches(verl: Any) -> None:
    """Our port of `rearrange_micro_batches` gives verl's own micro-batches (rows and order) on 200 random ranks:
    long and short sequences, budgets from the longest sequence up, balancing on and off, a minimum count."""
    from tensordict import TensorDict

    rearrange = verl["seqlen_balancing"].rearrange_micro_batches
    rng = random.Random(7)
    for _ in range(200):
        size = rng.randint(1, 24)
        lengths = [rng.choice([rng.randint(1, 64), rng.randint(200, 512)]) for _ in range(size)]
        width = max(lengths)
        budget = rng.randint(width, width * 4)
        balance = rng.random() < 0.7
        minimum = rng.choice([None, None, rng.randint(1, size)])
        attention = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        data = TensorDict({"input_ids": torch.ones_like(attention), "attention_mask": attention}, batch_size=[size])
        _, theirs = rearrange(data, budget, min_num_micro_batch=minimum, use_dynamic_bsz_balance=balance)
        ours = token_budget_rows(lengths, budget, minimum, balance, "batch_rank0.pt")
        assert ours == theirs, (lengths, budget, balance, minimum)
