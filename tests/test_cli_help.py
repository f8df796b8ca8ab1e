"""`--help` answers every question a newcomer has about an option: every verb, option and argument of the CLI says
what it is, and options with a fixed set of values list them."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from axrl_spike_replay.capture.reference.presets import PRESETS
from axrl_spike_replay.cli import build_parser


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, argparse.Action]]:
    """(verb path, action) for every argument of every verb, sub-verbs included; verbs themselves as actions too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield " ".join((*path, name)), helps[name]
                yield from _walk(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield " ".join(path), action


ACTIONS = list(_walk(build_parser()))


def test_the_walk_reaches_every_verb() -> None:
    verbs = {path for path, _ in ACTIONS}
    assert {"demo", "capture", "replay", "sweep", "task note", "method add", "report", "mcp"} <= verbs


def test_every_verb_option_and_argument_has_help() -> None:
    missing = [
        f"{verb} {'/'.join(action.option_strings) or action.metavar or action.dest}"
        for verb, action in ACTIONS
        if not action.help or action.help == argparse.SUPPRESS or not action.help.strip()
    ]
    assert missing == []


def test_demo_help_lists_the_presets_and_describes_the_seed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all(name in text for name in PRESETS)
    assert "--seed S seed of the reference run" in text
