"""Why a torchrun job failed, in words that name the node at fault and say what to check."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from axrl_spike_replay.remote.launchers.launch_job import LaunchError
from axrl_spike_replay.remote.launchers.torchrun_command import Rendezvous


@dataclass(frozen=True)
class AgentState:
    """What the launcher knows of one node's agent when the job failed."""

    name: str
    started: bool  # it printed the start mark: past the node's setup lines, torchrun exec'd
    ended: bool
    ok: bool
    reason: str | None = None  # why it ended unsuccessfully (exit status, connection lost, ...)
    rendezvous: str | None = None  # "timeout" | "connection" | "closed" when its rendezvous failed
    tail: str = ""  # the end of its output


def explain_failure(states: Sequence[AgentState], rendezvous: Rendezvous | None) -> LaunchError:
    """The error for a job whose agents ended as `states` say (at least one of them unsuccessfully)."""
    failed = [s for s in states if s.ended and not s.ok]
    if not failed:
        raise ValueError("no agent failed")
    stopped = "The job was stopped on every node"
    if rendezvous is not None and any(s.rendezvous for s in failed):
        head = (
            f"torchrun rendezvous at {rendezvous.endpoint} (id {rendezvous.run_id}) did not complete within "
            f"{rendezvous.timeout_s:g} s"
        )
        missing = [s for s in states if not s.started]
        if missing:
            return LaunchError(
                f"{head}: node(s) {_names(missing)} never started a torchrun agent (a setup line or the node hung "
                f"before it); check those nodes and their `setup:` lines. {stopped}",
                node=missing[0].name,
            )
        unreachable = [s for s in failed if s.rendezvous == "connection"]
        if unreachable:
            tail = unreachable[0].tail or "(nothing)"
            return LaunchError(
                f"{head}: node(s) {_names(unreachable)} could not reach the rendezvous store at "
                f"{rendezvous.endpoint}; check the firewall and that the first node's `address` is one the "
                f"others reach. {stopped}. Output of {unreachable[0].name!r} ends: {tail}",
                node=unreachable[0].name,
            )
        first = failed[0]
        return LaunchError(
            f"{head}: every agent started but not all of them joined; check that every node reaches "
            f"{rendezvous.endpoint} and runs the same job. {stopped}. Output of {first.name!r} ends: "
            f"{first.tail or '(nothing)'}",
            node=first.name,
        )
    first = failed[0]
    more = f" (also failed: {_names(failed[1:])})" if failed[1:] else ""
    return LaunchError(
        f"node {first.name!r} failed: {first.reason}{more}. {stopped}. Its agent's output ends: "
        f"{first.tail or '(nothing)'}",
        node=first.name,
    )


def timeout_error(states: Sequence[AgentState], launch_id: str, timeout_s: float) -> LaunchError:
    """The error for a job that ran past its timeout (its agents were then stopped)."""
    missing = [s for s in states if not s.started]
    where = f"; node(s) {_names(missing)} never started a torchrun agent" if missing else ""
    return LaunchError(
        f"job {launch_id} on {len(states)} node(s) did not finish within {timeout_s:g} s{where}; "
        "it was stopped on every node",
        node=missing[0].name if missing else None,
        timed_out=True,
    )


def _names(states: Sequence[AgentState]) -> str:
    return ", ".join(repr(s.name) for s in states)
