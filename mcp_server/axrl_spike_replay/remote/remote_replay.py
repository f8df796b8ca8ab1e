"""The torch backend on a node: run this package's `replay`/`sweep` verb there, stream its output, fetch results.

The node reads the snapshot from shared storage (same path on both sides) and writes into a private
temp workspace; its output dir comes back over SFTP into the local `tmp/spike-replay/<job>/<timestamp>/`
next to `command.txt`, `stdout.log` and `stderr.log`, and every result records the target and the node. The request
carries the replay request's `What` and `How` as they are: the node's command line states every declared field
they set off its default, as the field's declaration spells its option (`request_fields.changed_argv`), so a new
replay option reaches the node without a change here.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.mitigation.mitigations import mitigation_args
from axrl_spike_replay.experiment.request.request_fields import changed_argv
from axrl_spike_replay.experiment.request.request_parts import How, What
from axrl_spike_replay.experiment.result import ReplayResult, SweepResult
from axrl_spike_replay.experiment.run_dir import RESULT_FILE, SWEEP_FILE, RunDir, RunRecorder, write_and_record
from axrl_spike_replay.files.atomic import atomic_write_json
from axrl_spike_replay.jsonable import to_jsonable
from axrl_spike_replay.remote.nodes.node_probe import NodeReport
from axrl_spike_replay.remote.nodes.results import SnapshotFacts, base_result, tail
from axrl_spike_replay.remote.transport.cleanup import run_to_completion
from axrl_spike_replay.remote.transport.job import JobOutcome, LineCallback
from axrl_spike_replay.remote.transport.session import RemoteSession
from axrl_spike_replay.remote.transport.shell import job_script
from axrl_spike_replay.vocabulary import Backend, Fidelity, Verb, Verdict

REMOTE_SET_FILE = "mitigation_set.yaml"


@dataclass(frozen=True)
class RemoteReplayRequest:
    """A torch-backend replay or sweep to run on a node: the request's `What` (its verb, mitigations or configs and
    every other option) and `How` (`nproc` None: as many processes as the layout can use on the node), validated."""

    facts: SnapshotFacts
    python: str
    what: What
    how: How = field(default_factory=How)
    job: str = "spike"
    setup: tuple[str, ...] = ()
    timeout_s: float | None = None
    target: str = ""

    @property
    def verb(self) -> Verb:
        """The verb the node runs: replay or sweep."""
        return self.what.verb

    @property
    def device(self) -> str:
        """Where the node's replay processes compute."""
        return str(self.how.device)


def plan_processes(device: str, nproc: int | None, world_size: int, node: NodeReport) -> int:
    """Processes for the node: as given, else one per saved rank on CPU, or one per GPU up to the world size."""
    if device == "cuda" and node.gpu_count == 0:
        raise ConfigError(
            f"`device` cuda: {node.target} has no GPU ({'; '.join(node.notes) or 'nvidia-smi lists none'}); "
            "use `device` cpu",
            "device",
        )
    if nproc is not None:
        return nproc
    if device == "cuda":
        return min(world_size, node.gpu_count)
    return world_size


def remote_argv(request: RemoteReplayRequest, workspace: str, nproc: int, mitigation_set: str | None) -> list[str]:
    """The command line run on the node (every word is shell-quoted when sent): the verb on the snapshot with `nproc`
    processes, its mitigations (a replay's) or its configs' file (a sweep's), and every other declared `How` and
    `What` field the request sets off its default, spelt as declared."""
    verb = request.verb
    argv = [request.python, "-m", "axrl_spike_replay", str(verb), request.facts.snapshot, "--json"]
    argv += ["--workspace", workspace, "--job", request.job, "--device", request.device]
    argv += changed_argv(replace(request.how, nproc=nproc, device=How().device), verb)  # --nproc N, --shard on, ...
    if verb == Verb.REPLAY:
        for item in mitigation_args(request.what.mitigations):
            argv += ["--mitigation", item]
    elif mitigation_set is not None:
        argv += ["--mitigation-set", mitigation_set]
    return argv + changed_argv(request.what, verb)


