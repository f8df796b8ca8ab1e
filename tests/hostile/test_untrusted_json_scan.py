"""The depth check that runs before any untrusted JSON is parsed reads each character once: an unterminated string
full of escaped quotes (`"\\"\\"\\"...`) once made it rescan the rest of the text from every quote, quadratic in the
text's length. Counted as work (the spans the scanner matches), never timed. A run of brackets is one match, so
3,000 levels cost a few matches; and the cut of what nests too deep keeps exactly the shallow document."""

from __future__ import annotations

import json
import random

import pytest

from axrl_spike_replay.untrusted.untrusted_json import (
    _JSON_TOKEN,
    UntrustedJsonError,
    json_depth,
    json_within,
    parse_untrusted_json,
)


@pytest.mark.parametrize("tail", ["", "\\", "x", "\n"])
def test_an_unterminated_string_is_one_token_to_the_end(tail: str) -> None:
    text = '{"a": "' + '\\"' * 50_000 + tail
    spans = [m.span() for m in _JSON_TOKEN.finditer(text)]
    # every character after the opening brace is matched once: a quote's match never fails and is never retried
    assert spans[0] == (0, 1) and spans[-1][1] == len(text) and len(spans) == 3
    with pytest.raises(UntrustedJsonError, match="not valid JSON"):
        parse_untrusted_json(text.encode(), 8)


def test_the_depth_skips_brackets_in_strings_and_escaped_quotes() -> None:
    assert json_depth('{"a": [1, {"b": "]]] \\" [[[ \\\\"}, "[["]}') == 3
    assert json_depth('[[["x\\\\"]]]') == 3
    assert json_depth("[" * 3000 + "]" * 3000) == 3000
    assert len(list(_JSON_TOKEN.finditer("[" * 3000 + "]" * 3000))) == 2  # two runs, whatever the depth
    with pytest.raises(UntrustedJsonError, match="nests deeper than 64 levels"):
        parse_untrusted_json(("[" * 3000 + "]" * 3000).encode(), 64)


def _depth(value: object) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max(map(_depth, children), default=0)


def _cut(value: object, limit: int, depth: int = 0) -> object:
    if not isinstance(value, (list, dict)):
        return value
    if depth == limit:
        return None
    if isinstance(value, list):
        return [_cut(v, limit, depth + 1) for v in value]
    return {k: _cut(v, limit, depth + 1) for k, v in value.items()}


def test_depth_and_cut_agree_with_the_parsed_document_on_random_documents() -> None:
    """Against a recursive reference on the parsed document: brackets and quotes inside strings, mixed runs of
    brackets (`[{[`, `]}]`), every cut level."""
    rng = random.Random(29)

    def document(depth: int) -> object:
        roll = rng.random()
        if depth > 12 or roll < 0.3:
            return rng.choice([1, "a]", '[{\\"', None, "x}", 2.5])
        if roll < 0.65:
            return [document(depth + 1) for _ in range(rng.randint(0, 3))]
        return {f"k{i}[": document(depth + 1) for i in range(rng.randint(0, 3))}

    for _ in range(2000):
        doc = document(0)
        text = json.dumps(doc, separators=(rng.choice([",", ", "]), ":"))
        assert json_depth(text) == _depth(doc), text
        for limit in (0, 1, 2, 3, 6):
            shallow, cut = json_within(text, limit)
            assert json.loads(shallow) == _cut(doc, limit) and cut == (_depth(doc) > limit), (text, limit)
