"""YAML we did not write: no aliases (no billion-laughs), bounded size and depth, errors that name the source."""

from __future__ import annotations

from typing import Any

import yaml

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.untrusted.containment import file_inside
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError, read_bounded

MAX_YAML_BYTES = 4 * 1024 * 1024  # a run config or mitigation set is kilobytes; this bounds the parser's work
MAX_YAML_DEPTH = 64


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors' use (aliases) and deep nesting while composing."""

    def compose_node(self, parent: Any, index: Any) -> Any:  # PyYAML's untyped hook
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(f"uses a YAML alias (*{shown(event.anchor, 40)}); aliases are refused in untrusted YAML")
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise ConfigError(f"nests deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_untrusted_yaml(text: str | bytes, source: str) -> Any:
    """Parse YAML from `source` (a file name or argument, used in errors) without aliases; ConfigError if bad."""
    if isinstance(text, bytes):
        if len(text) > MAX_YAML_BYTES:
            raise ConfigError(f"{source}: {len(text)} bytes of YAML, more than the {MAX_YAML_BYTES}-byte limit")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{source}: {len(text)} characters of YAML, more than the {MAX_YAML_BYTES} limit")
    fast = _load_with_libyaml(text)
    if fast is not _NOT_READ:
        return fast
    try:
        loader = _NoAliasLoader(text)  # the reader refuses non-printable characters here already
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {_short_yaml_error(exc)}") from None
    try:
        return loader.get_single_data()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {_short_yaml_error(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nests too deeply to parse") from None
    except ValueError as exc:  # a value the constructor cannot convert, e.g. an integer of over 4300 digits
        raise ConfigError(f"{source}: a value cannot be read ({shown(str(exc), 160, quote=False)})") from None
    finally:
        loader.dispose()


_NOT_READ = object()
_OPENS, _CLOSES = (yaml.MappingStartEvent, yaml.SequenceStartEvent), (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def _load_with_libyaml(text: str) -> Any:
    """The document parsed by libyaml (C) where it is built in, after a pass over its events that finds no alias
    and no nesting deeper than MAX_YAML_DEPTH; `_NOT_READ` when libyaml is missing or the text is not a plain
    document (an alias, too deep, invalid): the Python loader then reads it and says what is wrong, as before.

    The Python loader composes at a few hundred kB/s: a run config took longer to read than the rest of `inspect`."""
    loader = getattr(yaml, "CSafeLoader", None)
    if loader is None:
        return _NOT_READ
    try:
        depth = 0
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "tag", None) is not None:
                return _NOT_READ  # an alias, or an explicit tag (libyaml resolves `!` unlike PyYAML)
            depth += isinstance(event, _OPENS) - isinstance(event, _CLOSES)
            if depth > MAX_YAML_DEPTH:
                return _NOT_READ
        return yaml.load(text, Loader=loader)  # CSafeLoader: the safe constructors; no alias (checked above)
    except (yaml.YAMLError, ValueError, RecursionError):
        return _NOT_READ


def _short_yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return shown(str(problem), 160, quote=False) + where


def read_untrusted_yaml(path: Any, what: str = "YAML file", within: Any = None) -> Any:
    """Read and parse a YAML file we did not write; ConfigError naming the file when unreadable or bad. With
    `within` (a file of a tree we read, such as a snapshot's run config), a symlink that leads out of that
    directory is refused (`containment.file_inside`); a file a person names alone is read where it leads."""
    try:
        target = path if within is None else file_inside(path, within)
        data = read_bounded(target, MAX_YAML_BYTES, follow_symlinks=within is None)
    except UntrustedInputError as exc:
        raise ConfigError(f"{what} {path}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    return load_untrusted_yaml(data, f"{what} {path}")