async def run_remote_torch(
    session: RemoteSession,
    request: RemoteReplayRequest,
    run: RunDir,
    node: NodeReport,
    *,
    recorder: RunRecorder | None = None,
    on_line: LineCallback | None = None,
    progress: Callable[[str], None] | None = None,
) -> ReplayResult | SweepResult:
    """Run the verb on the node and bring its results home; a failure gives (and writes) a `failed` result."""
    assert run.path is not None
    started = time.perf_counter()
    nproc = plan_processes(request.device, request.how.nproc, request.facts.world_size, node)
    common = {
        "target": request.target,
        "node": node.node_field(),
        "device": request.device,
        "world_size_used": nproc,
        "fidelity": Fidelity.FULL,  # every saved rank is replayed, several per process when nproc is smaller
        "mitigations": dict(request.what.mitigations),
    }
    remote_ws: str | None = node.temp_dir
    try:
        remote_ws = remote_ws or await session.make_temp_dir("axrl-ws-")
        mitigation_set = await _put_configs(session, request, remote_ws)
        argv = remote_argv(request, remote_ws, nproc, mitigation_set)
        run.write_command(f"# target: {request.target}\n{shlex.join(argv)}")
        if progress is not None:
            progress(
                f"{request.verb} on {request.target} ({node.hostname or '?'}, {node.gpu_count} GPU(s)): {nproc} "
                f"process(es) on {request.device}"
            )
        outcome = await session.run(
            job_script(argv, setup=request.setup),
            stdout_path=run.path / "stdout.log",
            stderr_path=run.path / "stderr.log",
            timeout=request.timeout_s,
            on_line=on_line,
        )
        result = await _bring_home(session, request, outcome, remote_ws, run, node, recorder, common)
    except BaseException as exc:
        reason = str(exc) if isinstance(exc, Exception) else "cancelled (Ctrl-C or a cancelled call)"
        failed = base_result(request.facts, backend=Backend.TORCH, error=reason, **common)
        failed.timings = {"total": round(time.perf_counter() - started, 3)}
        write_and_record(run, failed, recorder, request.job)
        if isinstance(exc, Exception) and not isinstance(exc, ConfigError):
            return failed
        raise
    finally:
        if remote_ws is not None:
            with contextlib.suppress(Exception):
                await run_to_completion(session.remove_temp_dir(remote_ws))
    return result


async def _put_configs(session: RemoteSession, request: RemoteReplayRequest, remote_ws: str) -> str | None:
    if request.verb != Verb.SWEEP:
        return None
    with tempfile.TemporaryDirectory(prefix="axrl-set-") as tmp:
        local = Path(tmp) / REMOTE_SET_FILE
        local.write_text(yaml.safe_dump([dict(c) for c in request.what.configs], sort_keys=False), encoding="utf-8")
        await session.put(local, f"{remote_ws}/{REMOTE_SET_FILE}")
    return f"{remote_ws}/{REMOTE_SET_FILE}"


async def _bring_home(
    session: RemoteSession,
    request: RemoteReplayRequest,
    outcome: JobOutcome,
    remote_ws: str,
    run: RunDir,
    node: NodeReport,
    recorder: RunRecorder | None,
    common: dict[str, Any],
) -> ReplayResult | SweepResult:
    assert run.path is not None
    doc = _json_doc(outcome.stdout_path)
    remote_dir = doc.get("output_dir") if doc else None
    if not remote_dir:
        found = await session.glob(f"{remote_ws}/tmp/spike-replay/{request.job}/*")
        remote_dir = found[-1] if found else None
    if remote_dir:
        await session.fetch_tree(remote_dir, run.path, skip=("command.txt",))
    results = _rewrite_results(run, request, node)
    if not outcome.ok or doc is None:
        last = tail(outcome.stderr_path)
        why = outcome.reason if not outcome.ok else "the node printed no result document"
        error = f"{request.verb} on {request.target} failed: {why}" + (f"\n{last}" if last else "")
        failed = next((r for r in results.values() if r.verdict == Verdict.FAILED), None)
        if failed is None:
            failed = base_result(request.facts, backend=Backend.TORCH, error=error, **common)
        else:
            failed.error = f"{error}\n{failed.error or ''}".strip()
        failed.timings = {**failed.timings, "remote_command": outcome.seconds}
        write_and_record(run, failed, recorder, request.job)
        return failed
    for sub, result in results.items():
        result.timings = {**result.timings, "remote_command": outcome.seconds}
        write_and_record(run, result, recorder, request.job, sub or None)
    if request.verb == Verb.SWEEP:
        sweep = SweepResult.from_json(doc)
        sweep.baseline = results.get("baseline", sweep.baseline)
        sweep.results = [results.get(r.config_id, r) for r in sweep.results]
        sweep.output_dir = str(run.path)
        atomic_write_json(run.path / SWEEP_FILE, to_jsonable(sweep.to_json()))
        return sweep
    return results[""]


def _json_doc(stdout: Path) -> dict[str, Any] | None:
    """The one JSON document the node's `--json` run printed, else None."""
    text = stdout.read_text(encoding="utf-8", errors="replace").strip() if stdout.is_file() else ""
    start = text.find("{")
    if start < 0:
        return None
    try:
        doc = json.loads(text[start:])
    except json.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def _rewrite_results(run: RunDir, request: RemoteReplayRequest, node: NodeReport) -> dict[str, ReplayResult]:
    """Fetched `replay_result.json` files with the target, the node and the local output dir: {sub: result}."""
    assert run.path is not None
    results: dict[str, ReplayResult] = {}
    for path in sorted(run.path.rglob(RESULT_FILE)):
        result = ReplayResult.from_json(json.loads(path.read_text(encoding="utf-8")))
        result.target = request.target
        result.node = node.node_field()
        sub = "" if path.parent == run.path else path.parent.relative_to(run.path).as_posix()
        results[sub] = result
    return results
