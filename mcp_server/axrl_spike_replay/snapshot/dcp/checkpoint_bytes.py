"""A checkpoint's bytes entries, read as no pickle is ever executed: weights-only, and only what they legitimately hold.

DCP stores an object it is given (not a tensor) as the bytes of its `torch.save`, declared `BytesStorageMetadata` in
`.metadata`, and reads it back with `torch.load(weights_only=False)` (`DefaultLoadPlanner.load_bytes`): a checkpoint
from shared storage could run any code it likes there. Megatron-core stores every ShardedObject that way: each linear
module's `_extra_state`, per layer and per expert, up to hundreds of thousands of entries in a large MoE. What they
hold is `[None]` from megatron-core's own layers (the local spec) and `[tensor]` from Transformer Engine's (its FP8
scaling state, serialized into a uint8 tensor). So a bytes entry is held to the rule of every torch archive we read
(records stored and inside the entry, a bounded pickle) and to an allow-list of what an extra state holds: None,
booleans, numbers, strings, bytes, tensors, and lists, tuples and dicts of them.

Two readers, one rule:
- `bytes_entry_problems` (what `check_checkpoint_storage`, and so `inspect`, route 1 and route 2, say before any
  load) reads the entry's pickle without running it: every global it names must be one of the few a tensor or an
  OrderedDict pickles as (`ALLOWED_GLOBALS`); a name it cannot read statically (a STACK_GLOBAL not fed by literal
  strings, an extension code) is refused too. About 20x cheaper than unpickling, and nothing is built;
- `bytes_entry_value` (what route 2's load reads instead of DCP's `torch.load`,
  `snapshot.trainer_formats.megatron_load`) loads it with `weights_only=True` (`safe_load.load_pt_bytes`: tensors within
  the entry's bytes) and walks the value against the allow-list, iteratively, nested at most MAX_PT_NESTING deep.
Entries with the same bytes (a model's `[None]`s are identical) are judged once.
"""

from __future__ import annotations

import hashlib
import os
import pickletools
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError, UnsafeFileError
from axrl_spike_replay.snapshot.dcp.checkpoint_entries import archive_records
from axrl_spike_replay.snapshot.safe_load import MAX_PT_NESTING, human_bytes, load_pt_bytes, records_problem

MAX_BYTES_ENTRY = 64 * 1024 * 1024  # an extra state is bytes to kilobytes; an FP8 recipe's history a few MB at most
# the globals `torch.save` writes for None, tensors and plain containers (besides the storage classes and dtypes of
# `torch`, checked by name below); the weights-only unpickler of the load admits these and more
ALLOWED_GLOBALS = frozenset(
    {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("_codecs", "encode"),  # how protocol 2 pickles bytes: `_codecs.encode(text, "latin1")`
    }
)
_LEAVES = frozenset({type(None), bool, int, float, str, bytes})
_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING"})
_MEMO_STORES = frozenset({"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader
_LABEL = "\0entry\0"  # stands for the entry's label while a verdict is shared by entries with the same bytes
_REFUSED = "; nothing in it was run"


def entry_label(path: Path, name: str, offset: int, length: int) -> str:
    """How messages name one entry of a checkpoint data file (as `checkpoint_entries` names tensor entries)."""
    return f"{path} (entry of {shown(name, 120)}, bytes {offset}-{offset + length})"


def bytes_entry_value(data: bytes, label: str) -> Any:
    """What a bytes entry holds, loaded weights-only; UnsafeFileError or SnapshotError, worded with `label`, for one
    that holds anything beyond the allow-list or is not a torch archive within its bytes. Nothing in it runs."""
    if len(data) > MAX_BYTES_ENTRY:
        raise SnapshotError(_too_large(label, len(data)))
    value = load_pt_bytes(data, label)
    beyond = _beyond_allowed(value)
    if beyond is not None:
        raise UnsafeFileError(
            f"{label}: refused: a bytes entry holds {beyond}, not None, numbers, strings, tensors or lists, tuples "
            f"and dicts of them (what a Megatron `_extra_state` holds){_REFUSED}"
        )
    return value


def _too_large(label: str, size: int) -> str:
    return f"{label}: a bytes entry of {human_bytes(size)}, more than the {human_bytes(MAX_BYTES_ENTRY)} limit"


def _beyond_allowed(value: Any) -> str | None:
    """What in `value` is not on the allow-list (its type and where), or None. Iterative: depth is bounded, not the
    interpreter's stack."""
    import torch

    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        kind = type(item)
        if kind in _LEAVES or isinstance(item, torch.Tensor):
            continue
        if depth >= MAX_PT_NESTING:
            return f"containers nested deeper than {MAX_PT_NESTING} levels (at {where or 'top'})"
        if isinstance(item, dict) and kind.__module__ in ("builtins", "collections"):
            for key, child in item.items():
                if type(key) not in _LEAVES:
                    return f"a key of type {type(key).__name__} (at {where or 'top'})"
                stack.append((child, f"{where}[{shown(str(key), 40)}]", depth + 1))
        elif isinstance(item, (list, tuple)) and kind.__module__ in ("builtins", "torch"):  # torch.Size is a tuple
            stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))
        else:
            return f"a {kind.__module__}.{kind.__qualname__}" + (f" (at {where})" if where else "")
    return None


