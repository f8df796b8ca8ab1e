"""The worker's half of the launch contract, for a module started by torchrun (directly, over SSH or under srun).
A ground module: the engine's own worker (`replay.jobs.torchrun_worker`) reads its request through it, and the launchers
(`remote.launchers.launch_job`) write requests in the format it defines.

    ctx = worker_context()                          # rank and world from torchrun's environment, argv[1] = request
    torch.distributed.init_process_group(backend, init_method="env://")
    ...
    write_result(ctx, {...})                        # rank 0 only; atomic (temp file + rename)

The launcher reads the result only after the whole job succeeded, so a crash never leaves a half-written result
that could be taken for a real one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.files.atomic import atomic_write_json
from axrl_spike_replay.untrusted.untrusted_bytes import UntrustedInputError, read_bounded
from axrl_spike_replay.untrusted.untrusted_json import parse_untrusted_json

REQUEST_FORMAT = "axrl-launch-request"
REQUEST_VERSION = 1
MAX_REQUEST_BYTES = 16 << 20
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class WorkerContext:
    """Who this process is in the job (torchrun's environment) and what it was asked to do (the request)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int  # the node's rank in the rendezvous (torchrun assigns it; not the order nodes were listed)
    master_addr: str
    master_port: int
    launch_id: str
    request_path: Path
    result_path: Path
    payload: dict[str, Any]

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def worker_context(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerContext:
    """Read torchrun's environment and the request file named by argv[1]; ConfigError says what is missing."""
    argv = list(sys.argv if argv is None else argv)
    env = os.environ if environ is None else environ
    missing = [name for name in _ENV if not env.get(name)]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} not set: this module is a torchrun worker; start it with "
            "`python -m torch.distributed.run ... -m MODULE REQUEST.json`"
        )
    if len(argv) < 2:
        raise ConfigError("no request file: a launched worker takes the request file's path as its first argument")
    request_path = Path(argv[1])
    try:
        doc = parse_untrusted_json(read_bounded(request_path, MAX_REQUEST_BYTES), max_depth=64)
    except (OSError, UntrustedInputError) as exc:
        raise ConfigError(f"request file {request_path}: cannot read it ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != REQUEST_FORMAT:
        raise ConfigError(f"request file {request_path}: not a launch request (format {REQUEST_FORMAT!r})")
    if doc.get("version") != REQUEST_VERSION:
        raise ConfigError(f"request file {request_path}: version {doc.get('version')!r}, expected {REQUEST_VERSION}")
    result_path, payload = doc.get("result_path"), doc.get("payload")
    if not isinstance(result_path, str) or not isinstance(payload, dict):
        raise ConfigError(f"request file {request_path}: needs `result_path` (a string) and `payload` (a mapping)")
    return WorkerContext(
        rank=_int(env, "RANK"),
        world_size=_int(env, "WORLD_SIZE"),
        local_rank=_int(env, "LOCAL_RANK"),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE"),
        group_rank=_int(env, "GROUP_RANK", 0),
        master_addr=env["MASTER_ADDR"],
        master_port=_int(env, "MASTER_PORT"),
        launch_id=str(doc.get("launch_id") or env.get("TORCHELASTIC_RUN_ID", "")),
        request_path=request_path,
        result_path=Path(result_path),
        payload=payload,
    )


def write_result(ctx: WorkerContext, result: Mapping[str, Any]) -> Path | None:
    """On rank 0, write `result` to the request's result path atomically; other ranks write nothing (None)."""
    if not ctx.is_rank0:
        return None
    return atomic_write_json(ctx.result_path, dict(result))


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(str(text))
    except ValueError:
        raise ConfigError(f"{name}={text!r} in the environment is not a whole number") from None
