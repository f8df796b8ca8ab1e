"""The streamed replay split over gloo processes (`rank_chain`): what needs the step's summed gradient in more than
the last process (the clean gradient's search and cosines, each sample's attribution) and a weight two pieces share
(tied embeddings) are the one process's figures bit for bit, and the whole replay's to 1e-6.

Snapshots are recorded in this run with the trainer's own step functions (tiny_moe: tests/replay/tiny_snapshot.py;
transformers: `testing.hf_snapshot`, qwen2_moe has shared experts, qwen3_moe recorded with tied embeddings). The saved
ranks are split over 2 processes (world size 2: one rank each; 4: two each). Nothing here compares with numbers
recorded elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from test_streamed_replay import assert_identical, assert_same, close, job_of, recorded
from test_streamed_signals import (
    CONFIGS,
    assert_not_shifted,
    assert_same_signals,
    same_attribution,
    same_figures,
    streamed_view,
)
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.analyses.attribution import Attribution, attribute_spike
from axrl_spike_replay.replay.compute.worker import compute
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.streamed.streamed_job import compute_streamed
from axrl_spike_replay.replay.streamed.streamed_processes import run_streamed_processes
from axrl_spike_replay.vocabulary import Shard, Verb


def attributed(snapshot: Path, top: int, **how: Any) -> Attribution:
    """The snapshot's spike attributed to its `top` samples, laid out as `how` says."""
    return attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=top), how=How(**how)))


