"""A checkpoint's bytes entries (DCP's `BytesStorageMetadata`: Megatron's `_extra_state`s) never run their pickle:
the check every reader runs first reads the pickle without running it, the load reads it weights-only, and each
refuses anything beyond what an extra state holds, by entry. Real DCP checkpoints saved here; the Megatron captures
(tests/megatron/test_megatron_hostile_entries.py) hold the same against inspect and both replay routes."""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.snapshot.dcp.checkpoint import check_checkpoint_storage, read_checkpoint_metadata
from axrl_spike_replay.snapshot.dcp.checkpoint_bytes import bytes_entry_value
from hostile_snapshot import save_bytes_entries, torch_saved

ENTRY = "decoder.layers.self_attention.linear_qkv._extra_state/shard_0_1"


class _Runs:
    """Pickles as a call of `call(*args)`."""

    def __init__(self, call: Any, *args: Any) -> None:
        self.call, self.args = call, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.call, self.args)


def _hostile_payloads(marker: Path) -> dict[str, bytes]:
    code = f"open({str(marker)!r}, 'w').write('ran')"
    return {
        "exec, as torch.save writes it": torch_saved([_Runs(exec, code)]),
        "exec, protocol 4 (STACK_GLOBAL)": torch_saved([_Runs(exec, code)], protocol=4),
        "a tensor, protocol 4 (the weights-only load reads 2)": torch_saved(torch.ones(3), protocol=4),
        "os.system": torch_saved([_Runs(os.system, f"touch {marker}")]),
        "a bare pickle, no archive": pickle.dumps([_Runs(exec, code)], protocol=2),
        "a set (builtins.set)": torch_saved([{1, 2}]),
    }


@pytest.mark.parametrize("case", list(_hostile_payloads(Path("x"))))
def test_a_bytes_entry_beyond_what_an_extra_state_holds_is_refused_and_never_run(case: str, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    payload = _hostile_payloads(marker)[case]
    checkpoint = tmp_path / "ckpt"
    save_bytes_entries(checkpoint, {ENTRY: payload, ENTRY.replace("qkv", "proj"): torch_saved([None])})
    problems = check_checkpoint_storage(checkpoint)
    assert len(problems) == 1 and f"entry of '{ENTRY}'" in problems[0] and "nothing in it was run" in problems[0]
    with pytest.raises(SnapshotError, match=r"linear_qkv\._extra_state/shard_0_1.*refused"):
        bytes_entry_value(payload, f"{checkpoint} (entry of {ENTRY!r})")  # what route 2's load reads it with
    assert not marker.exists(), "the pickle ran"


def test_a_global_is_named_from_literal_strings_or_memo_entries_else_refused() -> None:
    """A STACK_GLOBAL takes its names from the two values pushed before it: literal strings, or memo entries holding
    them, are read; a value the pickle builds cannot be named without running it, so it is refused as such."""
    from axrl_spike_replay.snapshot.dcp.checkpoint_bytes import _named_beyond_allowed

    proto, builtins, exec_ = b"\x80\x02", b"\x8c\x08builtins", b"\x8c\x04exec"  # protocol 4's opcodes, read
    memoized = proto + builtins + b"\x94" + exec_ + b"\x94\x93."  # MEMOIZE after each name
    from_memo = proto + builtins + b"\x94" + exec_ + b"\x94" + b"00" + b"h\x00h\x01\x93."  # POP both, BINGET both
    built = proto + builtins + b")\x93."  # the name an EMPTY_TUPLE: a value, not a string
    calls = _named_beyond_allowed(memoized)
    assert calls == _named_beyond_allowed(from_memo) and calls is not None and calls.startswith("calls builtins.exec")
    assert _named_beyond_allowed(built) == "names a global with values it builds, not literal strings"


def test_what_an_extra_state_holds_is_read(tmp_path: Path) -> None:
    held = {
        "local spec": [None],
        "Transformer Engine": [torch.arange(40, dtype=torch.uint8)],
        "containers": [OrderedDict(scale=torch.ones(2), steps=[1, 2.0, "x", None, b"raw"], pair=(True, 3))],
    }
    payloads = {f"{ENTRY}.{i}": torch_saved(v) for i, v in enumerate(held.values())}
    checkpoint = tmp_path / "ckpt"
    save_bytes_entries(checkpoint, payloads)
    assert check_checkpoint_storage(checkpoint) == []
    kinds = {type(item).__name__ for item in read_checkpoint_metadata(checkpoint).state_dict_metadata.values()}
    assert kinds == {"TensorStorageMetadata", "BytesStorageMetadata"}
    for (_, expected), data in zip(held.items(), payloads.values(), strict=True):
        value = bytes_entry_value(data, "entry")
        flat = torch.utils._pytree.tree_leaves(value)
        assert len(flat) == len(torch.utils._pytree.tree_leaves(expected))
