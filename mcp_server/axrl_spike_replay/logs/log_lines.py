"""Reading one training-log line: its (iteration, grad norm, loss) and the kind of error it reports.

Understood line formats:
- Megatron-style: `iteration 12/ 1000 | ... | lm loss: 1.2E+00 | ... | grad norm: 3.4 | ...`
- key=value (or key:value): `step=12 grad_norm=3.4 loss=0.1`, `step:12 - actor/grad_norm:3.4 - actor/pg_loss:0.1`

Logs are untrusted text: every pattern here runs in time linear in the line. These are the reference
parsers; `log_reader` runs them only on the lines that can match (and reads the common Megatron shape
with one pattern over many lines), with the same results.
"""

from __future__ import annotations

import re
from functools import lru_cache
from operator import itemgetter

_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf(?:inity)?)"
MEGATRON = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|(.*)", re.IGNORECASE)
# `key=value` pairs, found in linear time. A key is a run of [\w./-] from its first letter; the key can only
# end where its run ends, so when the first letter of a run fails every later start in it fails too. The
# pattern therefore starts only at a run's start (or right after the previous pair, `_KV_AT`), skips the
# run's leading non-letters and matches key, separator and number possessively: no start is retried inside
# a run and nothing backtracks (a plain `[A-Za-z_][\w./-]*` search is quadratic on a long word).
# Same pairs as `([A-Za-z_][\w./-]*)\s*[=:]\s*(NUM)(?![\w.])` with findall.
_KV_BODY = rf"(?:(?![A-Za-z_])[\w./-])*+([A-Za-z_][\w./-]*+)\s*+[=:]\s*+((?>{_NUM}))(?![\w.])"
_KV_AT = re.compile(_KV_BODY, re.IGNORECASE)
_KV_START = re.compile(rf"(?<![\w./-]){_KV_BODY}", re.IGNORECASE)
# The same pairs in one C call where no pair is followed by `/` or `-`: only there can the next pair start
# right at the previous one's end (`_KV_AT`) rather than at a run's start (`_KV_START`); the third group
# (what follows each pair) says whether the line is such.
_KV_FOLLOWED = re.compile(rf"(?<![\w./-]){_KV_BODY}(?=([/-])?)", re.IGNORECASE)
_ends_at_run = itemgetter(2)
_key = itemgetter(0)
STEP_KEYS = frozenset({"step", "iteration", "iter", "global_step", "it"})
_GRAD_KEYS = {"grad_norm", "gradnorm", "grad_norm_pre_clip", "global_grad_norm", "total_grad_norm"}
LOSS_KEYS = ("lm_loss", "loss", "total_loss", "train_loss", "policy_loss", "pg_loss")
# Each of these is linear: one `\b` start per word and no nested or adjacent overlapping repeats.
TRACEBACK = "Traceback (most recent call last)"
_EXCEPTION = re.compile(r"\b[A-Z]\w*(?:Error|Exception)\b(?::|\s*$)")
_ERROR = re.compile(r"\b(?:ERROR|FATAL|CRITICAL)\b|CUDA out of memory|NCCL (?:error|timeout)", re.IGNORECASE)
_NON_FINITE = re.compile(r"[:=]\s*[-+]?(?:nan|inf(?:inity)?)\b", re.IGNORECASE)


def _leaf(key: str) -> str:
    return key.rsplit("/", 1)[-1].lower().replace("-", "_").replace(" ", "_")


_PLANNED_LINE_CHARS = 8192  # lines this long or shorter have their keys' plan cached (bounded memory)


@lru_cache(maxsize=64)  # a run logs the same keys in the same order on every line
def _plan(keys: tuple[str, ...]) -> tuple[int | None, int | None, int | None]:
    """Where a line with these keys (left to right) has its step, grad norm and loss values: the first key
    whose leaf is a step key; of the leaves in order of first appearance, the first grad-norm one and the
    first loss key by `LOSS_KEYS` order, each at its last appearance (as a dict of the pairs keeps it)."""
    leaves = [_leaf(key) for key in keys]
    step = next((at for at, leaf in enumerate(leaves) if leaf in STEP_KEYS), None)
    last = {leaf: at for at, leaf in enumerate(leaves)}
    grad = next((last[k] for k in last if k in _GRAD_KEYS or k.endswith("grad_norm")), None)
    loss = next((last[k] for k in LOSS_KEYS if k in last), None)
    return step, grad, loss


