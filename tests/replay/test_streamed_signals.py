"""The experiments' signals, streamed: the clean gradient and each mitigated config's cosine to it are the whole
replay's, put together a piece (decoder layer, head, embedding) at a time.

Snapshots are recorded in this run with the trainer's own step functions (tiny_moe: tests/replay/tiny_snapshot.py;
transformers: `testing.hf_snapshot`, qwen2_moe has shared experts). The whole replay (`worker.compute`, every saved
rank in one process) and the streamed one (`compute_streamed`) run the same job; the clean gradient's figures (the
tokens left out, the probes' grad norms, the baseline's cosine) and every mitigated config's cosine to clean agree
to 1e-6. Nothing here compares with numbers recorded elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.compute.worker import compute
from axrl_spike_replay.replay.compute.worker_job import ConfigOutcome, WorkerJob
from axrl_spike_replay.replay.engine import replay_session
from axrl_spike_replay.replay.streamed.streamed_job import compute_streamed
from axrl_spike_replay.vocabulary import Shard, Verb

SAME = 1e-6
# one mitigation sharing the baseline's forward, one masking samples, one on another forward (routing off)
CONFIGS = [{"advantage_clip": 1}, {"drop_samples": "0:1"}, {"routing_replay": "off"}]


def job_of(snapshot: Path, configs: Sequence[dict[str, Any]]) -> WorkerJob:
    """The job the engine makes for `snapshot` and `configs`, every saved rank in one process."""
    with replay_session(replay_request(What(snapshot), how=How(shard=Shard.OFF)), list(configs), "replay") as session:
        job = session.worker_job()
    return dataclasses.replace(job, assignment=(tuple(range(job.world_size)),))


def close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= SAME * max(abs(a), abs(b), 1.0)


def same_figures(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a, b)
        for key in a:
            same_figures(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_figures(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert close(a, b), (where, a, b)
    else:
        assert a == b, (where, a, b)


def streamed_view(doc: dict[str, Any]) -> dict[str, Any]:
    """A signal check's document less what is not streamed: the tokens tried at other offsets (a whole-model replay
    only), which the streamed document must leave empty."""
    return {**doc, "ranks": [{k: v for k, v in r.items() if k != "shifted"} for r in doc["ranks"]]}


def assert_not_shifted(doc: dict[str, Any]) -> None:
    assert all(r["shifted"] == {} for r in doc["ranks"]), [r["shifted"] for r in doc["ranks"]]


def assert_same_signals(whole: Sequence[ConfigOutcome], streamed: Sequence[ConfigOutcome]) -> int:
    """The clean gradient and cosines agree; the number of mitigated configs with a cosine."""
    compared = 0
    for a, b in zip(whole, streamed, strict=True):
        assert close(a.grad_norms[0], b.grad_norms[0]), (a.config_id, a.grad_norms, b.grad_norms)
        assert close(a.cosine_to_clean, b.cosine_to_clean), (a.config_id, a.cosine_to_clean, b.cosine_to_clean)
        same_figures(a.clean_gradient, b.clean_gradient, a.config_id)
        compared += a.cosine_to_clean is not None
    return compared


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tiny_moe_clean_gradient_and_cosines_streamed(tmp_path: Path, world_size: int) -> None:
    """A spike carried by one sample's advantage: the search leaves its tokens out; the same figures streamed."""
    snapshot = record_tiny_snapshot(tmp_path, world_size=world_size, burst=False, advantage_outlier=(0, 1, 200.0))
    job = job_of(snapshot, CONFIGS)
    whole, streamed = compute(job, 0), compute_streamed(job)
    assert assert_same_signals(whole, streamed) == len(CONFIGS)
    clean = streamed[1].clean_gradient
    assert clean is not None and clean["reached"] and clean["passes"] >= 1 and "0:1" in clean["left_out"]
    assert clean["baseline_cosine"] is not None and clean["baseline_cosine"] < 1.0


