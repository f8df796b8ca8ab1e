"""A replay process that runs several saved ranks holds two gradient copies at most, as the replay plan counts
them: the running sum and the pass being added. The gradient of a pass is freed once it is in the sum, before the
next pass's forward (a name still bound to it kept a third copy alive through the next forward and backward: the
measured peak of a one-process replay of four saved ranks was one gradient above the plan's).

A toy spike saved at world size 4 is replayed on one process, whole and in this process; every backward's
gradients are watched by weak references, and at each forward the previous pass's must be gone."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
from tiny_snapshot import record_tiny_snapshot

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.replay.compute import gradient_space, worker
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.vocabulary import Shard


def test_a_pass_s_gradient_is_freed_once_it_is_in_the_sum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = record_tiny_snapshot(tmp_path / "spike_snapshots", world_size=4)
    passes: list[list[weakref.ref[Any]]] = []  # each backward's gradients
    alive_at_forward: list[int] = []  # of the previous pass's gradients (from the second on), at each forward

    original_backward = gradient_space.Whole.backward

    def watched_backward(self: Any, loss: Any, logprobs: Any, retain: bool) -> Any:
        got, extra = original_backward(self, loss, logprobs, retain)
        passes.append([weakref.ref(g) for g in got if g is not None])
        return got, extra

    original_build = worker.build_model

    def build_and_watch(*args: Any, **kwargs: Any) -> Any:
        model = original_build(*args, **kwargs)

        def before_forward(module: Any, inputs: Any) -> None:
            if len(passes) >= 2:  # the first pass's gradient is the sum itself
                alive_at_forward.append(sum(ref() is not None for ref in passes[-1]))

        model.register_forward_pre_hook(before_forward)
        return model

    monkeypatch.setattr(gradient_space.Whole, "backward", watched_backward)
    monkeypatch.setattr(worker, "build_model", build_and_watch)
    result = run_replay(
        replay_request(What(snapshot), how=How(nproc=1, shard=Shard.OFF))
    )  # four saved ranks, one after another

    assert result.verdict == "reproduced" and result.sharded is False
    assert len(passes) == 4 and len(alive_at_forward) == 2  # the forwards of the third and fourth ranks
    assert alive_at_forward == [0, 0]
