"""`spike-replay.yaml`: named targets and the external replay command, validated with errors that name the key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.command.command_backend import render_command, render_path
from axrl_spike_replay.remote.command.command_result import grad_norm_from_stdout
from axrl_spike_replay.remote.workspace_config import (
    DEFAULT_GRAD_NORM_REGEX,
    load_workspace_config,
    resolve_target,
)

EXAMPLE = """\
targets:
  gpu-a:
    ssh: "ssh -p 26461 root@10.100.4.23"
    python: /opt/venv/bin/python
    setup: ["source /opt/env.sh"]
command_backend:
  workdir: /root/axrl
  command: "python tools/reproduce_spike.py --snapshot {snapshot} --out {out}"
  result_json: "{out}/replay_result.json"
  grad_norm_regex: '\\bgrad_norm[=: ]+([-+]?(?:[0-9]+\\.?[0-9]*|\\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?(?:nan|inf))'
"""


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "spike-replay.yaml").write_text(text)
    return tmp_path


def test_the_documented_example_loads(tmp_path: Path) -> None:
    config = load_workspace_config(write(tmp_path, EXAMPLE))
    gpu = config.targets["gpu-a"]
    assert (gpu.ssh.host, gpu.ssh.port, gpu.ssh.user) == ("10.100.4.23", 26461, "root")
    assert gpu.python == "/opt/venv/bin/python" and gpu.setup == ("source /opt/env.sh",)
    backend = config.command_backend
    assert (
        backend is not None and backend.workdir == "/root/axrl" and backend.grad_norm_regex == DEFAULT_GRAD_NORM_REGEX
    )


def test_no_file_is_an_empty_config_and_targets_fall_back_to_ssh_text(tmp_path: Path) -> None:
    config = load_workspace_config(tmp_path)
    assert config.targets == {} and config.command_backend is None
    literal = resolve_target("root@10.0.0.5:2222", config, remote_python="/usr/bin/python3.11")
    assert (
        literal.ssh.port == 2222 and literal.python == "/usr/bin/python3.11" and literal.label == "root@10.0.0.5:2222"
    )


def test_a_named_target_keeps_its_name_and_remote_python_overrides(tmp_path: Path) -> None:
    config = load_workspace_config(write(tmp_path, EXAMPLE))
    named = resolve_target("gpu-a", config)
    assert named.label == "gpu-a" and named.python == "/opt/venv/bin/python"
    assert resolve_target("gpu-a", config, "/other/python").python == "/other/python"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("targets: [1, 2]\n", "targets must be a mapping"),
        ("targets:\n  a: {python: x}\n", "targets.a.ssh is missing"),
        ("targets:\n  a: {ssh: 'ssh -L 1:x:2 h'}\n", "targets.a.ssh: SSH target"),
        ("targets:\n  a: {ssh: h, sudo: yes}\n", "targets.a: unknown key(s) sudo"),
        ("targets:\n  'a b': {ssh: h}\n", "target name 'a b'"),
        ("targetz: {}\n", "unknown key(s) targetz"),
        ("command_backend: {command: run}\n", "command_backend.workdir is missing"),
        ("command_backend: {workdir: /w, command: 'run {snap}'}\n", "unknown placeholder {snap}"),
        ("command_backend: {workdir: /w, command: \"run '{snapshot}'\"}\n", "without quotes around it"),
        ("command_backend: {workdir: /w, command: 'run --x=\"{out}\"'}\n", "without quotes around it"),
        ("command_backend: {workdir: /w, command: run, grad_norm_regex: 'grad_norm'}\n", "needs a group"),
        ("command_backend: {workdir: /w, command: run, grad_norm_regex: '('}\n", "not a valid regular expression"),
        ("command_backend: {workdir: /w, command: 'run {'}\n", "bad placeholder syntax"),
        ("targets: {a: {ssh: h}\n", "not valid YAML"),
    ],
)
def test_mistakes_are_named_with_the_file_and_key(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_workspace_config(write(tmp_path, text))
    assert says in str(info.value) and "spike-replay.yaml" in str(info.value)


def test_placeholders_are_shell_quoted_in_commands_and_literal_in_paths() -> None:
    command = render_command("run --snapshot {snapshot} --out {out} {{literal}}", "/s p/$(x)", "/o'ut")
    assert command == "run --snapshot '/s p/$(x)' --out '/o'\"'\"'ut' {literal}"
    assert render_path("{out}/replay_result.json", "/s", "/o'ut") == "/o'ut/replay_result.json"


def test_the_last_grad_norm_printed_wins(tmp_path: Path) -> None:
    log = tmp_path / "stdout.log"
    log.write_text("step 1 grad_norm=1.5\nwarning: grad_norm: n/a\nfinal grad_norm = 3.25e+01\n")
    assert grad_norm_from_stdout(log, DEFAULT_GRAD_NORM_REGEX) == 32.5
    log.write_text("nothing here\n")
    assert grad_norm_from_stdout(log, DEFAULT_GRAD_NORM_REGEX) is None


def test_the_default_pattern_reads_grad_norm_as_a_whole_word(tmp_path: Path) -> None:
    """A trainer prints its config before the step: `max_grad_norm: 1.0` is a setting, not the step's norm."""
    log = tmp_path / "stdout.log"
    log.write_text("step 1 - actor/grad_norm:56.75 - actor/lr:1e-6\nconfig: max_grad_norm: 1.0 clip_grad_norm=2\n")
    assert grad_norm_from_stdout(log, DEFAULT_GRAD_NORM_REGEX) == 56.75
    log.write_text("config: max_grad_norm: 1.0\ngrad_norm_clip: 3\n")
    assert grad_norm_from_stdout(log, DEFAULT_GRAD_NORM_REGEX) is None
    log.write_text("grad_norm: nan\n")
    assert math.isnan(grad_norm_from_stdout(log, DEFAULT_GRAD_NORM_REGEX) or 0.0)
