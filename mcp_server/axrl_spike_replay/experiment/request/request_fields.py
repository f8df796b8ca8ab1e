"""One declaration per request field: its words, its allowed values and which verbs take it, said once.

A field of the replay request (`experiment.request.request_parts`: `What`, `Where`, `How`) carries a `Declared`
record in its dataclass metadata (`field(metadata=declare(...))`). From it come the CLI's options
(`cli.request_options`), the MCP tools' parameter schemas and the resource `axrl://arguments`
(`mcp_faces.shared_arguments`), the request builder's check of the value (`check_declared`), whose message names
the field as the library does (`nproc`), the options a run's command line states or sends to a node
(`changed_argv`), and the refusal of a value the request's backend would not carry (`refuse_uncarried`): a field
is carried by the backends its declaration lists, and set to anything but its default with another backend it is
refused by name, never ignored.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError, ConfigError
from axrl_spike_replay.vocabulary import Backend, Verb, Vocabulary

DECLARED = "axrl_declared"  # the metadata key of a field's declaration
ALL_VERBS = (Verb.REPLAY, Verb.SWEEP, Verb.ATTRIBUTE)
ALL_BACKENDS = (Backend.TORCH, Backend.MEGATRON, Backend.COMMAND)


@dataclass(frozen=True)
class Declared:
    """What a request field is, for both faces and the check: a one-line `summary` (an MCP tool's schema
    description; "" where the schema's choices say it all), the whole `help` (the CLI's `--help`, the MCP resource
    `axrl://arguments`), its allowed values and the verbs that take it.

    `kind` is "int" (a count), "float" (a number), "bool" (a switch), "choice" (a member of `choices`) or "any"
    (a structured value the faces map by hand and the request builder checks in its own function)."""

    summary: str
    help: str
    kind: str = "any"
    choices: type[Vocabulary] | None = None
    ge: float | None = None  # bounds of an int or float
    le: float | None = None
    gt: float | None = None
    finite: bool = False  # a float must be finite
    must: str | None = None  # how the refusal says what a value must be (default: from kind and bounds)
    verbs: tuple[Verb, ...] = ALL_VERBS  # the verbs whose faces take it
    # the backends that carry a `What` or `How` field set off its default (`refuse_uncarried`); by default the built-in
    # engine alone, so a new field is refused by the others until they carry it
    backends: tuple[Backend, ...] = (Backend.TORCH,)
    flag: str | None = None  # the CLI option (default: --name with dashes); None with cli=False: mapped by hand
    cli: bool = True  # the CLI's option is generated from this declaration
    mcp: bool = True  # the MCP tools of `verbs` take it
    metavar: str | None = None
    schema_bounds: bool = True  # the MCP schema carries the bounds (False: the request's message names the field)

    def option(self, name: str) -> str:
        """The CLI option that sets the field: `--nproc`, `--timeout` for `timeout_s`."""
        return self.flag or "--" + name.replace("_", "-")

    def must_be(self) -> str:
        """What a valid value is, as the refusal says it: `an integer >= 1`, `an integer from 1 to 100`."""
        if self.must is not None:
            return self.must
        noun = "an integer" if self.kind == "int" else "a finite number" if self.finite else "a number"
        if self.ge is not None and self.le is not None:
            return f"{noun} from {_num(self.ge)} to {_num(self.le)}"
        bound = [f">= {_num(self.ge)}"] if self.ge is not None else []
        bound += [f"> {_num(self.gt)}"] if self.gt is not None else []
        bound += [f"<= {_num(self.le)}"] if self.le is not None else []
        return " ".join([noun, *bound])


def declare(**declaration: Any) -> dict[str, Declared]:
    """A dataclass field's metadata carrying its `Declared` record (the keywords of `Declared`):
    `nproc: int | None = field(default=None, metadata=declare(summary=..., help=..., kind="int", ge=1))`."""
    return {DECLARED: Declared(**declaration)}


def declaration_of(item: Field[Any]) -> Declared | None:
    """The declaration a dataclass field carries, if any."""
    found = item.metadata.get(DECLARED)
    return found if isinstance(found, Declared) else None


def declared_fields(*parts: type) -> Iterator[tuple[str, Declared, Any]]:
    """(name, declaration, default) of every declared field of `parts`, in declaration order (default: MISSING
    when the field has none, the factory's value when it has one)."""
    for part in parts:
        for item in fields(part):
            found = declaration_of(item)
            if found is None:
                continue
            default = item.default_factory() if item.default_factory is not MISSING else item.default
            yield item.name, found, default


def changed_values(part: Any, verb: Verb) -> dict[str, Any]:
    """{field: value} of the declared fields of the request part `part` that `verb`'s command line takes and that
    differ from their defaults, in declaration order: what the equivalent command line states."""
    return {
        name: getattr(part, name)
        for name, d, default in declared_fields(type(part))
        if d.cli and verb in d.verbs and getattr(part, name) != default
    }


def changed_argv(part: Any, verb: Verb) -> list[str]:
    """The command-line options that set `changed_values(part, verb)`, spelt as the declarations say."""
    found = {name: d for name, d, _ in declared_fields(type(part))}
    argv: list[str] = []
    for name, value in changed_values(part, verb).items():
        argv += [found[name].option(name)] if found[name].kind == "bool" else [found[name].option(name), str(value)]
    return argv


def refuse_uncarried(part: Any, backend: Backend) -> None:
    """ConfigError naming the first declared field of the request part `part` set off its default that `backend`
    does not carry (its declaration's `backends` leave it out): a request never asks for what its run ignores."""
    for name, d, default in declared_fields(type(part)):
        if backend not in d.backends and getattr(part, name) != default:
            carried = ", ".join(str(b) for b in d.backends)
            raise ConfigError(
                f"`{name}` is not carried by `backend` {backend} (only by {carried}): leave it out or change `backend`",
                name,
            )


def check_declared(name: str, declaration: Declared, value: Any) -> Any:
    """`value` as the field holds it (a vocabulary member for a choice); ConfigError naming `name` otherwise.

    None passes where the field allows it (its default is None); a structured field is its own function's to check."""
    if declaration.kind == "choice":
        assert declaration.choices is not None
        try:
            return declaration.choices.parse(value, f"`{name}`")
        except AxrlError:
            raise ConfigError(
                f"`{name}` must be one of {', '.join(declaration.choices.values())}, got {shown(value)}", name
            ) from None
    if value is None or declaration.kind not in ("int", "float"):
        return value
    if not _fits(declaration, value):
        raise ConfigError(f"`{name}` must be {declaration.must_be()}, got {shown(value)}", name)
    return value


def _fits(declaration: Declared, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if declaration.kind == "int" and not isinstance(value, int):
        return False
    if math.isnan(value) or (declaration.finite and not math.isfinite(value)):
        return False
    if declaration.ge is not None and not value >= declaration.ge:
        return False
    if declaration.gt is not None and not value > declaration.gt:
        return False
    return declaration.le is None or value <= declaration.le


def _num(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)
