"""The depth check that runs before any untrusted JSON is parsed reads each character once: an unterminated string
full of escaped quotes (`"\\"\\"\\"...`) once made it rescan the rest of the text from every quote, quadratic in the
text's length. Counted as work (the spans the scanner matches), never timed."""

from __future__ import annotations

import pytest

from axrl_spike_replay.untrusted_json import _JSON_TOKEN, UntrustedJsonError, json_depth, parse_untrusted_json


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
    with pytest.raises(UntrustedJsonError, match="nests deeper than 64 levels"):
        parse_untrusted_json(("[" * 3000 + "]" * 3000).encode(), 64)
