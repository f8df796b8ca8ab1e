"""The Megatron hook's merge of per-parameter norms over tensor-parallel shards (`parameter_norms`), at TP=2 with
ETP=2 against TP=1, on megatron-core's own model and sharded state dict (TP>1 forwards do not run on CPU; building,
loading and the merge do). Every parameter gets a gradient equal to its weights, the same on every replica, as the
reduced gradient is: each checkpoint key's merged norm must equal its TP=1 norm, every shard counted once."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from megatron_helpers import REASON

pytestmark = pytest.mark.slow


def _merged_norms(rank: int, world: int, payload: tuple[dict[str, Any], str, int, str]) -> None:

    from axrl_spike_replay.integrations.megatron import parameter_norms
    from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.mcore.megatron_gpt import MegatronParallel, build_gpt_model, init_parallel
    from axrl_spike_replay.snapshot.trainer_formats.megatron_load import load_megatron_model

    section, checkpoint, tp, out = payload
    with megatron_on_cpu():
        parallel = MegatronParallel(tp=tp, etp=tp)
        init_parallel(parallel)
        model = build_gpt_model(MegatronModelConfig.from_dict(section), parallel)
        load_megatron_model(model, checkpoint)
        for param in model.parameters():
            param.grad = param.detach().clone()
        norms = parameter_norms(model)
    if rank == 0:
        Path(out).write_text(json.dumps(norms))


class _Said(logging.Handler):
    """The log lines a rank process said."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _partial_replicas(rank: int, world: int, payload: tuple[dict[str, Any], str]) -> None:
    """At TP=2: the layer norms' gradients as sequence parallelism leaves them before finalize_model_grads, a
    different partial gradient on each TP rank. The merge says so in the log."""
    from axrl_spike_replay.integrations.megatron import log, parameter_norms
    from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.mcore.megatron_gpt import MegatronParallel, build_gpt_model, init_parallel

    section, out = payload
    said = _Said()
    log.addHandler(said)
    with megatron_on_cpu():
        init_parallel(MegatronParallel(tp=2, etp=2))
        model = build_gpt_model(MegatronModelConfig.from_dict(section), MegatronParallel(tp=2, etp=2))
        for name, param in model.named_parameters():
            partial = 0.5 + rank if "layernorm" in name else 1.0  # only the replicated norms differ
            param.grad = param.detach().clone() * partial
        parameter_norms(model)
    if rank == 0:
        Path(out).write_text(json.dumps(said.lines))


def test_replicas_that_disagree_are_named_in_the_log(tmp_path: Path) -> None:
    if REASON is not None:
        pytest.skip(REASON)
    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

    out = tmp_path / "said.json"
    spawn_ranks(_partial_replicas, 2, (tiny_section(), str(out)), timeout_s=1200.0, label="merge")
    (said,) = json.loads(out.read_text())
    assert "differs between its replicas" in said and "layernorm" in said and "finalize_model_grads" in said


def test_tp_split_parameters_merge_to_the_unsplit_norms(megatron_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from axrl_spike_replay.processes.rank_processes import spawn_ranks
    from axrl_spike_replay.testing.megatron_checkpoints import tiny_section

    section = tiny_section()
    reference = megatron_checkpoints["tp1"]  # the session's TP=1 checkpoint of this section (read only)
    merged = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        spawn_ranks(_merged_norms, tp, (section, str(reference), tp, str(out)), timeout_s=1200.0, label="merge")
        merged[tp] = json.loads(out.read_text())
    assert sorted(merged[2]) == sorted(merged[1])  # no key missing, none invented
    for name, norm in merged[1].items():
        assert merged[2][name] == pytest.approx(norm, rel=1e-12), name  # each shard counted once
    total = {tp: math.sqrt(math.fsum(v * v for v in norms.values())) for tp, norms in merged.items()}
    assert total[2] == pytest.approx(total[1], rel=1e-12)
    assert any("linear_fc1" in name for name in merged[1])  # the split GLU weights (gate and up halves) are in it
