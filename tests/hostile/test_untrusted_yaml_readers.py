"""Untrusted YAML is read by libyaml (C) where it can be: the same document as the Python loader for every text
both read, and the Python loader's own refusal for an alias or deep nesting. libyaml reads a few texts the Python
scanner refuses (a tab after a scalar): those are read, not refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.untrusted import untrusted_yaml

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
pytestmark = pytest.mark.skipif(not hasattr(yaml, "CSafeLoader"), reason="PyYAML built without libyaml")


def _python_reading(text: str) -> object:
    """The Python loader alone: what `load_untrusted_yaml` gave before libyaml read it."""
    loader = untrusted_yaml._NoAliasLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_every_committed_yaml_file_reads_the_same_both_ways() -> None:
    texts = [p.read_text() for p in sorted(FIXTURES.rglob("*.yaml"))]
    assert len(texts) >= 3
    for text in texts:
        assert _same(untrusted_yaml._load_with_libyaml(text), _python_reading(text))


yaml_text = st.text(alphabet=st.sampled_from(list("{}[]:,'\"!-|> \n\t#0123456789.eE+abxyn~&*<=_")), max_size=80)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=yaml_text)
def test_any_text_reads_as_the_python_loader_reads_it_or_is_refused_as_it_refuses(text: str) -> None:
    fast = untrusted_yaml._load_with_libyaml(text)
    try:
        expected = _python_reading(text)
    except ConfigError:  # an alias or too deep: never read by libyaml, refused by the Python loader as before
        assert fast is untrusted_yaml._NOT_READ, text
        return
    except (yaml.YAMLError, ValueError, RecursionError):
        return  # not YAML to the Python scanner; libyaml may read it
    assert fast is untrusted_yaml._NOT_READ or _same(fast, expected), (text, fast, expected)


def test_aliases_and_deep_nesting_are_refused_with_the_same_messages() -> None:
    with pytest.raises(ConfigError, match=r"uses a YAML alias \(\*'a'\)"):
        untrusted_yaml.load_untrusted_yaml("x: &a [1, 2]\ny: *a\n", "set.yaml")
    with pytest.raises(ConfigError, match="nests deeper than 64 levels"):
        untrusted_yaml.load_untrusted_yaml("[" * 70 + "]" * 70, "set.yaml")
