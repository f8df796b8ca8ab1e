"""The CLI options that set replay-request fields, generated from the fields' declarations
(`experiment.request.request_fields`): each option's name, type, choices, default, metavar and help come from there, and
`request_values` reads them back by field name. Fields with structured values (`snapshot`, `mitigations`,
`target`, `slurm`, `patches`, ...) keep their hand-mapped options."""

from __future__ import annotations

import argparse
from typing import Any

from axrl_spike_replay.cli.parameter_names import for_cli
from axrl_spike_replay.experiment.request.request_fields import Declared, declared_fields
from axrl_spike_replay.investigation.request import How, What, Where
from axrl_spike_replay.vocabulary import Verb

_PARTS: tuple[type, ...] = (What, Where, How)
_TYPES = {"int": int, "float": float}


def generated_options(verb: Verb, *parts: type) -> list[tuple[str, Declared, Any]]:
    """(field, declaration, default) of each field of `parts` whose CLI option for `verb` is generated."""
    return [(name, d, default) for name, d, default in declared_fields(*parts) if d.cli and verb in d.verbs]


def option_help(declaration: Declared, default: Any) -> str:
    """An option's help: the declaration's whole help, its field names spelled as options, with the default where
    the help does not say it."""
    text = for_cli(declaration.help)
    if default not in (None, False, ()) and "Default" not in text:
        text += f" (default {default})"
    return text


def add_declared_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str) -> None:
    """The option that sets the request field `name`, as its declaration says."""
    found = {field: (d, default) for field, d, default in declared_fields(*_PARTS)}
    add_option(parser, name, *found[name])


def add_option(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, declaration: Declared, default: Any
) -> None:
    """The option for a field `name` of this declaration and default: its flag, type, choices, metavar and help."""
    kwargs: dict[str, Any] = {"dest": name, "help": option_help(declaration, default)}
    if declaration.kind == "bool":
        kwargs |= {"action": "store_true"}
    else:
        kwargs |= {"default": str(default) if declaration.kind == "choice" else default}
        if declaration.choices is not None:
            kwargs["choices"] = declaration.choices.values()
        if declaration.kind in _TYPES:
            kwargs["type"] = _TYPES[declaration.kind]
        if declaration.metavar is not None:
            kwargs["metavar"] = declaration.metavar
    parser.add_argument(declaration.option(name), **kwargs)


def add_request_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, verb: Verb, *parts: type) -> None:
    """Every generated option of `parts` (default: the request's three) that `verb` takes, in declaration order."""
    for name, declaration, default in generated_options(verb, *(parts or _PARTS)):
        add_option(parser, name, declaration, default)


def request_values(args: argparse.Namespace, part: type) -> dict[str, Any]:
    """The values the parsed arguments give the generated fields of `part` (those its verb has options for)."""
    return {name: getattr(args, name) for name, d, _ in declared_fields(part) if d.cli and hasattr(args, name)}