def bytes_entry_problems(directory: Path, entries: Iterable[tuple[str, Any]], limit: int = 20) -> list[str]:
    """Why bytes entries are refused, at most `limit` of them: `entries` are (name, DCP `_StorageInfo`) whose offset
    and length lie inside their `.distcp` file (the caller checked). Each entry is read once and its pickle scanned
    without being run; entries with the same bytes share one verdict, and so do pickles with the same bytes (Transformer
    Engine's extra states differ in their tensors' values, not in their pickles)."""
    problems: list[str] = []
    verdicts: dict[bytes, str | None] = {}  # digest of an entry's bytes -> its problem, labelled with _LABEL
    scanned: dict[bytes, str | None] = {}  # digest of a pickle's bytes -> what it does beyond the allow-list
    by_file: dict[str, list[tuple[str, Any]]] = {}
    for name, info in entries:
        by_file.setdefault(info.relative_path, []).append((name, info))
    for relative, items in by_file.items():
        path = directory / relative
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            problems.append(f"{path}: cannot read ({exc.strerror or exc})")
            continue
        try:
            for name, info in sorted(items, key=lambda item: item[1].offset):  # one pass along the file
                if info.length > MAX_BYTES_ENTRY:
                    verdict: str | None = _too_large(_LABEL, info.length)
                else:
                    data = os.pread(fd, info.length, info.offset)
                    digest = hashlib.blake2b(data, digest_size=16).digest()
                    if digest not in verdicts:
                        verdicts[digest] = _problem(data, scanned)
                    verdict = verdicts[digest]
                if verdict:
                    problems.append(verdict.replace(_LABEL, entry_label(path, name, info.offset, info.length), 1))
                    if len(problems) >= limit:
                        return problems
        finally:
            os.close(fd)
    return problems


def _problem(data: bytes, scanned: dict[bytes, str | None]) -> str | None:
    """Why the entry `data` is refused (worded with _LABEL), or None: its archive, then its pickle, read, not run
    (`scanned`: the verdicts of pickles already read, by digest)."""
    try:
        records = archive_records(data)
        problem = records_problem(records, _LABEL, len(data))
        if problem:
            return problem
        pickled = _pickle_of(data, records)
        if pickled is None:
            return f"{_LABEL}: a bytes entry with no pickle (data.pkl): not what torch.save writes{_REFUSED}"
        digest = hashlib.blake2b(pickled, digest_size=16).digest()
        if digest not in scanned:
            scanned[digest] = _named_beyond_allowed(pickled)
        beyond = scanned[digest]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError, NotImplementedError, struct.error) as exc:
        reason = shown(str(exc), 120, quote=False)
        return f"{_LABEL}: refused: not a torch archive, truncated or corrupt ({reason}){_REFUSED}"
    if beyond is None:
        return None
    return f"{_LABEL}: refused: a bytes entry whose pickle {beyond}{_REFUSED}"


def _pickle_of(data: bytes, records: list[Any]) -> bytes | None:
    """The bytes of the archive's `data.pkl` record (stored, as `records_problem` checked), by its local header."""
    for name, _, plain, _, header_offset in records:
        if name == "data.pkl" or name.endswith("/data.pkl"):
            sig, *_, name_length, extra_length = _LOCAL_HEADER.unpack_from(data, header_offset)
            if sig != b"PK\x03\x04":
                raise ValueError(f"no local header for {name}")
            start = header_offset + _LOCAL_HEADER.size + name_length + extra_length
            if start + plain > len(data):
                raise ValueError(f"{name} runs past the entry")
            return data[start : start + plain]
    return None


def _named_beyond_allowed(pickled: bytes) -> str | None:
    """What the pickle does beyond what is allowed, as a phrase ("calls builtins.exec, ..."): the first global it
    names beyond ALLOWED_GLOBALS (and torch's storage classes and dtypes), or what keeps a global from being named,
    or a protocol later than torch's weights-only load reads; None when all is allowed. Reads opcodes only
    (`pickletools.genops`): nothing is built or called. A STACK_GLOBAL is named by the two values pushed just before
    it, literal strings or memo entries holding them; anything else there (a value built by the pickle) is refused."""
    import torch

    pushed: list[Any] = []  # the last two values pushed (a literal string, else None), which a STACK_GLOBAL names
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(pickled):
        number = arg if isinstance(arg, int) else -1  # PROTO's version, a memo index
        if op.name == "PROTO" and number > 2:  # torch.save writes 2; torch's weights-only reader reads no later
            return f"is protocol {number} (torch.save writes 2, all the weights-only load reads)"
        if op.name in ("GLOBAL", "INST"):
            module, _, name = str(arg).partition(" ")
        elif op.name == "STACK_GLOBAL":
            if len(pushed) < 2 or not all(isinstance(value, str) for value in pushed[-2:]):
                return "names a global with values it builds, not literal strings"
            module, name = pushed[-2], pushed[-1]
        elif op.name.startswith("EXT"):
            return f"calls the extension code {shown(arg, 20)}"
        elif op.name in _MEMO_STORES:  # the stack is unchanged
            memo[len(memo) if op.name == "MEMOIZE" else number] = pushed[-1] if pushed else None
            continue
        else:
            value = arg if op.name in _STRINGS else memo.get(number) if op.name in _MEMO_GETS else None
            pushed = [*pushed[-1:], value]
            continue
        pushed = [*pushed[-1:], None]
        module = "builtins" if module == "__builtin__" else module  # protocol 2 spells it as Python 2 did
        if (module, name) in ALLOWED_GLOBALS:
            continue
        found = getattr(torch, name, None) if module == "torch" else None
        if isinstance(found, torch.dtype) or (isinstance(found, type) and name.endswith("Storage")):
            continue
        return (
            f"calls {shown(module, 60, quote=False)}.{shown(name, 60, quote=False)}, beyond the tensors and plain "
            "containers a Megatron `_extra_state` holds"
        )
    return None
