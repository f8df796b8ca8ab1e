"""jinja2 rendering of the workspace templates, with filters that keep odd user text from breaking markdown."""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any

import jinja2

from axrl_spike_replay.package_data import templates_dir
from axrl_spike_replay.percent import pct, pct_plain

_BACKTICK_RUN_RE = re.compile(r"`+")


def md_cell(value: Any) -> str:
    """Text safe inside one markdown table cell: pipes, backticks, `<` escaped; newlines as `<br>`."""
    if value is None:
        return ""
    text = fmt(value) if isinstance(value, float) else str(value)
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`").replace("<", "&lt;")
    lines = [line.strip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return "<br>".join(line for line in lines if line) or ""


def md_code(value: Any) -> str:
    """`value` as one inline code span, whatever backticks or newlines it holds."""
    text = " ".join(str(value).replace("\r", "\n").split("\n"))
    longest = max((len(run) for run in _BACKTICK_RUN_RE.findall(text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or longest else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def md_block(value: Any, lang: str = "") -> str:
    """`value` as a fenced code block whose fence is longer than any backtick run inside."""
    text = str(value).rstrip("\n")
    longest = max((len(run) for run in _BACKTICK_RUN_RE.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text}\n{fence}"


def md_item(value: Any) -> str:
    """Text for one list item: continuation lines indented so they stay inside the item."""
    lines = str(value).replace("\r\n", "\n").replace("\r", "\n").strip("\n").split("\n")
    rest = [f"  {_no_block_marker(line)}" if line.strip() else "" for line in lines[1:]]
    return "\n".join([lines[0], *rest])


def md_para(value: Any) -> str:
    """Free text as plain paragraphs: no line can open a heading, fence, block quote or front matter."""
    lines = str(value).replace("\r\n", "\n").replace("\r", "\n").strip("\n").split("\n")
    return "\n".join(_no_block_marker(line) if line.strip() else "" for line in lines)


def _no_block_marker(line: str) -> str:
    """A continuation line that cannot open a heading, fence or block quote inside a list item."""
    stripped = line.lstrip()
    if stripped[:1] in ("#", ">", "=") or stripped.startswith(("```", "~~~", "---", "***")):
        return "\\" + stripped
    return stripped


def fmt(value: Any, digits: int = 4) -> str:
    """A number for people: 4 significant digits, `n/a` for missing, `inf`/`nan` spelled out."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.{digits}g}"
    return str(value)


def counted(n: Any, noun: str, plural: str | None = None) -> str:
    """`1 method`, `5 methods`, `0 methods`: a count with its noun in the right number."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The shared jinja2 environment over `templates/` (strict: a missing field is an error)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        autoescape=False,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        cell=md_cell,
        code=md_code,
        block=md_block,
        item=md_item,
        para=md_para,
        fmt=fmt,
        pct=pct,
        pct_plain=pct_plain,
        counted=counted,
    )
    return env


def render(template: str, **context: Any) -> str:
    """Render `templates/<template>` with `context`."""
    return environment().get_template(template).render(**context)
