"""The one conversion of library values to plain JSON, used by every file, record and `--json` output.

Rules:
- dataclasses become dicts (a dataclass's own `to_json()` is used when it has one), mappings get string keys,
  tuples, lists and sets become lists, paths become strings;
- a non-finite float (NaN, +inf, -inf) becomes **null**. JSON has no spelling for them, and the MCP output
  schemas declare such fields as numbers: pydantic writes null there too, so a value looks the same in a
  result file, a task record, `--json` and a tool result. The verdict says what happened (a replay whose
  grad norm overflowed is `worse` or `not_reproduced`, never a missing number in disguise);
- everything else is left as it is.

Files and task records written before this rule spell them "nan", "inf", "-inf"; their readers take a
number with `float()`, which reads both spellings.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any


def to_jsonable(value: Any) -> Any:
    """`value` as plain JSON (see the module's rules: non-finite floats become null)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_json = getattr(value, "to_json", None)
        if callable(to_json):
            return to_jsonable(to_json())
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "numel", lambda: 2)() == 1:
        return to_jsonable(item())  # a one-element tensor
    return value
