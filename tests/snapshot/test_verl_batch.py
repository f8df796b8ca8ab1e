"""A snapshot whose rank batches are verl 0.9.1 engine mini-batches: verl's key names, jagged sequences.

The batch is built the way `verl.workers.utils.padding.left_right_2_no_padding` builds it: prompts
left-padded and responses right-padded, then unpadded by the attention mask into jagged
`input_ids` / `position_ids` / `routed_experts` (`torch.nested.nested_tensor_from_jagged` with the
cumulative sequence lengths), `loss_mask` = `response_mask`, per-response fields left padded.
`analyze` reads it under our names with the same numbers as verl's padded batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.analysis.batch_signals import analyze_snapshot
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.fields import canonicalize_batch
from axrl_spike_replay.snapshot.rank_data import load_rank_batch
from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot
from verl_layouts import jagged_like_verl

PROMPT, RESPONSE, LAYERS, TOP_K = 5, 6, 2, 2


def padded_verl_batch(rank: int) -> dict[str, torch.Tensor]:
    """verl's padded mini-batch: prompts left-padded, responses right-padded, one sample with an empty response."""
    gen = torch.Generator().manual_seed(rank)
    prompt_lens, response_lens = [5, 3, 4, 2], [6, 2, 0, 4]
    batch = len(prompt_lens)
    prompts = torch.zeros(batch, PROMPT, dtype=torch.long)
    responses = torch.zeros(batch, RESPONSE, dtype=torch.long)
    attention = torch.zeros(batch, PROMPT + RESPONSE, dtype=torch.long)
    response_mask = torch.zeros(batch, RESPONSE)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        prompts[b, PROMPT - p :] = torch.randint(1, 30, (p,), generator=gen)
        responses[b, :r] = torch.randint(1, 30, (r,), generator=gen)
        attention[b, PROMPT - p : PROMPT + r] = 1
        response_mask[b, :r] = 1
    old = torch.randn(batch, RESPONSE, generator=gen).mul(0.3).sub(1.0) * response_mask
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "old_log_probs": old,
        "rollout_log_probs": old + torch.randn(batch, RESPONSE, generator=gen).mul(0.05) * response_mask,
        "ref_log_prob": old + 0.01 * response_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.0, 2.0])[:, None] * response_mask,
        "token_level_rewards": torch.zeros(batch, RESPONSE).index_fill_(1, torch.tensor([0]), 1.0),
        "routed_experts": torch.randint(0, 4, (batch, PROMPT + RESPONSE, LAYERS, TOP_K), generator=gen),
    }


def verl_snapshot(root: Path, layout) -> Path:
    snapshot = write_synthetic_snapshot(root, SyntheticSpec(world_size=2))
    for rank in (0, 1):
        torch.save(layout(padded_verl_batch(rank)), snapshot / f"batch_rank{rank}.pt")
    return snapshot


def test_the_jagged_batch_reads_as_verl_s_padded_batch() -> None:
    padded = padded_verl_batch(0)
    from_jagged = canonicalize_batch(jagged_like_verl(padded), "batch_rank0.pt")
    from_padded = canonicalize_batch(padded, "batch_rank0.pt")
    for name in ("tokens", "loss_mask", "old_logprobs", "rollout_logprobs", "ref_logprobs", "advantages"):
        assert torch.equal(from_jagged[name], from_padded[name]), name
    assert torch.equal(from_jagged["attention_mask"], padded["attention_mask"])
    routes = from_jagged["routed_experts"]
    assert torch.equal(
        routes[padded["attention_mask"].bool()], padded["routed_experts"][padded["attention_mask"].bool()]
    )
    assert bool((routes[~padded["attention_mask"].bool()] == -1).all())  # no route on padding
    # verl's old_log_probs[b, j] is response token j, which sits at column PROMPT + j of the tokens
    assert torch.equal(from_jagged["old_logprobs"][:, PROMPT:], padded["old_log_probs"])


def test_analyze_reads_a_verl_snapshot_under_our_names(tmp_path: Path) -> None:
    jagged = analyze_snapshot(verl_snapshot(tmp_path / "jagged", jagged_like_verl))
    padded = analyze_snapshot(verl_snapshot(tmp_path / "padded", lambda b: b))
    assert jagged.fields["tokens"] == "input_ids" and jagged.fields["old_logprobs"] == "old_log_probs"
    assert jagged.fields["ref_logprobs"] == "ref_log_prob" and jagged.fields["rollout_logprobs"] == "rollout_log_probs"
    assert not [m for m in jagged.missing if not m.startswith(("turn_index", "rewards"))]
    assert jagged.tokens["loss_tokens"] == 2 * (6 + 2 + 0 + 4)
    assert jagged.advantages == padded.advantages and jagged.ratio_old_vs_rollout == padded.ratio_old_vs_rollout
    assert jagged.logprobs == padded.logprobs


