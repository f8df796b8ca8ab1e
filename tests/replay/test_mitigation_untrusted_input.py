"""Mitigation values and sets come from people and agents: an alias bomb, broken YAML, a broken quote or a
binary file is a short, clear error naming the argument or file, never a traceback or an echo of the input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import load_mitigation_set, parse_config, parse_mitigation_args

MAX_ERROR = 2000  # characters: an error says what is wrong, it does not repeat the input


def alias_bomb(levels: int = 6) -> str:
    """A small YAML flow mapping whose aliases expand to 9**levels strings (the issue's had 9 levels, 351 bytes)."""
    parts = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "{" + ", ".join(parts) + "}"


def test_an_alias_bomb_value_is_refused_before_it_expands() -> None:
    with pytest.raises(ConfigError, match=r"mitigation ratio_outlier_mask: uses a YAML alias") as refused:
        parse_mitigation_args([f"ratio_outlier_mask={alias_bomb()}"])
    assert len(str(refused.value)) < MAX_ERROR
    with pytest.raises(ConfigError, match="aliases are refused"):
        parse_config({"ratio_outlier_mask": alias_bomb()}, "mitigations")  # what an MCP client sends


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["ratio_outlier_mask={level: token"], "mitigation ratio_outlier_mask: not valid YAML"),
        (["ratio_outlier_mask={" + "a: " * 5000 + "x}"], "mitigation ratio_outlier_mask: not valid YAML"),
        (["ratio_outlier_mask={a: " + "[" * 100_000 + "]" * 100_000 + "}"], "nests deeper than"),
        (["ratio_outlier_mask={low: " + "1" * 100_000 + "}"], "mitigation ratio_outlier_mask: a value cannot be read"),
        (["advantage_clip=" + "9x" * 500_000], "mitigation advantage_clip: expected a number"),
        (["ratio_outlier_mask=" + "k" * 500_000], "is not KEY:VALUE"),
        (["loss_agg_mode=\x1b[2J" + "m" * 500_000], "loss_agg_mode: must be one of"),
        (["x" * 500_000], "unknown mitigation"),
    ],
)
def test_bad_values_are_short_clear_errors(items: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_mitigation_args(items)
    text = str(refused.value)
    assert message in text and "\x1b" not in text
    assert len(text) < MAX_ERROR + 2000  # the unknown-name error also lists the valid mitigations


def test_an_unknown_key_in_a_mask_mapping_of_mixed_types_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown keys \['1', 'zzz'\]"):
        parse_config({"ratio_outlier_mask": {1: 2, "zzz": 3}})


def test_mitigation_sets_that_are_not_plain_utf8_yaml_lists_are_refused(tmp_path: Path) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"- {advantage_clip: \xff\xfe}\n")
    with pytest.raises(ConfigError, match=re.escape(f"mitigation set {binary}: not UTF-8 text")):
        load_mitigation_set(binary)
    aliased = tmp_path / "aliased.yaml"
    aliased.write_text("- &base {advantage_clip: 1.0}\n- *base\n")
    with pytest.raises(ConfigError, match=re.escape(f"mitigation set {aliased}: uses a YAML alias")):
        load_mitigation_set(aliased)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: cannot read mitigation set (not a regular file)")):
        load_mitigation_set(tmp_path)


def _cli_fails_cleanly(cli, *argv: str) -> str:
    run = cli(*argv)
    assert run.code == 2, run.err
    assert "Traceback" not in run.err and run.out == ""
    assert len(run.err) < MAX_ERROR
    return run.err


def test_the_cli_refuses_an_alias_bomb_mitigation_in_a_short_message(tmp_path: Path, cli) -> None:
    err = _cli_fails_cleanly(cli, "replay", tmp_path / "nowhere", "--mitigation", f"ratio_outlier_mask={alias_bomb()}")
    assert "mitigation ratio_outlier_mask: uses a YAML alias" in err


def test_the_cli_names_an_unclosed_yaml_value(tmp_path: Path, cli) -> None:
    err = _cli_fails_cleanly(cli, "replay", tmp_path / "nowhere", "--mitigation", "ratio_outlier_mask={level: token")
    assert "mitigation ratio_outlier_mask: not valid YAML" in err


def test_the_cli_names_a_sweep_option_with_an_unbalanced_quote(tmp_path: Path, cli) -> None:
    err = _cli_fails_cleanly(cli, "sweep", tmp_path / "nowhere", "--mitigation", "advantage_clip='1 dual_clip_c=3")
    assert '--mitigation "advantage_clip=\'1 dual_clip_c=3": cannot split it' in err and "No closing quotation" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"- {advantage_clip: 1.0}\n- {dual_clip_c: \xff}\n", "not UTF-8 text"),
        (f"- {alias_bomb()}\n".encode(), "uses a YAML alias"),
        (b"- {advantage_clip: [1.0}\n", "not valid YAML"),
    ],
)
def test_the_cli_names_a_bad_mitigation_set_file(tmp_path: Path, cli, content: bytes, message: str) -> None:
    file = tmp_path / "set.yaml"
    file.write_bytes(content)
    err = _cli_fails_cleanly(cli, "sweep", tmp_path / "nowhere", "--mitigation-set", file)
    assert f"mitigation set {file}: {message}" in err
