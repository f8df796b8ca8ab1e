"""A sharded replay makes FSDP2 units of the same modules verl's FSDP2 actor does: its own selection function
(`verl/utils/fsdp_utils.py:_select_fsdp2_wrap_targets`, compiled from the installed source) picked on the same
transformers model. With untied embeddings that is the decoder layers and the embedding and output head each on
their own, so the root does not keep those vocabulary-sized matrices gathered through the step; tied, the layers.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn
from verl_engine_step import _function, verl_root

from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.policy import build_policy, shard_units
from axrl_spike_replay.testing.hf_snapshot import tiny_config


def _verl_targets(causal_lm: Any) -> list[nn.Module]:
    root = verl_root()
    if root is None:
        pytest.skip("verl is not installed")
    select = _function(root / "utils" / "fsdp_utils.py", "_select_fsdp2_wrap_targets", None, {"nn": nn})
    return select(causal_lm, list(causal_lm._no_split_modules))


@pytest.mark.parametrize("architecture", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("tied", [False, True])
def test_the_replay_shards_the_units_verl_wraps(architecture: str, tied: bool) -> None:
    config = {**tiny_config(architecture), "tie_word_embeddings": tied}
    policy = build_policy(HFModelConfig(architecture=architecture, config=config), "meta")
    lm: Any = policy.causal_lm
    units = shard_units(policy)
    assert [id(m) for m in units] == [id(m) for m in _verl_targets(lm)]
    ends = {id(lm.model.embed_tokens), id(lm.lm_head)}
    assert bool(ends & {id(m) for m in units}) is not tied
