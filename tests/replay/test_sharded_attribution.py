"""Sharded attribution: with the policy split by FSDP2 over 1, 2 or 4 gloo processes, each sample's contribution to
the grad norm, the router term and the ranking are the unsharded attribution's, for the toy model and for a
transformers MoE (qwen3_moe); from the library, the CLI and the MCP face.

The unsharded attribution (one forward-mode pass along g, in one process) is the reference. Contributions are
compared to within 1e-6 of the grad norm (the figure they add up to): a contribution near zero has no relative
precision of its own in float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_snapshot import BURST, record_tiny_snapshot

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.result import Attribution
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.analyses.attribution import attribute_spike
from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot
from axrl_spike_replay.vocabulary import Shard, Verb

pytestmark = pytest.mark.slow  # each sharded attribution starts 1-4 processes: tens of seconds on two cores

REL = 1e-6


def _same_attribution(sharded: Attribution | dict[str, Any], whole: Attribution) -> None:
    """The grad norm within REL, every sample's contribution within REL of it, the same ranking and signals."""
    doc = sharded.to_json() if isinstance(sharded, Attribution) else sharded
    norm = whole.grad_norm
    assert abs(doc["grad_norm"] - norm) <= REL * norm
    assert abs(doc["router_term"] - whole.router_term) <= REL * norm
    assert doc["sum_rel_error"] <= 1e-6
    assert doc["total_samples"] == whole.total_samples
    want = whole.to_json()["samples"]
    assert [(s["rank"], s["sample"]) for s in doc["samples"]] == [(s["rank"], s["sample"]) for s in want]
    for got, ref in zip(doc["samples"], want, strict=True):
        assert abs(got["contribution"] - ref["contribution"]) <= REL * norm, (got, ref)
        assert abs(got["share"] - ref["share"]) <= REL
        for key in ("advantage", "max_abs_log_ratio_current_vs_base", "loss_tokens", "reward", "group"):
            assert got[key] == ref[key], key
    assert doc["sharded"] is True and whole.sharded is False
    assert doc["method"] == "per_sample_backward"  # forward-mode JVPs do not run through FSDP2


@pytest.fixture(scope="module")
def toy_world4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Attribution]:
    """The toy model's spike at saved world size 4, attributed unsharded."""
    snapshot = record_tiny_snapshot(tmp_path_factory.mktemp("toy4") / "spike_snapshots", world_size=4)
    return snapshot, attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard="off")))


# In the default run the two-process case is test_an_attribution_that_does_not_fit_one_process_shards_by_itself (shard
# auto: the same sharded attribution, the same assertions) and the CLI's explicit `--shard on --nproc 2`.
@pytest.mark.matrix
@pytest.mark.parametrize("nproc", [1, 2, 3, 4])  # 3: saved ranks 0 | 1 | 2, 3, the first two pad with zero passes
def test_a_sharded_toy_attribution_gives_the_unsharded_figures(
    toy_world4: tuple[Path, Attribution], nproc: int
) -> None:
    snapshot, whole = toy_world4
    sharded = attribute_spike(
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard="on", nproc=nproc))
    )
    _same_attribution(sharded, whole)
    assert sharded.world_size_used == nproc
    assert {(s.rank, s.sample) for s in sharded.samples[:2]} == set(BURST)  # the planted samples carry it


def test_a_sharded_attribution_under_an_entropy_term_matches(toy_world4: tuple[Path, Attribution]) -> None:
    """The entropies' part of each sample's gradient goes through the per-sample backward too."""
    snapshot, _ = toy_world4
    mitigations = {"entropy_coef": 0.05}
    whole = attribute_spike(
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100, mitigations=mitigations), how=How(shard="off"))
    )
    _same_attribution(
        attribute_spike(
            replay_request(
                What(snapshot, verb=Verb.ATTRIBUTE, top=100, mitigations=mitigations), how=How(shard="on", nproc=2)
            )
        ),
        whole,
    )