def key_values(line: str) -> list[tuple[str, str]]:
    """The `key=value` / `key:value` pairs (numeric values) of a line, left to right, in linear time."""
    return [(pair[0], pair[1]) for pair in _pairs(line)]


def _pairs(line: str) -> list[tuple[str, ...]]:
    """`key_values`, each pair maybe with a third item."""
    found = _KV_FOLLOWED.findall(line)
    return _key_values_stepwise(line) if any(map(_ends_at_run, found)) else found


def _key_values_stepwise(line: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    match = _KV_START.search(line)
    while match:
        pairs.append((match.group(1), match.group(2)))
        end = match.end()
        match = _KV_AT.match(line, end) or _KV_START.search(line, end)
    return pairs


def pair_spans(line: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where the key and the value of each of `key_values(line)` are in `line` (the same matches, by span)."""
    found = list(_KV_FOLLOWED.finditer(line))
    if any(match.group(3) for match in found):
        found = []
        match = _KV_START.search(line)
        while match:
            found.append(match)
            match = _KV_AT.match(line, match.end()) or _KV_START.search(line, match.end())
    return [(match.span(1), match.span(2)) for match in found]


def plan(keys: tuple[str, ...]) -> tuple[int | None, int | None, int | None]:
    """Which pairs of a line with these keys give its step, grad norm and loss (as `parse_line` reads them)."""
    return _plan(keys)


def parse_line(line: str) -> tuple[int, float | None, float | None] | None:
    """(iteration, grad_norm, loss) from one log line, or None when it carries no training step."""
    # `iteration` in any case has `terat` lowered (only its `i` has non-ASCII case folds): most lines are
    # ruled out without running the case-insensitive pattern
    match = MEGATRON.search(line) if "terat" in line.lower() else None
    if match:
        values: dict[str, float] = {}
        for part in match.group(2).split("|"):
            key, sep, value = part.partition(":")
            if sep:
                try:
                    values[_leaf(key.strip())] = float(value.strip().split()[0])
                except (ValueError, IndexError):
                    continue
        grad = values.get("grad_norm")
        loss = next((values[k] for k in LOSS_KEYS if k in values), None)
        if loss is None:
            loss = next((v for k, v in values.items() if k.endswith("_loss") and k != "loss_scale"), None)
        return int(match.group(1)), grad, loss
    pairs = _pairs(line)
    keys = tuple(map(_key, pairs))
    step_at, grad_at, loss_at = (_plan if len(line) <= _PLANNED_LINE_CHARS else _plan.__wrapped__)(keys)
    if step_at is None:
        return None
    try:
        iteration = int(float(pairs[step_at][1]))
    except (ValueError, OverflowError):
        return None
    if grad_at is None and loss_at is None:
        return None
    grad = float(pairs[grad_at][1]) if grad_at is not None else None
    return iteration, grad, (float(pairs[loss_at][1]) if loss_at is not None else None)


def error_kind(line: str) -> str | None:
    """The kind of error a log line reports (traceback, exception, error, non_finite), or None.

    Each pattern runs only when the words it needs are in the line (a cheap test that never says no to a
    line the pattern matches: under IGNORECASE only ı, İ, ſ and K fold onto ASCII letters, and only the
    `i` of CRITICAL is among them).
    """
    if TRACEBACK in line:
        return "traceback"
    if ("Error" in line or "Exception" in line) and _EXCEPTION.search(line):
        return "exception"
    low = line.lower()
    words = "error" in low or "fatal" in low or "nccl" in low or "cuda out of memory" in low
    if (words or ("cr" in low and "cal" in low)) and _ERROR.search(line):
        return "error"
    if ("nan" in low or "nf" in low) and ("=" in line or ":" in line) and _NON_FINITE.search(line):
        return "non_finite"
    return None
