"""A library error names the request parameter it is about, neutrally; the CLI shows it as its option."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from axrl_spike_replay.cli import main
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import How, What, Where, replay_request
from axrl_spike_replay.investigation.runs import run_request


@pytest.mark.parametrize(
    ("what", "where", "how", "parameter"),
    [
        ({"verb": "attribute", "top": 0}, Where(), How(), "top"),
        ({}, Where(), How(device="tpu"), "device"),  # type: ignore[arg-type]
        ({}, Where(), How(nproc=0), "nproc"),
        ({"repeat": 0}, Where(), How(), "repeat"),
        ({}, Where(timeout_s=0.0), How(), "timeout_s"),
        ({"verb": "attribute"}, Where(backend="command"), How(), "target"),  # type: ignore[arg-type]
        ({}, Where(patches=("fix.diff",)), How(), "patch"),
    ],
)
def test_the_request_names_the_parameter_it_refuses(
    spike_snapshot: Path, what: dict, where: Where, how: How, parameter: str
) -> None:
    with pytest.raises(ConfigError) as info:
        replay_request(What(spike_snapshot, **what), where, how)
    assert info.value.parameter == parameter
    assert f"`{parameter}`" in str(info.value) and "--" not in str(info.value)


def test_the_engine_names_the_parameter_too(spike_snapshot: Path) -> None:
    with pytest.raises(ConfigError, match="`nproc` 3 is larger than the saved world size 2") as info:
        run_request(replay_request(What(spike_snapshot), how=How(nproc=3)))
    assert info.value.parameter == "nproc"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "{snap}", "--nproc", "3"], "--nproc 3 is larger than the saved world size 2"),
        (["replay", "{snap}", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
        (["replay", "{snap}", "--patch", "fix.diff"], "--patch applies to the training checkout"),
        (
            ["replay", "{snap}", "--backend", "command", "--mitigation", "advantage_clip=1"],
            "--backend command needs a command_backend section",
        ),
        (["attribute", "{snap}", "--top", "0"], "--top must be an integer >= 1"),
    ],
)
def test_the_cli_spells_the_parameter_as_its_option(
    spike_snapshot: Path, workspace: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    argv = [a.format(snap=spike_snapshot) for a in argv] + ["--workspace", str(workspace)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "`" not in err and "Traceback" not in err


def test_every_parameter_a_library_message_names_is_spelled_as_an_option_on_the_cli() -> None:
    """The remaining face-specific wording went neutral: the CLI rewrites each one to a real option."""
    from axrl_spike_replay.cli import build_parser
    from axrl_spike_replay.cli.parameter_names import for_cli

    def options_of(parser: argparse.ArgumentParser) -> set[str]:
        found: set[str] = set()
        for action in parser._actions:
            found |= set(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found |= options_of(sub)
        return found

    options = options_of(build_parser())
    for parameter in ("roots", "workspace", "allow_reduced", "accept_new_host_key", "known_hosts", "patch"):
        flag = for_cli(f"pass `{parameter}`").removeprefix("pass ")
        assert flag in options, (parameter, flag)