def test_tiny_moe_burst_spike_clean_gradient_streamed(tmp_path: Path) -> None:
    """The recorded burst (stale stored log-probs): the on-policy gradient is under the bar, one probe; the same
    figures streamed."""
    snapshot = record_tiny_snapshot(tmp_path, world_size=2)
    job = job_of(snapshot, CONFIGS[:1])
    whole, streamed = compute(job, 0), compute_streamed(job)
    assert assert_same_signals(whole, streamed) == 1
    clean = streamed[1].clean_gradient
    assert clean is not None and clean["recomputed"] and clean["passes"] == 1 and clean["reached"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_transformers_shared_experts_clean_gradient_and_cosines_streamed(tmp_path: Path, world_size: int) -> None:
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        snapshot = record_hf_snapshot(tmp_path, "qwen2_moe", world_size=world_size)
        job = job_of(snapshot, CONFIGS[:1] + CONFIGS[2:])
        whole, streamed = compute(job, 0), compute_streamed(job)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert assert_same_signals(whole, streamed) == 2


def test_backwards_the_clean_gradient_takes(tmp_path: Path) -> None:
    """Each layer read once in the forward, then once per backward: the baseline's, the clean gradient's probes
    (`passes`); then once for the clean one beside the baseline's (its cosine), and once for every mitigated config
    of the forward group beside one more clean backward: backwards taken together share each layer's one read. Never
    more than the layer read ahead held as one is read."""
    from axrl_spike_replay.replay.streamed import layer_weights

    snapshot = record_tiny_snapshot(tmp_path, world_size=2, burst=False, advantage_outlier=(0, 1, 200.0))
    job = job_of(snapshot, CONFIGS[:2])  # one forward group
    reads: list[int] = []
    original = layer_weights.StreamedWeights._read_layer

    def counted(self: layer_weights.StreamedWeights, index: int) -> None:
        held = [i for i, layer in enumerate(self.program.layers) if not next(layer.parameters()).is_meta]
        assert len(held) <= 1, f"layer {index} read while {held} held"  # at most the one computing
        reads.append(index)
        return original(self, index)

    layer_weights.StreamedWeights._read_layer = counted
    lines: list[str] = []
    try:
        outcomes = compute_streamed(job, progress=lines.append)
    finally:
        layer_weights.StreamedWeights._read_layer = original
    assert any(f"({len(reads)} layer reads" in line for line in lines), lines
    clean = outcomes[1].clean_gradient
    assert clean is not None and clean["passes"] > 1
    alone = 1 + clean["passes"]  # the baseline, the probes
    together = 1 + 1  # the baseline beside the clean one; both mitigated configs beside one more clean one
    assert reads == [0, 1] + [1, 0] * alone + [1, 0] * together
    assert outcomes[1].cosine_to_clean is not None and outcomes[2].cosine_to_clean is not None


def test_configs_beside_one_clean_backward_as_the_host_memory_holds(tmp_path: Path) -> None:
    """With no host memory for a third set of gradient boundaries, each mitigated config goes beside a clean backward
    of its own (a pair, a layer read each): the same figures as all of them beside one, bit for bit."""
    from axrl_spike_replay.replay.streamed.settings import StreamSettings

    snapshot = record_tiny_snapshot(tmp_path, world_size=2, burst=False, advantage_outlier=(0, 1, 200.0))
    job = job_of(snapshot, CONFIGS[:2])
    lines: list[str] = []
    grouped = compute_streamed(job)
    paired = compute_streamed(job, progress=lines.append, settings=StreamSettings(0, str(tmp_path / "spill")))
    for a, b in zip(grouped, paired, strict=True):
        assert a.grad_norms == b.grad_norms and a.cosine_to_clean == b.cosine_to_clean, a.config_id
        assert a.param_grad_norms == b.param_grad_norms and a.footprint == b.footprint, a.config_id
    clean = grouped[1].clean_gradient
    assert clean is not None
    n_layers = 2
    pairs = 1 + 2  # the baseline's, and one per mitigated config
    assert any(f"({n_layers * (1 + 1 + clean['passes'] + pairs)} layer reads" in line for line in lines), lines


def test_no_spike_bar_no_clean_gradient_streamed(tmp_path: Path) -> None:
    """Without a usable median norm there is no bar: no clean gradient, no cosine, the reason said, as whole."""
    snapshot = record_tiny_snapshot(tmp_path, world_size=2)
    job = dataclasses.replace(job_of(snapshot, CONFIGS[:1]), spike_bar=None)
    whole, streamed = compute(job, 0), compute_streamed(job)
    assert assert_same_signals(whole, streamed) == 0
    assert streamed[1].clean_gradient is not None and streamed[1].clean_gradient["reason"]


@pytest.mark.parametrize("architecture", ["tiny", "qwen2_moe"])
def test_signal_check_streamed_is_the_whole_one(tmp_path: Path, architecture: str) -> None:
    """Diagnose's model evidence streamed, forward only: every stored log-prob against the replayed one (the run's
    routing and the model's own), the per-sample means and the route agreement per MoE layer, as whole."""
    from axrl_spike_replay.replay.analyses.step_evidence_run import step_evidence

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        if architecture == "tiny":
            snapshot = record_tiny_snapshot(tmp_path, world_size=2)
        else:
            from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

            snapshot = record_hf_snapshot(tmp_path, architecture, world_size=2)
        whole = step_evidence(snapshot, shard="off", channel=False)
        streamed = step_evidence(snapshot, shard="streamed", channel=False)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert streamed.channel is None
    a, b = whole.signals.to_json(), streamed.signals.to_json()
    assert_not_shifted(b)
    same_figures(streamed_view(a), streamed_view(b), "signals")
    ranks = streamed.signals.ranks
    assert len(ranks) == 2 and all(r.pairs for r in ranks) and streamed.signals.has_own
    assert any(r.routes for r in ranks) and all(r.samples_mean_logprob_own for r in ranks)


def test_streamed_evidence_refuses_the_loss_channel_by_name(tmp_path: Path) -> None:
    from axrl_spike_replay.errors import ConfigError
    from axrl_spike_replay.replay.analyses.step_evidence_run import step_evidence

    snapshot = record_tiny_snapshot(tmp_path, world_size=1)
    with pytest.raises(ConfigError, match=r"loss-term channel .* not computed streamed") as refused:
        step_evidence(snapshot, shard="streamed")
    assert refused.value.parameter == "shard"


REL = 1e-6


def same_attribution(streamed: Any, whole: Any) -> None:
    """The grad norm within REL, every sample's contribution and the router term within REL of it (the figure they
    add up to: a contribution near zero has no relative precision of its own in float32), the same signals."""
    doc, want = streamed.to_json(), whole.to_json()
    norm = whole.grad_norm
    assert abs(doc["grad_norm"] - norm) <= REL * norm
    assert abs(doc["router_term"] - whole.router_term) <= REL * norm, (doc["router_term"], whole.router_term)
    assert doc["sum_rel_error"] <= 1e-6 and doc["total_samples"] == whole.total_samples
    got = {(s["rank"], s["sample"]): s for s in doc["samples"]}
    assert got.keys() == {(s["rank"], s["sample"]) for s in want["samples"]}
    for ref in want["samples"]:
        mine = got[ref["rank"], ref["sample"]]
        assert abs(mine["contribution"] - ref["contribution"]) <= REL * norm, (mine, ref)
        for key in ("advantage", "max_abs_log_ratio_current_vs_base", "loss_tokens", "reward", "group"):
            assert mine[key] == ref[key], key
    assert doc["passes"].startswith("streamed: 2 passes over the checkpoint") and not want["passes"]
    assert doc["method"] == "per_sample_backward"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tiny_moe_attribution_streamed(tmp_path: Path, world_size: int) -> None:
    """The router losses on (aux and z), an entropy term: every sample's contribution as the whole attribution's."""
    from axrl_spike_replay.investigation.request import How, What, replay_request
    from axrl_spike_replay.replay.analyses.attribution import attribute_spike

    loss = {"aux_loss_coef": 0.01, "z_loss_coef": 0.001} if world_size == 2 else None
    snapshot = record_tiny_snapshot(tmp_path, world_size=world_size, **({"loss": loss} if loss else {}))
    mitigations = {"entropy_coef": 0.05} if world_size == 4 else None
    whole = attribute_spike(
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100, mitigations=mitigations), how=How(shard="off"))
    )
    streamed = attribute_spike(
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100, mitigations=mitigations), how=How(shard="streamed"))
    )
    same_attribution(streamed, whole)
    if world_size == 2:
        assert abs(whole.router_term) > 0


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_transformers_shared_experts_attribution_streamed(tmp_path: Path, world_size: int) -> None:
    from axrl_spike_replay.replay.analyses.attribution import attribute_spike
    from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot

    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        snapshot = record_hf_snapshot(tmp_path, "qwen2_moe", world_size=world_size)
        whole = attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard="off")))
        streamed = attribute_spike(
            replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard="streamed"))
        )
    finally:
        torch.use_deterministic_algorithms(deterministic)
    same_attribution(streamed, whole)


