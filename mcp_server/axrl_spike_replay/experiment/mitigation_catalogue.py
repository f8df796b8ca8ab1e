"""The documentation generated from the mitigation declarations (`experiment.mitigations.MITIGATIONS`).

Three blocks, each between `<!-- NAME:begin -->` and `<!-- NAME:end -->` markers: the skill catalogue's
table of names and values and its "when to try what" advice (skills/axrl-spike-replay/references/
mitigation-catalogue.md), and the README's list of names. `scripts/render_mitigation_catalogue.py`
rewrites them; a test fails when the committed files differ from what the declarations generate.
"""

from __future__ import annotations

from pathlib import Path

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.mitigations import MITIGATIONS, SYMPTOMS

CATALOGUE = Path("skills") / "axrl-spike-replay" / "references" / "mitigation-catalogue.md"
README = Path("README.md")
TABLE, ADVICE, NAMES = "mitigation-table", "mitigation-advice", "mitigation-names"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table_block() -> str:
    """The catalogue's table: name, accepted values, what it changes, what it does."""
    lines = ["| name | values | changes | what it does |", "|---|---|---|---|"]
    lines += [f"| `{m.name}` | {_cell(m.values)} | {m.target} | {_cell(m.doc)} |" for m in MITIGATIONS.values()]
    return "\n".join(lines)


def advice_block() -> str:
    """The catalogue's advice: per symptom, the mitigations to try (in declaration order)."""
    groups: list[str] = []
    for symptom, opening in SYMPTOMS.items():
        bullets = [f"- {a.text}" for m in MITIGATIONS.values() for a in m.advice if a.symptom == symptom]
        if bullets:
            groups.append("\n".join([opening, *bullets]))
    return "\n\n".join(groups)


def names_block() -> str:
    """The README's inline list of names."""
    return ", ".join(f"`{name}`" for name in MITIGATIONS)


def with_block(text: str, name: str, block: str, source: str) -> str:
    """`text` with what lies between the `name` markers replaced by `block`; AxrlError when a marker is missing."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise AxrlError(f"{source}: no {begin} ... {end} markers to put the generated {name} between")
    inline = "\n" not in text[start:stop]  # a list inside a sentence stays on its line
    inner = block if inline else f"\n{block}\n"
    return text[: start + len(begin)] + inner + text[stop:]


def rendered_files(repo: Path) -> dict[Path, str]:
    """{path: wanted text} for every file holding a generated block, from the files as they are in `repo`."""
    catalogue = (repo / CATALOGUE).read_text(encoding="utf-8")
    catalogue = with_block(catalogue, TABLE, table_block(), str(CATALOGUE))
    catalogue = with_block(catalogue, ADVICE, advice_block(), str(CATALOGUE))
    readme = with_block((repo / README).read_text(encoding="utf-8"), NAMES, names_block(), str(README))
    return {repo / CATALOGUE: catalogue, repo / README: readme}
