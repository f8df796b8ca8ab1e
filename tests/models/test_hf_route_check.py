"""A transformers MoE policy's recorded routes are held to its routers before any replay (qwen3_moe: 8 experts,
top-2, MoE layers [0, 1]): a payload of the wrong width or naming a layer the model lacks is refused before any
process starts, an expert id past its experts is refused naming the file, and a config whose top-k exceeds its
experts is refused when it is parsed, before any weight is read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from axrl_spike_replay.capture.reference.model_choice import hf_model_section
from axrl_spike_replay.errors import AxrlError, ConfigError, SnapshotError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.models.policy import parse_model_config, routing_shape
from axrl_spike_replay.replay.engine import run_replay
from hostile_snapshot import edit_routing_payload


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_top_k_beyond_the_experts_is_refused_when_the_config_is_read(architecture: str) -> None:
    section = hf_model_section(architecture)
    shape = routing_shape(parse_model_config(section))
    assert (shape.n_experts, shape.top_k) == (8, 2)
    section["config"]["num_experts_per_tok"] = 9
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(top-k\) is 9, more than the 8 routed experts"):
        parse_model_config(section)


def test_deepseek_groups_that_cannot_be_chosen_from_are_refused() -> None:
    section = hf_model_section("deepseek_v3")
    section["config"]["topk_group"] = 3  # of n_group 2
    with pytest.raises(ConfigError, match="topk_group 3 of n_group 2"):
        parse_model_config(section)


@pytest.fixture
def hf_copy(hf_snapshot: Path, tmp_path: Path) -> Path:
    dest = tmp_path / hf_snapshot.name
    shutil.copytree(hf_snapshot, dest)
    return dest


def test_a_payload_of_the_wrong_width_or_layers_is_refused_before_any_replay(hf_copy: Path) -> None:
    original = (hf_copy / "routing_payload_rank0.pt").read_bytes()
    edit_routing_payload(hf_copy, 0, lambda d: d.__setitem__("routed_experts", d["routed_experts"][..., :1].clone()))
    # a finding about rank 0's input (the file named), with the experiments that replay around it
    width = r"routing_payload_rank0\.pt\): routed_experts holds 1 experts per token but the model routes to top-k 2"
    with pytest.raises(SnapshotError, match=width) as refused:
        run_replay(replay_request(What(hf_copy), how=How(nproc=1)))
    assert "Run instead: drop_ranks=0, recompute=routes:rank0" in str(refused.value)
    (hf_copy / "routing_payload_rank0.pt").write_bytes(original)
    edit_routing_payload(hf_copy, 1, lambda d: d.__setitem__("moe_layers", [0, 7]))
    with pytest.raises(SnapshotError, match=r"routing_payload_rank1\.pt\): moe_layers names layers \[7\] the model"):
        run_replay(replay_request(What(hf_copy), how=How(nproc=1)))


def test_an_expert_id_past_the_routers_experts_is_refused_naming_the_file(hf_copy: Path) -> None:
    edit_routing_payload(
        hf_copy, 1, lambda d: d.__setitem__("routed_experts", d["routed_experts"].masked_fill(torch.tensor(True), 8))
    )
    past = r"routing_payload_rank1\.pt\): expert ids \[8\] in layer slots \[0, 1\]; the model has 8 experts per layer"
    with pytest.raises(AxrlError, match=past) as refused:
        run_replay(replay_request(What(hf_copy), how=How(nproc=1)))
    assert "Run instead: drop_ranks=1, recompute=routes:rank1" in str(refused.value)
    assert "IndexError" not in str(refused.value) and "CUDA" not in str(refused.value)


def test_the_layers_routes_are_held_to_are_the_built_model_s() -> None:
    section = hf_model_section("qwen3_moe")
    del section["config"]["num_hidden_layers"]  # left to Qwen3MoeConfig's default
    shape = routing_shape(parse_model_config(section))
    assert shape.n_layers == len(shape.moe_layers) == 24  # as transformers builds it, not 0 from the missing key
