"""What a method's name says it does, against the change its attempt ran.

A method file's name is what people read first (`tis-clip-2.md`, the report's "What to change" list), so `method add`
warns when the name says one mitigation and the attempt ran another (say `tis-clip-2` on an attempt that ran
`ratio_outlier_mask`). A name says a mitigation when it is a known method's name (a shipped method or one of the
seed workflow's), when it holds a mitigation's whole name (`ratio-outlier-mask-v2`), or when it holds a word that
only one mitigation's known method names use and no mitigation's own name does (`tis`, from
`token-mismatch-tis-clip-2`). Generic words and the settings' values (`2`, `old`, `first`) say nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS

# words of this domain that name no one mitigation, whatever method names they appear in
_GENERIC = frozenset({"moe", "layer", "layers", "spike", "replay", "fix", "method", "only", "diagnostic", "tokens"})
_WORD_RE = re.compile(r"[a-z]+[a-z0-9]*")


def words(name: str) -> list[str]:
    """The words of a slug or a mitigation name: `Token-Mismatch_TIS-clip-2` -> token, mismatch, tis, clip, 2."""
    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


def ran(mitigations: Mapping[str, Any]) -> set[str]:
    """The mitigation names a normalised config sets: `{"routing": {"replay": "off"}}` sets `routing_replay`."""
    names: set[str] = set()

    def walk(doc: Mapping[str, Any], prefix: str) -> None:
        for key, value in doc.items():
            name = f"{prefix}{key}"
            names.add(name)
            if isinstance(value, Mapping):
                walk(value, f"{name}_")

    walk(mitigations, "")
    return names


def _values(config: Mapping[str, Any]) -> set[str]:
    out: set[str] = set()
    for value in config.values():
        if isinstance(value, Mapping):
            out |= _values(value)
        else:
            out |= set(words(str(value)))
    return out


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return n > 0 and any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def said_by(name: str, known: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """The mitigations `name` says it applies; `known` {method slug: its normalised config} (shipped and seed)."""
    claimed = set(ran(known[name])) if name in known else set()
    mine = words(name)
    claimed |= {m for m in MITIGATIONS if _contains(mine, words(m))}
    in_names = {w for m in MITIGATIONS for w in words(m)}
    owners: dict[str, set[str]] = {}
    for slug, config in known.items():
        values = _values(config)
        for word in set(words(slug)) - in_names - values - _GENERIC:
            if _WORD_RE.fullmatch(word) and len(word) >= 3:
                owners.setdefault(word, set()).update(m for m in ran(config) if m in MITIGATIONS)
    claimed |= {m for w in mine for m in owners.get(w, set()) if len(owners[w]) == 1}
    return {m for m in claimed if m in MITIGATIONS}


def name_warning(name: str, mitigations: Mapping[str, Any], known: Mapping[str, Mapping[str, Any]]) -> str | None:
    """A warning when `name` says a mitigation the attempt (its normalised `mitigations`) did not run; else None."""
    said = said_by(name, known)
    done = ran(mitigations)
    missing = sorted(m for m in said if m not in done)
    if not missing or not done:
        return None
    changed = sorted(done & set(MITIGATIONS)) or sorted(done)
    return (
        f"the name {name!r} says {_listed(missing)}, but the attempt ran {_listed(changed)}; the method file, the "
        "index and the report show this name: if it is a slip, remove the file and add the attempt again under a "
        "name that says what it changed"
    )


def _listed(names: Iterable[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)