def test_diagnose_streamed_model_evidence(tmp_path: Path) -> None:
    """`diagnose --shard streamed`: the attribution and the signal check streamed, the loss channel said not
    computed; the same attribution and signals as whole."""
    from axrl_spike_replay.diagnosis.diagnose import diagnose_snapshot

    snapshot = record_tiny_snapshot(tmp_path, world_size=2)
    whole = diagnose_snapshot(snapshot, model="always", how=How(shard=Shard.OFF))
    streamed = diagnose_snapshot(snapshot, model="always", how=How(shard=Shard.STREAMED))
    assert streamed.step is not None and whole.step is not None and whole.step.channel is not None
    assert streamed.step.channel is None
    assert any(line.startswith("loss channel (not computed streamed") for line in streamed.not_checked)
    assert not any(line.startswith("loss channel") for line in whole.not_checked)
    assert_not_shifted(streamed.step.signals.to_json())
    same_figures(streamed_view(whole.step.signals.to_json()), streamed_view(streamed.step.signals.to_json()), "signals")
    assert streamed.attribution_top and len(streamed.attribution_top) == len(whole.attribution_top)
    for mine, ref in zip(streamed.attribution_top, whole.attribution_top, strict=True):
        assert (mine["rank"], mine["sample"]) == (ref["rank"], ref["sample"])
        assert abs(mine["share"] - ref["share"]) <= 1e-6