@contextmanager
def settings_kept() -> Iterator[None]:
    """The transformers snapshot helpers pin deterministic algorithms; the test process gets its setting back."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)


def hf_snapshot(root: Path, architecture: str, world_size: int, tied: bool = False) -> Path:
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot, tiny_config

    config = {**tiny_config(architecture), "tie_word_embeddings": True} if tied else None
    with settings_kept():
        return record_hf_snapshot(root, architecture, world_size=world_size, config=config)


def assert_same_clean(one: Sequence[ConfigOutcome], split: Sequence[ConfigOutcome]) -> int:
    """The clean gradient and every cosine to it bit for bit; the number of cosines."""
    for a, b in zip(one, split, strict=True):
        assert a.cosine_to_clean == b.cosine_to_clean, (a.config_id, a.cosine_to_clean, b.cosine_to_clean)
        assert a.clean_gradient == b.clean_gradient, (a.config_id, a.clean_gradient, b.clean_gradient)
    return sum(o.cosine_to_clean is not None for o in split)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tiny_moe_clean_gradient_split_over_processes(tmp_path: Path, world_size: int) -> None:
    """A spike carried by one sample's advantage; a mitigation sharing the baseline's forward, one masking samples,
    one on another forward: the search (its probes' norms, the tokens left out) and each cosine over 2 processes."""
    snapshot = record_tiny_snapshot(tmp_path, world_size=world_size, burst=False, advantage_outlier=(0, 1, 200.0))
    job = job_of(snapshot, CONFIGS)
    one = compute_streamed(job)
    split = run_streamed_processes(job, 2)
    assert_identical(one, split)
    assert assert_same_clean(one, split) == len(CONFIGS)
    assert assert_same_signals(compute(job, 0), split) == len(CONFIGS)
    clean = split[1].clean_gradient
    assert clean is not None and clean["reached"] and clean["passes"] > 1 and "0:1" in clean["left_out"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_transformers_clean_gradient_split_over_processes(tmp_path: Path, world_size: int) -> None:
    """qwen2_moe (shared experts): the recorded burst, a mitigation and routing off, over 2 processes."""
    snapshot = hf_snapshot(tmp_path, "qwen2_moe", world_size)
    job = job_of(snapshot, CONFIGS[:1] + CONFIGS[2:])
    with settings_kept():
        one = compute_streamed(job)
        split = run_streamed_processes(job, 2)
        whole = compute(job, 0)
    assert_identical(one, split)
    assert assert_same_clean(one, split) == 2
    assert assert_same_signals(whole, split) == 2


def test_the_engine_streams_a_mitigation_over_processes(tmp_path: Path) -> None:
    """`shard` streamed with `nproc` 2 and a mitigation through the engine: the one-process replay's cosine and
    clean gradient, no longer refused."""
    snapshot = record_tiny_snapshot(tmp_path, world_size=2, burst=False, advantage_outlier=(0, 1, 200.0))
    mitigated = What(snapshot, mitigations={"advantage_clip": 1})
    one = run_replay(replay_request(mitigated, how=How(shard=Shard.STREAMED))).to_json()
    two = run_replay(replay_request(mitigated, how=How(shard=Shard.STREAMED, nproc=2))).to_json()
    assert one["cosine_to_clean"] is not None and one["clean_gradient"] is not None
    for key in ("grad_norm", "baseline_grad_norm", "verdict", "cosine_to_clean", "clean_gradient"):
        assert one[key] == two[key], key


@pytest.mark.parametrize("world_size", [2, 4])
def test_tiny_moe_attribution_split_over_processes(tmp_path: Path, world_size: int) -> None:
    """The router losses on: every sample's contribution, the router term and the grad norm over 2 processes are
    the one process's, and the whole attribution's to 1e-6 of the norm."""
    snapshot = record_tiny_snapshot(tmp_path, world_size=world_size, loss={"aux_loss_coef": 0.01, "z_loss_coef": 0.001})
    one = attributed(snapshot, 100, shard="streamed")
    split = attributed(snapshot, 100, shard="streamed", nproc=2)
    a, b = one.to_json(), split.to_json()
    for key in ("grad_norm", "router_term", "samples", "sum_rel_error"):
        assert a[key] == b[key], key
    same_attribution(split, attributed(snapshot, 100, shard="off"))
    assert abs(split.router_term) > 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_transformers_attribution_split_over_processes(tmp_path: Path, world_size: int) -> None:
    snapshot = hf_snapshot(tmp_path, "qwen2_moe", world_size)
    with settings_kept():
        one = attributed(snapshot, 100, shard="streamed")
        split = attributed(snapshot, 100, shard="streamed", nproc=2)
        whole = attributed(snapshot, 100, shard="off")
    a, b = one.to_json(), split.to_json()
    for key in ("grad_norm", "router_term", "samples"):
        assert a[key] == b[key], key
    same_attribution(split, whole)


def relative_gap(whole: Sequence[ConfigOutcome], streamed: Sequence[ConfigOutcome]) -> float:
    """The largest relative difference of any per-parameter norm, the step's or a saved rank's own."""
    gap = 0.0
    for a, b in zip(whole, streamed, strict=True):
        pairs: list[tuple[float, float]] = [(a.grad_norms[0], b.grad_norms[0])]
        if a.param_grad_norms is not None and b.param_grad_norms is not None:
            pairs += [(v, b.param_grad_norms[k]) for k, v in a.param_grad_norms.items()]
        for rank, norms in (a.rank_param_grad_norms or {}).items():
            assert b.rank_param_grad_norms is not None
            pairs += [(v, b.rank_param_grad_norms[rank][k]) for k, v in norms.items()]
        gap = max(gap, *(abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in pairs))
    return gap


@pytest.mark.parametrize("world_size", [2, 4])
def test_tied_embeddings_streamed_and_split(tmp_path: Path, world_size: int) -> None:
    """qwen3_moe with tied input and output embeddings: the embedding's gradient gathers the head's half and the
    embedding's into the one tensor (its norms, the step's and each rank's own, taken once); the whole replay's to
    1e-6, the recorded grad norm, and over 2 processes the one process's bit for bit, a mitigation's cosine too."""
    snapshot = hf_snapshot(tmp_path, "qwen3_moe", world_size, tied=True)
    job = job_of(snapshot, [{"mismatch_token_clip_max": 2}])
    with settings_kept():
        whole = compute(job, 0)
        one = compute_streamed(job)
        split = run_streamed_processes(job, 2)
    assert whole[0].param_grad_norms is not None and not any("lm_head" in n for n in whole[0].param_grad_norms)
    assert_same(whole, one)
    assert relative_gap(whole, one) <= 1e-6
    assert close(one[0].grad_norms[0], recorded(snapshot))
    assert_identical(one, split)
    assert assert_same_clean(one, split) == 1


def test_tied_embeddings_signal_check_streamed(tmp_path: Path) -> None:
    """Diagnose's signal check (forward only) of a tied-embedding policy streamed: the whole one's figures."""
    from axrl_spike_replay.replay.analyses.step_evidence_run import step_evidence

    snapshot = hf_snapshot(tmp_path, "qwen3_moe", 2, tied=True)
    with settings_kept():
        whole = step_evidence(snapshot, shard="off", channel=False)
        streamed = step_evidence(snapshot, shard="streamed", channel=False)
    same_figures(streamed_view(whole.signals.to_json()), streamed_view(streamed.signals.to_json()), "signals")
    assert_not_shifted(streamed.signals.to_json())  # the tokens tried at other offsets: a whole-model replay's only
    assert all(r.pairs for r in streamed.signals.ranks)


def test_tied_embeddings_attribution_streamed_refused_by_name(tmp_path: Path) -> None:
    snapshot = hf_snapshot(tmp_path, "qwen3_moe", 1, tied=True)
    with pytest.raises(ConfigError, match="tied input and output embeddings") as refused:
        attributed(snapshot, 3, shard="streamed")
    assert refused.value.parameter == "shard"


def test_the_plan_counts_the_clean_gradients_backwards_and_the_tied_half() -> None:
    """The streamed row with mitigations: the clean gradient's backwards at their fewest (a probe, the baseline's
    pair, one beside the other configs: `test_backwards_the_clean_gradient_takes` counts them run) and a set of
    backward gradients for each backward taken together; tied embeddings: one matrix, its head half held with the
    ends, each saved rank's own head half with the boundaries."""
    from axrl_spike_replay.models.policy import parse_model_config
    from axrl_spike_replay.replay.compute.process_memory import model_facts
    from axrl_spike_replay.replay.streamed.streamed_plan import model_pieces, streamed_row
    from axrl_spike_replay.testing.hf_snapshot import model_section, tiny_config

    def row(tied: bool, configs: int) -> Any:
        config = {**tiny_config("qwen3_moe"), "tie_word_embeddings": tied}
        spec = parse_model_config(model_section("qwen3_moe", config=config))
        pieces = model_pieces(spec)
        return pieces, streamed_row(
            model_facts(spec), pieces, world=4, rank_tokens=160, micro_batch=(4, 40), device="cpu", configs=configs,
            capacity_bytes=None,
        )  # fmt: skip

    (untied, one), (_, three) = row(False, 1), row(False, 3)
    # reads: the forward, the baseline, a probe, the baseline's pair, both other configs beside one clean backward
    assert one.layer_reads == untied.layers * 2 and three.layer_reads == untied.layers * (1 + 1 + 1 + 1 + 1)
    backwards = 3 + 1 + 2 + 1  # each config's, the probe, the clean one beside the baseline, the one beside the rest
    assert three.flops == one.flops * (2 + 8 * backwards) / (2 + 8 * 1)
    gradients = (three.boundaries - one.boundaries) / 2  # a set for each of the three backwards taken together
    assert gradients > 0 and three.boundaries == one.boundaries + 2 * gradients
    tied, tied_row = row(True, 1)
    assert tied.tied and not untied.tied and tied.head == untied.head - untied.embedding
    b = 4  # float32
    assert tied_row.boundaries == one.boundaries + 4 * tied.embedding * b
    # the matrix once, three gradient copies of the larger end piece, and the head half held until the embedding
    assert tied_row.ends == (tied.embedding + tied.head) * b + 3 * tied.embedding * b + tied.embedding * b
