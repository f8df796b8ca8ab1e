"""Every declared field of a replay request's `What` and `How`, and of `Where` the fields a run here takes (`LOCAL`),
is carried by each backend or refused by name: walking the declaration, each field set off its default, with each
backend and each verb that backend runs, here, either gives a request the backend carries (its declaration lists the
backend) or a ConfigError naming that field. A field added
later is walked too, and is the built-in engine's alone until its declaration names another backend, whose use of it
a test then shows (the list below changes with it): none can be silently ignored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.request.request_fields import Declared, declared_fields
from axrl_spike_replay.investigation.request import How, What, Where, replay_request
from axrl_spike_replay.vocabulary import Backend, Device, Shard, Verb

SNAPSHOT = Path("/shared/run/checkpoints/spike_snapshots/iter_0000021")  # the request does not read it
# values off the default for the structured fields (kind "any"), which their own functions check
STRUCTURED: dict[str, list[Any]] = {
    "mitigations": [{"advantage_clip": 0.5}],
    "configs": [({"advantage_clip": 0.5},)],
}


def _off_default(name: str, d: Declared, default: Any) -> list[Any]:
    """Values of the field other than its default, valid as its declaration says."""
    if d.kind == "choice":
        assert d.choices is not None
        return [member for member in d.choices if member != default]
    if d.kind == "int":
        return [default + 1 if isinstance(default, int) else int(d.ge or 1)]
    if d.kind == "float":
        return [float(d.gt or d.ge or 0) + 1.5]
    if d.kind == "bool":
        return [not default]
    assert name in STRUCTURED, f"`{name}` is a structured field: give this test values for it"
    return STRUCTURED[name]


LOCAL = {"timeout_s"}  # the fields of `Where` a run here takes (the rest name a node, or are `backend` itself)


CASES = [
    (part, name, d, value, backend, verb)
    for part in (What, How, Where)
    for name, d, default in declared_fields(part)
    if name != "snapshot" and (part is not Where or name in LOCAL)  # snapshot: the one field every request has
    for value in _off_default(name, d, default)
    for backend in Backend
    for verb in d.verbs
]


def _request(part: type, name: str, value: Any, backend: Backend, verb: Any) -> None:
    what, where, how = What(SNAPSHOT, verb=verb), Where(backend=backend), How()
    if part is What:
        what = What(SNAPSHOT, verb=verb, **{name: value})
    elif part is Where:
        where = Where(backend=backend, **{name: value})
    else:
        how = How(**{name: value})
    request = replay_request(what, where, how)
    assert getattr({What: request.what, Where: request.where, How: request.how}[part], name) == value


@pytest.mark.parametrize(
    ("part", "name", "d", "value", "backend", "verb"),
    CASES,
    ids=[f"{c[1]}={c[3]}-{c[4]}-{c[5]}" for c in CASES],
)
def test_each_field_is_carried_or_refused_by_name(
    part: type, name: str, d: Declared, value: Any, backend: Backend, verb: Any
) -> None:
    try:
        replay_request(What(SNAPSHOT, verb=verb), Where(backend=backend))
    except ConfigError:
        pytest.skip(f"{backend} does not run a {verb}")
    try:
        _request(part, name, value, backend, verb)
    except ConfigError as exc:
        assert exc.parameter == name, str(exc)
        return
    assert backend in d.backends, f"`{name}` {value!r} with backend {backend} was taken, not refused"


# what the backends other than the built-in engine carry: the command backend's runs (tests/remote/
# test_command_backend*.py; its time limit: tests/remote/test_remote_replay.py), and the engine's own session with
# Megatron-core's job runner (`replay.megatron_route`: the repeats and the parameter list of its job; the verdict
# threshold is the session's; `nproc` as the saved ranks; the time limit the session's, as for the built-in engine's
# runners: tests/replay/test_local_timeout.py)
CARRIED = {
    Backend.COMMAND: {"mitigations", "configs", "repeat", "top_params", "timeout_s"},
    Backend.MEGATRON: {"repeat", "top_params", "clear_threshold", "nproc", "timeout_s"},
}


def test_the_other_backends_carry_what_their_tests_show() -> None:
    for backend, shown in CARRIED.items():
        declared = {
            n
            for part in (What, How, Where)
            for n, d, _ in declared_fields(part)
            if backend in d.backends and (part is not Where or n in LOCAL)
        }
        assert declared - {"snapshot"} == shown, backend


def test_a_run_here_carries_its_time_limit_with_every_backend_and_verb() -> None:
    """`timeout_s` was refused for a run here with the built-in engine; each backend's runs here now carry it, for
    every verb that runs the engine (an attribution's too)."""
    walked = [c for c in CASES if c[1] == "timeout_s"]
    assert {c[4] for c in walked} == set(Backend)
    assert {c[5] for c in walked} == {Verb.REPLAY, Verb.SWEEP, Verb.ATTRIBUTE}
    for backend in Backend:
        request = replay_request(What(SNAPSHOT), Where(backend=backend, timeout_s=7.5))
        assert request.where.target == "local" and request.where.timeout_s == 7.5


def test_the_command_backend_refuses_the_engines_fields_by_name() -> None:
    for how, name in ((How(nproc=2), "nproc"), (How(device=Device.CUDA), "device"), (How(shard=Shard.OFF), "shard")):
        with pytest.raises(ConfigError, match=f"`{name}`") as info:
            replay_request(What(SNAPSHOT), Where(backend=Backend.COMMAND), how)
        assert info.value.parameter == name
    carried = replay_request(What(SNAPSHOT, repeat=3, top_params=4), Where(backend=Backend.COMMAND))
    assert (carried.what.repeat, carried.what.top_params) == (3, 4)


def test_a_sweep_of_no_configs_is_a_request_not_an_index_error() -> None:
    assert replay_request(What(SNAPSHOT, verb=Verb.SWEEP)).what.configs == ()