def test_an_attribution_that_does_not_fit_one_process_shards_by_itself(
    toy_world4: tuple[Path, Attribution], monkeypatch: pytest.MonkeyPatch
) -> None:
    from axrl_spike_replay.replay.plans import shard_choice

    snapshot, whole = toy_world4
    monkeypatch.setattr(shard_choice, "available_memory_bytes", lambda: 1 << 10)  # a machine with 1 KiB free
    sharded = attribute_spike(
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(nproc=2))
    )  # shard auto
    _same_attribution(sharded, whole)
    assert sharded.world_size_used == 2
    assert {(s.rank, s.sample) for s in sharded.samples[:2]} == set(BURST)  # the planted samples carry it
    with pytest.raises(ConfigError, match=r"does not fit: .*run it sharded \(`shard` on, `nproc` > 1\)"):
        attribute_spike(
            replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=3), how=How(nproc=1))
        )  # one process cannot shard: refused before it loads


def test_the_cli_attributes_sharded_on_request(toy_world4: tuple[Path, Attribution], tmp_path: Path, cli) -> None:
    snapshot, whole = toy_world4
    run = cli("attribute", snapshot, "--top", "100", "--shard", "on", "--nproc", "2", "--workspace", tmp_path, "--json")
    assert run.code == 0, run.err
    doc = run.json()
    _same_attribution(doc, whole)
    assert doc["world_size_used"] == 2
    command = (Path(doc["output_dir"]) / "command.txt").read_text(encoding="utf-8")
    assert "--shard on" in command and "--nproc 2" in command


def test_an_unsharded_attribution_on_several_processes_is_refused(toy_world4: tuple[Path, Attribution]) -> None:
    from axrl_spike_replay.investigation.request import How, What, replay_request

    snapshot, _ = toy_world4
    with pytest.raises(ConfigError, match="unsharded attribution runs in this one process") as caught:
        replay_request(What(snapshot, verb=Verb.ATTRIBUTE), how=How(shard=Shard.OFF, nproc=2))
    assert caught.value.parameter == "nproc"


@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.matrix), 2])
def test_a_sharded_qwen3_moe_attribution_gives_the_unsharded_figures(hf_snapshot: Path, nproc: int) -> None:
    whole = attribute_spike(replay_request(What(hf_snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard="off")))
    _same_attribution(
        attribute_spike(
            replay_request(What(hf_snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard="on", nproc=nproc))
        ),
        whole,
    )


@pytest.mark.matrix
def test_a_sharded_qwen3_moe_attribution_at_world_size_4(tmp_path: Path) -> None:
    snapshot = record_hf_snapshot(tmp_path, "qwen3_moe", world_size=4)
    whole = attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard="off")))
    _same_attribution(
        attribute_spike(replay_request(What(snapshot, verb=Verb.ATTRIBUTE, top=100), how=How(shard="on", nproc=4))),
        whole,
    )


def test_a_cancelled_sharded_attribution_stops_its_processes(toy_world4: tuple[Path, Attribution]) -> None:
    import multiprocessing
    import threading
    import time

    from axrl_spike_replay.processes.rank_processes import RunCancelled

    snapshot, _ = toy_world4
    before = {child.pid for child in multiprocessing.active_children()}  # the session's warm pools, if up
    cancel = threading.Event()

    def cancel_once_started() -> None:  # as soon as its rank processes exist (they start in well under a second)
        while not cancel.is_set():
            if {child.pid for child in multiprocessing.active_children()} - before:
                cancel.set()
            time.sleep(0.01)

    watcher = threading.Thread(target=cancel_once_started, daemon=True)
    watcher.start()
    try:
        with pytest.raises(RunCancelled):
            attribute_spike(
                replay_request(What(snapshot, verb=Verb.ATTRIBUTE), how=How(shard="on", nproc=2), cancel=cancel)
            )
    finally:
        cancel.set()
        watcher.join(timeout=10)
    assert {child.pid for child in multiprocessing.active_children()} - before == set()