def test_the_cli_analyzes_a_jagged_verl_batch(tmp_path: Path) -> None:
    snapshot = verl_snapshot(tmp_path, jagged_like_verl)
    cmd = [sys.executable, "-m", "axrl_spike_replay", "analyze", str(snapshot), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout)["fields"]["loss_mask"] in ("loss_mask", "response_mask")


def test_inspect_style_meta_loading_still_reads_jagged_lengths(tmp_path: Path) -> None:
    snapshot = verl_snapshot(tmp_path, jagged_like_verl)
    batch = load_rank_batch(snapshot, 1, meta=True)
    assert tuple(batch["tokens"].shape) == (4, PROMPT + RESPONSE)


def test_a_jagged_batch_that_disagrees_with_its_mask_names_the_field() -> None:
    bad = jagged_like_verl(padded_verl_batch(0))
    bad["response_mask"] = bad["response_mask"][:3]
    with pytest.raises(SnapshotError, match="'input_ids' holds 4 sequences but 'response_mask' 3 rows"):
        canonicalize_batch(bad, "batch_rank0.pt")
    bad = jagged_like_verl(padded_verl_batch(0))
    bad["routed_experts"] = torch.nested.nested_tensor_from_jagged(
        torch.zeros(3, LAYERS, TOP_K, dtype=torch.long), offsets=torch.tensor([0, 1, 2, 3, 3])
    )
    with pytest.raises(SnapshotError, match="jagged field 'routed_experts' has other sequence lengths"):
        canonicalize_batch(bad, "batch_rank0.pt")


def test_position_ids_are_counted_from_the_attention_mask_and_a_misfit_mask_names_the_field() -> None:
    padded = padded_verl_batch(0)
    from_jagged = canonicalize_batch(jagged_like_verl(padded), "batch_rank0.pt")
    assert torch.equal(
        from_jagged["position_ids"][padded["attention_mask"].bool()],
        padded["position_ids"][padded["attention_mask"].bool()],
    )
    assert int(from_jagged["response_width"]) == RESPONSE
    bad = dict(padded, attention_mask=padded["attention_mask"][:, :3])
    with pytest.raises(SnapshotError, match="field 'attention_mask' must be \\[batch, seq\\] like the tokens"):
        canonicalize_batch(bad, "batch_rank0.pt")


def with_counts(tokens: int, sequences: int = 8, dp_size: int = 2):
    """The layout with the step's global counts set on it, as verl's engine sets them on each rank's mini-batch."""

    def layout(padded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = jagged_like_verl(padded)
        out.update(batch_num_tokens=torch.tensor(tokens), dp_size=torch.tensor(dp_size))
        out["global_batch_size"] = torch.tensor(sequences)
        return out

    return layout


def test_the_replay_reads_the_step_s_global_counts_from_verl_s_mini_batches(tmp_path: Path) -> None:
    from axrl_spike_replay.replay.reading.inputs import recorded_counts
    from axrl_spike_replay.training.loss_normalization import GlobalCounts

    snapshot = verl_snapshot(tmp_path / "counts", with_counts(24))
    assert recorded_counts(snapshot, 2) == GlobalCounts(dp_size=2, batch_num_tokens=24.0, global_batch_size=8.0)
    assert recorded_counts(verl_snapshot(tmp_path / "none", jagged_like_verl), 2) is None  # recounted by the replay
    torch.save(with_counts(23)(padded_verl_batch(1)), snapshot / "batch_rank1.pt")
    with pytest.raises(SnapshotError, match=r"global counts .* differ or are missing on some ranks"):
        recorded_counts(snapshot, 2)


def test_verl_s_rollout_is_weights_line_up_with_the_response_tokens() -> None:
    padded = padded_verl_batch(0)
    padded["rollout_is_weights"] = torch.rand(padded["response_mask"].shape) * padded["response_mask"]
    batch = canonicalize_batch(jagged_like_verl(padded), "batch_rank0.pt")
    assert batch["rollout_is_weights"].shape == batch["tokens"].shape
    assert torch.equal(batch["rollout_is_weights"][:, PROMPT:], padded["rollout_is_weights"])
