"""`spike-replay.yaml` in the workspace: named SSH targets and the external replay command.

```yaml
targets:
  gpu-a:
    ssh: "ssh -p 26461 root@10.100.4.23"
    python: /opt/venv/bin/python          # optional, default python3
    setup: ["source /opt/env.sh"]         # optional lines run before each command
    known_hosts: ~/.ssh/known_hosts_gpu   # optional
command_backend:
  workdir: /root/axrl                     # the node's training checkout (a git repo)
  command: "python tools/reproduce_spike.py --snapshot {snapshot} --out {out}"
  result_json: "{out}/replay_result.json" # read grad_norm from here if it exists, else (per line):
  grad_norm_regex: '\\bgrad_norm[=: ]+([-+]?(?:[0-9]+\\.?[0-9]*|\\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?(?:nan|inf))'
  env: {NCCL_DEBUG: WARN}                 # optional
  mitigations:                            # optional: our mitigation names -> the trainer's overrides
    mismatch_token_clip_max: "--actor.mismatch_token_clip_max={value}"
```
A command that takes overrides puts `{overrides}` where they go (e.g. `... --out {out} {overrides}`).
The `multinode:` (torchrun across targets) and `slurm:` sections are read by launch_config.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.remote.command.command_config import DEFAULT_GRAD_NORM_REGEX, CommandBackendConfig
from axrl_spike_replay.remote.launchers.launch_config import LaunchConfig, parse_launch_config
from axrl_spike_replay.remote.transport.target import parse_target
from axrl_spike_replay.remote.transport.target_config import DEFAULT_PYTHON, ResolvedTarget, TargetConfig, resolve_named
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml

CONFIG_FILE = "spike-replay.yaml"
PLACEHOLDERS = ("snapshot", "out")
COMMAND_PLACEHOLDERS = (*PLACEHOLDERS, "overrides")
_TARGET_KEYS = {"ssh", "python", "setup", "known_hosts"}
_BACKEND_KEYS = {"workdir", "command", "result_json", "grad_norm_regex", "env", "mitigations"}
_TOP_KEYS = {"targets", "command_backend", "multinode", "slurm"}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # fullmatch: `$` lets "\n" through


@dataclass(frozen=True)
class WorkspaceConfig:
    """The parsed `spike-replay.yaml` (empty when the file does not exist)."""

    targets: dict[str, TargetConfig] = field(default_factory=dict)
    command_backend: CommandBackendConfig | None = None
    path: str | None = None
    launch: LaunchConfig | None = None  # the multinode: and slurm: sections (see launch_config)


def load_workspace_config(workspace: str | Path) -> WorkspaceConfig:
    """Read and validate `<workspace>/spike-replay.yaml`; errors name the file and the key."""
    path = Path(workspace) / CONFIG_FILE
    if not path.is_file():
        return WorkspaceConfig()
    doc = read_untrusted_yaml(path, "workspace config")  # no aliases, bounded; errors name the file
    return parse_workspace_config(doc, str(path))


def parse_workspace_config(doc: Any, source: str) -> WorkspaceConfig:
    """Validate a loaded document."""
    if doc is None:
        return WorkspaceConfig(path=source)
    _mapping(doc, source, "the top level")
    _known_keys(doc, _TOP_KEYS, source, "the top level")
    targets: dict[str, TargetConfig] = {}
    for name, entry in _mapping(doc.get("targets") or {}, source, "targets").items():
        where = f"targets.{name}"
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ConfigError(f"{source}: target name {shown(name)}: use letters, digits and . _ -")
        _known_keys(_mapping(entry, source, where), _TARGET_KEYS, source, where)
        if "ssh" not in entry:
            raise ConfigError(f'{source}: {where}.ssh is missing (e.g. ssh: "ssh -p 2222 root@10.0.0.5")')
        try:
            ssh = parse_target(_string(entry["ssh"], source, f"{where}.ssh"))
        except ConfigError as exc:
            raise ConfigError(f"{source}: {where}.ssh: {exc}") from None
        setup = entry.get("setup") or []
        if isinstance(setup, str):
            setup = [setup]
        if not isinstance(setup, list):
            raise ConfigError(f"{source}: {where}.setup must be a list of shell lines")
        targets[name] = TargetConfig(
            name=name,
            ssh=ssh,
            python=_string(entry.get("python", DEFAULT_PYTHON), source, f"{where}.python"),
            setup=tuple(_string(line, source, f"{where}.setup[{i}]") for i, line in enumerate(setup)),
            known_hosts=_optional_string(entry.get("known_hosts"), source, f"{where}.known_hosts"),
        )
    backend = None
    if doc.get("command_backend") is not None:
        backend = _parse_backend(_mapping(doc["command_backend"], source, "command_backend"), source)
    launch = parse_launch_config(doc, source, targets)
    return WorkspaceConfig(targets=targets, command_backend=backend, path=source, launch=launch)


def _parse_backend(entry: dict[str, Any], source: str) -> CommandBackendConfig:
    where = "command_backend"
    _known_keys(entry, _BACKEND_KEYS, source, where)
    for key in ("workdir", "command"):
        if key not in entry:
            raise ConfigError(f"{source}: {where}.{key} is missing")
    command = _string(entry["command"], source, f"{where}.command")
    check_template(command, source, f"{where}.command", shell=True)
    result_json = _optional_string(entry.get("result_json", "{out}/replay_result.json"), source, f"{where}.result_json")
    if result_json:
        check_template(result_json, source, f"{where}.result_json", shell=False)
    regex = _string(entry.get("grad_norm_regex", DEFAULT_GRAD_NORM_REGEX), source, f"{where}.grad_norm_regex")
    try:
        compiled = re.compile(regex)
    except re.error as exc:
        raise ConfigError(f"{source}: {where}.grad_norm_regex is not a valid regular expression ({exc})") from None
    if compiled.groups < 1:
        raise ConfigError(f"{source}: {where}.grad_norm_regex needs a group around the number, e.g. ([0-9.eE+-]+)")
    env = _mapping(entry.get("env") or {}, source, f"{where}.env")
    mitigations = _parse_mitigations(entry.get("mitigations") or {}, command, source, f"{where}.mitigations")
    return CommandBackendConfig(
        workdir=_string(entry["workdir"], source, f"{where}.workdir"),
        command=command,
        result_json=result_json,
        grad_norm_regex=regex,
        env={str(k): _string(v, source, f"{where}.env.{k}") for k, v in env.items()},
        mitigations=mitigations,
    )


def _parse_mitigations(doc: Any, command: str, source: str, where: str) -> dict[str, str]:
    """{mitigation name: override template}; the command must say where the overrides go."""
    from axrl_spike_replay.remote.command.command_overrides import check_override_template

    out: dict[str, str] = {}
    for name, template in _mapping(doc, source, where).items():
        text = _string(template, source, f"{where}.{name}")
        check_override_template(str(name), text, source, f"{where}.{name}")
        out[str(name)] = text
    if out and "overrides" not in {f for _lit, f, _spec, _conv in string.Formatter().parse(command)}:
        raise ConfigError(
            f"{source}: {where} needs {{overrides}} in command_backend.command, where the trainer's overrides go "
            "(e.g. ... --out {out} {overrides})"
        )
    return out


def check_template(template: str, source: str, where: str, *, shell: bool) -> None:
    """Only {snapshot} and {out} placeholders ({overrides} too in the shell command); in a shell command, never
    inside quotes (they are quoted for you)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError(
            f"{source}: {where}: bad placeholder syntax ({exc}); write {{{{ and }}}} for braces"
        ) from None
    quote: str | None = None
    for literal, name, _spec, _conv in parsed:
        quote = _quote_state(literal, quote)
        if name is None:
            continue
        allowed = COMMAND_PLACEHOLDERS if shell else PLACEHOLDERS
        if name not in allowed:
            names = " or ".join(f"{{{p}}}" for p in allowed)
            raise ConfigError(f"{source}: {where}: unknown placeholder {{{name}}}; use {names}")
        if shell and quote is not None:
            raise ConfigError(
                f"{source}: {where}: write {{{name}}} without quotes around it; it is shell-quoted for you"
            )


def _quote_state(text: str, quote: str | None) -> str | None:
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote is None and ch in "'\"":
            quote = ch
        elif ch == quote:
            quote = None
    return quote


def _mapping(value: Any, source: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {where} must be a mapping (key: value), got {type(value).__name__}")
    return value


def _known_keys(entry: dict[str, Any], allowed: set[str], source: str, where: str) -> None:
    unknown = sorted(str(k) for k in entry if k not in allowed)
    if unknown:
        raise ConfigError(
            f"{source}: {where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def _string(value: Any, source: str, where: str) -> str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool) or str(value).strip() == "":
        raise ConfigError(f"{source}: {where} must be a non-empty string")
    return str(value)


def _optional_string(value: Any, source: str, where: str) -> str | None:
    return None if value is None else _string(value, source, where)


def resolve_target(text: str, config: WorkspaceConfig, remote_python: str | None = None) -> ResolvedTarget:
    """A target name from `spike-replay.yaml`, else a literal ssh string; `remote_python` overrides python."""
    return resolve_named(text, config.targets, remote_python)