def test_cli_attribute_streamed(tmp_path: Path, cli: Any) -> None:
    """`attribute --shard streamed` from the command line: the whole attribution's figures, its passes said."""
    snapshot = record_tiny_snapshot(tmp_path / "snap", world_size=2)
    streamed = cli("attribute", snapshot, "--shard", "streamed", "--top", "3", "--json")
    assert streamed.code == 0, streamed.err
    whole = cli("attribute", snapshot, "--shard", "off", "--top", "3", "--json")
    a, b = streamed.json(), whole.json()
    assert isinstance(a, dict) and isinstance(b, dict)
    assert abs(a["grad_norm"] - b["grad_norm"]) <= REL * b["grad_norm"]
    assert [(s["rank"], s["sample"]) for s in a["samples"]] == [(s["rank"], s["sample"]) for s in b["samples"]]
    assert a["passes"].startswith("streamed: 2 passes") and b["passes"] == ""
    text = cli("attribute", snapshot, "--shard", "streamed", "--top", "3")
    assert text.code == 0 and "streamed: 2 passes over the checkpoint" in text.out


def test_micro_batches_and_spilled_boundaries_signals(tmp_path: Path) -> None:
    """Ranks of several micro-batches each (the trainer's split, recorded in the batch files), router losses on,
    every boundary spilled to disk (host budget 0): the clean gradient, the cosines and the attribution (each
    sample's row found in its micro-batch) are the whole ones; the spill dir is gone after."""
    from tiny_snapshot import split_into_micro_batches

    from axrl_spike_replay.replay.analyses.attribution import _assembled, attribute_spike
    from axrl_spike_replay.replay.analyses.streamed_attribution import streamed_dots
    from axrl_spike_replay.replay.reading.inputs import load_inputs, one_config
    from axrl_spike_replay.replay.streamed.settings import StreamSettings
    from axrl_spike_replay.vocabulary import Method

    rank_lengths = (((4, 2, 3, 1, 4, 3), (8, 5, 7, 0, 3, 8)), ((2, 4, 1, 3, 2, 4), (2, 0, 6, 1, 8, 3)))
    loss = {"kl_coef": 0.01, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "is_base_logprobs": "rollout"}
    loss |= {"loss_agg_mode": "token-mean", "normalization": "per_rank"}
    snapshot = record_tiny_snapshot(tmp_path / "snap", rank_lengths=rank_lengths, prompt=4, loss=loss)
    split_into_micro_batches(snapshot, {0: [4, 2], 1: [1, 2, 3]})
    spill = tmp_path / "spill"
    settings = StreamSettings(0, str(spill))
    job = job_of(snapshot, CONFIGS[:2])
    whole, streamed = compute(job, 0), compute_streamed(job, settings=settings)
    assert assert_same_signals(whole, streamed) == 2
    assert spill.is_dir() and not any(spill.iterdir())
    reference = attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard="off")))
    inputs = load_inputs(snapshot, snapshot, False)
    cfg = one_config(inputs, None)
    norm, router, dots, signals, _ = streamed_dots(inputs, cfg, "cpu", settings=settings)
    got = _assembled(inputs, cfg, 100, "cpu", Method.PER_SAMPLE_BACKWARD, norm, router, dots, signals, {})
    got.passes = "streamed: 2 passes over the checkpoint"
    same_attribution(got, reference)
    assert abs(reference.router_term) > 0 and not any(spill.iterdir())
