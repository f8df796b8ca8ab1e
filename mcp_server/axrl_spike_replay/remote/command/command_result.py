"""What an external replay command reports: its result file and its stdout, read as untrusted input.

The command is the trainer's code, run on a node we do not control; its `replay_result.json` is read
with bounds (size, nesting, each field's type and range) and a malformed value is an error naming the
file and the field, never a traceback. The verdict's tolerance is ours (`experiment.verdict.tolerance`): a
`tolerance` in the file is never used. Without a `grad_norm` in the file, the norm is the last match of
the configured pattern in stdout, read one line at a time (lines are capped when they are written).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError, read_bounded
from axrl_spike_replay.untrusted.untrusted_json import parse_untrusted_json
from axrl_spike_replay.vocabulary import Fidelity

MAX_RESULT_BYTES = 4 << 20  # a result document is a few KB; a top-k list of thousands still fits
MAX_DEPTH = 8  # {"top_params": [{"name": ...}]} is three levels
MAX_TOP_PARAMS = 1000
MAX_NAME_CHARS = 512
MAX_WORLD_SIZE = 1 << 20
_DEVICE = re.compile(r"[A-Za-z0-9_:.\-]{1,64}")
_SPELLED = {"nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}
IGNORED_KEYS = ("tolerance",)  # ours decides: a command must not judge itself


@dataclass(frozen=True)
class CommandReport:
    """The fields of a command's result file that the run uses; None where the file does not give one."""

    grad_norm: float | None = None
    fidelity: Fidelity = Fidelity.FULL
    device: str | None = None
    world_size_used: int | None = None
    top_params: list[dict[str, Any]] = field(default_factory=list)
    ignored: tuple[str, ...] = ()  # keys present but never used (see IGNORED_KEYS)


def read_command_result(path: Path, source: str) -> CommandReport:
    """The command's result file at `path` (`source`: its name on the node, for messages), checked field by
    field; AxrlError naming the file and what is wrong."""
    try:
        doc = parse_untrusted_json(read_bounded(path, MAX_RESULT_BYTES), MAX_DEPTH)
    except UntrustedInputError as exc:
        raise AxrlError(f"{source}: {exc}") from None
    if not isinstance(doc, dict):
        raise AxrlError(f"{source}: the command's result must be a JSON object, got a JSON {_kind(doc)}")
    fidelity = doc.get("fidelity", Fidelity.FULL.value)
    return CommandReport(
        grad_norm=_norm(doc, "grad_norm", source) if "grad_norm" in doc else None,
        fidelity=Fidelity.parse(fidelity, "fidelity in the command's result"),
        device=_device(doc["device"], source) if "device" in doc else None,
        world_size_used=_world_size(doc["world_size_used"], source) if "world_size_used" in doc else None,
        top_params=_top_params(doc["top_params"], source) if "top_params" in doc else [],
        ignored=tuple(key for key in IGNORED_KEYS if key in doc),
    )


def grad_norm_from_stdout(path: Path, regex: str) -> float | None:
    """The last match of `regex` (its first group) that parses as a number, searched one line at a time in
    the log at `path`; None when nothing matches."""
    pattern = re.compile(regex)
    found: float | None = None
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            for match in pattern.finditer(line):
                with contextlib.suppress(TypeError, ValueError, IndexError):
                    found = float(match.group(1))
    return found


def _norm(doc: dict[str, Any], key: str, source: str) -> float:
    value = doc[key]
    if isinstance(value, str) and value.strip().lower() in _SPELLED:
        return float(value.strip())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AxrlError(f"{source}: {key} must be a number, got {_kind(value)} {shown(value, 80)}")
    number = float(value)
    if math.isfinite(number) and number < 0:
        raise AxrlError(f"{source}: {key} must not be negative, got {shown(value, 80)}")
    return number


def _device(value: Any, source: str) -> str:
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        raise AxrlError(f"{source}: device must be a device name such as cpu or cuda:0, got {shown(value, 80)}")
    return value


def _world_size(value: Any, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORLD_SIZE:
        raise AxrlError(
            f"{source}: world_size_used must be an integer from 1 to {MAX_WORLD_SIZE}, got {shown(value, 80)}"
        )
    return value


def _top_params(value: Any, source: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise AxrlError(f"{source}: top_params must be a list of {{name, grad_norm}}, got a JSON {_kind(value)}")
    if len(value) > MAX_TOP_PARAMS:
        raise AxrlError(f"{source}: top_params lists {len(value)} entries, more than {MAX_TOP_PARAMS}")
    entries = []
    for index, entry in enumerate(value):
        where = f"top_params[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or "grad_norm" not in entry:
            raise AxrlError(f"{source}: {where} must be an object with a name and a grad_norm, got {shown(entry, 80)}")
        if len(entry["name"]) > MAX_NAME_CHARS:
            raise AxrlError(f"{source}: {where}.name is longer than {MAX_NAME_CHARS} characters")
        entries.append({"name": entry["name"], "grad_norm": _norm(entry, "grad_norm", f"{source}: {where}")})
    return entries


def _kind(value: Any) -> str:
    """The JSON name of a value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)
