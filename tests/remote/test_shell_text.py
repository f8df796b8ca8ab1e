"""The shell text sent to a node: quoted words, checked setup lines and env names, safe kill and clean-up."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.transport.job import check_temp_dir
from axrl_spike_replay.remote.transport.shell import job_script, kill_group_command, parse_pgid_marker, quote_argv


def test_every_word_is_quoted_and_survives_a_shell() -> None:
    words = ["printf", "%s\\n", "a b", "'q'", '"dq"', "$(id)", "`id`", ";", "&&", "*", "~"]
    out = subprocess.run(["sh", "-c", quote_argv(words)], capture_output=True, text=True).stdout
    assert out.splitlines() == words[2:]


def test_job_script_checks_what_it_is_given() -> None:
    with pytest.raises(ConfigError, match="not a valid shell name"):
        job_script(["true"], env={"BAD-NAME": "x"})
    with pytest.raises(ConfigError, match="spans several lines"):
        job_script(["true"], setup=["a\nb"])
    with pytest.raises(ConfigError, match="empty command"):
        job_script([])
    script = job_script(["echo", "hi there"], cwd="/w d", env={"K": "v v"}, setup=["true"])
    assert "cd -- '/w d' || exit 96" in script and "export K='v v'" in script
    assert script.rstrip().endswith("exec echo 'hi there'")


def test_only_announced_process_groups_are_killed() -> None:
    assert parse_pgid_marker(b"@@axrl-pgid 4242") == 4242
    assert parse_pgid_marker(b"@@axrl-pgid x") is None and parse_pgid_marker(b"log @@axrl-pgid 1") is None
    assert "kill -TERM -4242" in shlex.split(kill_group_command(4242))[-1]
    for bad in (0, 1, -5):
        with pytest.raises(ValueError, match="refusing"):
            kill_group_command(bad)


def test_only_temp_dirs_this_tool_made_are_removed() -> None:
    assert check_temp_dir("/tmp/axrl-ws-abcd1234") == "/tmp/axrl-ws-abcd1234"
    for bad in ("/", "/home/user", "/tmp", "axrl-ws-abcd1234", "/tmp/axrl-"):
        with pytest.raises(ValueError, match="refusing to remove"):
            check_temp_dir(bad)
