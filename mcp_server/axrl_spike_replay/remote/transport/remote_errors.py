"""Errors of remote work: each message names the target and says what to do."""

from __future__ import annotations

from axrl_spike_replay.errors import AxrlError


class RemoteError(AxrlError):
    """A remote node could not be reached, refused us, or a remote step failed."""


class HostKeyError(RemoteError):
    """The node's host key is unknown (and not accepted) or differs from the one recorded."""
