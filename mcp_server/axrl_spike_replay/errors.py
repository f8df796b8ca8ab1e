"""Errors for expected bad input. Faces show their message, never a traceback."""

from __future__ import annotations


class AxrlError(Exception):
    """Expected failure with a message that says what was wrong and, where useful, what to do."""


class SnapshotError(AxrlError):
    """A snapshot file or directory is missing, truncated, unsafe or inconsistent."""


class ConfigError(AxrlError):
    """A configuration value, argument or file is invalid.

    `parameter` names the request field the error is about (`top`, `device`, `nproc`, ...). Messages
    write parameter names in backquotes (`top`) and never as a face spells them; each face renders
    them its own way (the CLI as `--top`, MCP as the tool argument `top`)."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


class UnsafeFileError(SnapshotError):
    """A file carries a pickled payload beyond plain tensors and containers; nothing in it was run."""
