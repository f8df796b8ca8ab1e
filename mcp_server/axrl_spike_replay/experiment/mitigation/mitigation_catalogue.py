"""The documentation generated from the mitigation declarations (`experiment.mitigation.mitigations.MITIGATIONS`).

Blocks, each between `<!-- NAME:begin -->` and `<!-- NAME:end -->` markers: the table of names and values,
the "when to try what" advice and the table of each mitigation's setting in the trainers (skills/axrl-spike-replay/
references/mitigation-catalogue.md for agents; docs/mitigations.md for people). `scripts/
render_mitigation_catalogue.py` rewrites them; a test fails when the committed files differ from what the
declarations generate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError
from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS, SYMPTOMS
from axrl_spike_replay.experiment.mitigation.trainer_settings import TRAINERS

CATALOGUE = Path("skills") / "axrl-spike-replay" / "references" / "mitigation-catalogue.md"
DOCS = Path("docs") / "mitigations.md"
TABLE, ADVICE, SETTINGS = "mitigation-table", "mitigation-advice", "mitigation-settings"
# The value each mitigation's trainer settings are shown with (one a user would try first).
EXAMPLES: dict[str, Any] = {
    "mismatch_token_clip_max": 2,
    "ratio_outlier_mask": "token",
    "advantage_clip": 1,
    "log_ratio_clip": 5,
    "loss_agg_mode": "seq-mean-token-mean",
    "is_base_logprobs": "old",
    "clip_eps_low": 0.1,
    "clip_eps_high": 0.1,
    "dual_clip_c": 3,
    "kl_coef": 0.01,
    "entropy_coef": 0.001,
    "aux_loss_coef": 0.01,
    "z_loss_coef": 0.001,
    "routing_replay": "all",
    "current_routing_layers": [1],
    "balance_negative_advantages": True,
    "advantage_outlier_mask": 5,
    "drop_samples": "0:3",
    "initial_model": "/path/to/initial/checkpoint",
    "drop_ranks": "1",
    "keep_ranks": "0",
    "recompute": "routes:rank1,old_logprobs:rank1",
    "kl_estimator": "low_var_kl",
    "kl_clamp": 10,
    "loss_scale": "2@1",
    "importance_sampling_level": "sequence",
    "trl_loss_type": "cispo",
    "sapo_temperatures": "1:2",
    "delta": 1.5,
    "rollout_correction": "sequence_mask:0.5:2",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


PER_RANK = {"": "", "optional": "yes", "required": "only"}  # `per_rank` as the table's column shows it


def table_block() -> str:
    """The catalogue's table: name, accepted values, what it changes, whether it takes `@RANKS`, what it does."""
    lines = ["| name | values | changes | per rank (`@RANKS`) | what it does |", "|---|---|---|---|---|"]
    lines += [
        f"| `{m.name}` | {_cell(m.values)} | {m.target} | {PER_RANK[m.per_rank]} | {_cell(m.doc)} |"
        for m in MITIGATIONS.values()
    ]
    return "\n".join(lines)


def advice_block() -> str:
    """The catalogue's advice: per symptom, the mitigations to try (in declaration order)."""
    groups: list[str] = []
    for symptom, opening in SYMPTOMS.items():
        bullets = [f"- {a.text}" for m in MITIGATIONS.values() for a in m.advice if a.symptom == symptom]
        if bullets:
            groups.append("\n".join([opening, *bullets]))
    return "\n\n".join(groups)


def settings_block() -> str:
    """Each mitigation, at an example value, as each trainer's own setting (or why it has none)."""
    from axrl_spike_replay.experiment.mitigation.mitigations import parse_config
    from axrl_spike_replay.experiment.mitigation.trainer_changes import trainer_changes

    missing = sorted(set(MITIGATIONS) - set(EXAMPLES))
    if missing:
        raise AxrlError(f"no example value for {', '.join(missing)} in mitigation_catalogue.EXAMPLES")
    lines = ["| mitigation | " + " | ".join(TRAINERS.values()) + " |", "|---|" + "---|" * len(TRAINERS)]
    for name in MITIGATIONS:
        config = parse_config({name: EXAMPLES[name]})
        cells = []
        for trainer in TRAINERS:
            changes = trainer_changes(config, trainers=(trainer,))
            cells.append(
                "<br>".join(
                    f"`{c.setting}`" + (f" ({_cell(c.note)})" if c.note else "") if c.setting else f"— {_cell(c.note)}"
                    for c in changes
                )
            )
        shown = json.dumps(EXAMPLES[name]) if not isinstance(EXAMPLES[name], str) else EXAMPLES[name]
        lines.append(f"| `{name}: {_cell(shown)}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    out = {}
    for path, blocks in (
        (CATALOGUE, ((TABLE, table_block), (ADVICE, advice_block), (SETTINGS, settings_block))),
        (DOCS, ((TABLE, table_block), (SETTINGS, settings_block))),
    ):
        text = (repo / path).read_text(encoding="utf-8")
        for name, block in blocks:
            text = with_block(text, name, block(), str(path))
        out[repo / path] = text
    return out
