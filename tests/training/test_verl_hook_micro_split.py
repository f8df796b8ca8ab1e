"""The verl hook records verl's micro-batch split, and the replay splits the rank's step the same way.

verl 0.9.1's FSDP engine splits a rank's mini-batch with `prepare_micro_batches` (workers/engine/utils.py), reading
the settings its worker put on the TensorDict (`use_dynamic_bsz` with `max_token_len_per_gpu` and `sp_size`, or
`micro_batch_size_per_gpu`), the DP ranks agreeing on the largest micro-batch count. The hook writes that as the
run config's `micro_batches:` section (`integrations.verl.micro_batch_section`, the count agreed by an all-reduce
over the ranks: `agreed_micro_batch_count`); the replay's `training.micro_batches.plan_micro_batches` then splits
the saved rank into micro-batches of the same rows as verl's own installed code does (the agreement given to it as
`min_num_micro_batch`, what its all-reduce gives), including a rank that verl splits more than its own tokens need
because the other rank needs more.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from verl_cases import BATCH, DP, PROMPT, RESPONSE, _ours_layout, _response_lengths, rank_batch

from axrl_spike_replay.integrations import VERL_PATCH
from axrl_spike_replay.training.loss_config import LossConfig
from axrl_spike_replay.training.micro_batches import MicroBatchSpec, plan_micro_batches

KNOBS = {
    "fixed 1": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 1},
    "fixed 7": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 7},
    "dynamic 20 tokens": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 20},
    "dynamic 28 tokens (ranks need 2 and 3)": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 28},
    "dynamic 14 tokens, sp 2": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 14, "sp_size": 2},
}


@pytest.fixture(scope="module")
def verl() -> dict[str, Any]:
    from verl_peer import load_verl, skip_unless_installed

    skip_unless_installed()
    peer = load_verl()
    assert peer["version"] == "0.9.1"
    return peer


def _hook() -> Any:
    spec = importlib.util.spec_from_file_location("axrl_verl_hook_split", VERL_PATCH.with_name("verl.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _attention(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.ones(BATCH, PROMPT), (torch.arange(RESPONSE) < lengths[:, None]).float()], 1).long()


def _mini_batch(rank: int, knobs: dict[str, Any], verl: dict[str, Any]) -> Any:
    """Rank `rank`'s mini-batch as verl's worker hands it to the engine: a TensorDict with its settings on it."""
    from tensordict import TensorDict

    r = rank_batch(rank, seed=1)
    fields = {
        "input_ids": torch.ones(BATCH, PROMPT + RESPONSE, dtype=torch.long),
        "attention_mask": _attention(_response_lengths(r["response_mask"])),
        "response_mask": r["response_mask"],
        "row": torch.arange(BATCH),
    }
    data = TensorDict(fields, batch_size=[BATCH])
    verl["engine_utils"].tu.assign_non_tensor(data, **knobs)
    return data


@pytest.mark.parametrize("split", list(KNOBS))
def test_the_recorded_split_is_verls_split(split: str, verl: dict[str, Any]) -> None:
    hook, knobs = _hook(), KNOBS[split]
    datas = [_mini_batch(rank, knobs, verl) for rank in range(DP)]
    local = [hook.local_micro_batch_count(d) for d in datas]
    agreed = None if local[0] is None else max(local)  # what the hook's all-reduce MAX gives
    if split.startswith("dynamic 28"):
        assert local == [2, 3], "rank 0 alone would take 2 micro-batches; verl gives it the other rank's 3"
    for rank, data in enumerate(datas):
        section = hook.run_config(DP, None, data, agreed)["micro_batches"]
        spec = MicroBatchSpec.from_dict(section)
        assert spec.split == ("token_budget" if knobs["use_dynamic_bsz"] else "size")
        theirs, _ = verl["engine_utils"].prepare_micro_batches(
            data=data, dp_group=None, same_micro_num_in_dp=True, min_num_micro_batch=agreed
        )
        batch = _ours_layout(rank_batch(rank, seed=1))
        batch["tokens"] = torch.ones(BATCH, PROMPT + RESPONSE, dtype=torch.long)
        batch["attention_mask"] = data["attention_mask"]
        cfg = LossConfig(convention="verl", normalization="global", loss_agg_mode="token-mean")
        ours = plan_micro_batches(batch, spec, cfg.to_dict(), "batch_rank0.pt")
        assert [list(mb.rows) for mb in ours] == [m["row"].tolist() for m in theirs], (rank, section)
        assert all(mb.scale == 1.0 for mb in ours), "verl's engine backpropagates each micro-batch's loss as it is"


def test_settings_verl_does_not_split_by_are_not_recorded(verl: dict[str, Any]) -> None:
    """A mini-batch without verl's settings, or grouped for reward-model training, records no split (the replay
    takes the recorded one); a dynamic size without its budget none either."""
    hook = _hook()
    assert "micro_batches" not in hook.run_config(DP, None, _mini_batch(0, {}, verl))
    grouped = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 1, "force_group_size": 7}
    assert "micro_batches" not in hook.run_config(DP, None, _mini_batch(0, grouped, verl))
    assert hook.local_micro_batch_count(_mini_batch(0, {"use_dynamic_bsz": False}, verl)) is None


def _agree(rank: int, world: int, payload: tuple[str, list[int]]) -> None:
    """One DP rank's `agreed_micro_batch_count` over a real gloo group: its mini-batch of `tokens[rank]` tokens."""
    out, tokens = payload
    hook = _hook()
    n = tokens[rank]
    data = {
        "input_ids": torch.ones(4, n, dtype=torch.long),
        "attention_mask": torch.ones(4, n, dtype=torch.long),
        "use_dynamic_bsz": True,
        "max_token_len_per_gpu": 16,
    }
    Path(out, f"rank{rank}").write_text(str(hook.agreed_micro_batch_count(data)))


def test_the_ranks_agree_on_the_largest_count_in_a_real_process_group(tmp_path: Path) -> None:
    from axrl_spike_replay.processes.rank_processes import spawn_ranks

    spawn_ranks(_agree, 2, (str(tmp_path), [4, 8]), timeout_s=120.0, label="verl hook rank")
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["2", "2"]  # 16 and 32 tokens: 1 and 2
