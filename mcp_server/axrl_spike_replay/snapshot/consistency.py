"""Does a snapshot agree with itself, with its replay and with the training log? Each disagreement is a named
problem with its numbers.

Checks (each listed in `checked` when it could be made, so "no problem" says what was looked at):

- `grad_norm_vs_param_norms`: the recorded global norm against the recorded per-parameter norms. Each rank's
  per-parameter norms are its local gradient before the data-parallel mean (as the reference trainer, verl
  and Megatron's local norms record them): with n_r = sqrt(sum_p norm_{p,r}^2) the norm of the mean
  gradient must lie in [(max n_r - sum of the others) / W, sum n_r / W] (triangle inequality); with one
  rank, or when every rank holds the same norms (already reduced), it must equal n_r. Grad info that says
  `param_grad_norms_kind: reduced_shard` on every rank (FSDP: each rank's shard of the reduced gradient, as the
  FSDP capture and the verl hook record them) must merge over all ranks: sqrt(sum_r n_r^2) equals the global norm.
  Norms of the reduced gradient (kind `reduced` or `reduced_shard`) are held to MERGED_NORM_TOLERANCE (1e-5
  relative), which a correct merge meets by orders of magnitude; local norms to NORM_TOLERANCE (1e-3).
- `rank_grad_norm_vs_metadata`: every rank's recorded global norm against `axrl_metadata.json`'s.
- `spike_ratio_vs_norms`: the metadata's spike ratio against grad_norm / median_norm.
- `metadata_vs_run_config`: world size and parallel sizes in the metadata against `run_config.yaml`.
- `ranks_vs_files`: the rank files present against the world size.
- `rank_loss_vs_replay` (with a replay's per-rank metrics): each rank's recorded loss against the replayed one.
- `grad_norm_vs_replay` (when `diagnose` replays the step for its attribution): the recorded global norm against
  the replayed one, within the tolerance of that replay's layout. A mismatch means the snapshot does not reproduce:
  a scale the run config does not record, or a batch or weights other than those that produced the recorded norm.
- `grad_norm_vs_log` (when the job's log has the iteration): the recorded norm against the log's.
- `param_grad_norms_vs_replay` (with a replay's per-parameter norms): `snapshot.replayed_param_norms`.

Which checks a run makes depends on what it has: every run makes the snapshot's own five and, with a log value,
the log's; a `replay` adds the two against its replayed step (losses, per-parameter norms) and judges the global
norm in its verdict; `diagnose` with model evidence adds `grad_norm_vs_replay` from its attribution's replay. So
`checked` lists the checks made by name, `skipped` why a check this run could have made was not, and every line
for people (`summary_line`) names both, so that two runs' different counts explain themselves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError, SnapshotError
from axrl_spike_replay.snapshot.completeness import missing_ranks, rank_ranges_text, ranks_text
from axrl_spike_replay.snapshot.layout import RUN_CONFIG, rank_files
from axrl_spike_replay.snapshot.metadata import AxrlMetadata, read_metadata
from axrl_spike_replay.snapshot.rank_data import load_grad_info
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml

NORM_TOLERANCE = 1e-3  # relative: recorded norms are float32 sums in another order than ours
# relative, for per-parameter norms of the reduced gradient itself (`param_grad_norms_kind` reduced or reduced_shard:
# the Megatron and verl hooks, the FSDP capture), merged in float64: against the trainer's float32 global norm they
# agree to a few float32 ulps (measured: 1e-15 on the Megatron capture, TP=2 merges exact to 1e-12). A merge that
# misses or repeats a shard is off by far more: one layer's norm in a 228.9 total moved it by 7e-4.
MERGED_NORM_TOLERANCE = 1e-5
LOSS_TOLERANCE = 1e-3  # relative (plus LOSS_ABS_TOLERANCE): fp32 replay of the same loss
LOSS_ABS_TOLERANCE = 1e-6
LOG_TOLERANCE = 1e-4  # logs print about 6 significant digits
PARALLEL_KEYS = ("world_size", "tp", "pp", "dp", "ep", "etp", "cp")
# every check, in the order the runs make them
CHECKS = (
    "spike_ratio_vs_norms",
    "ranks_vs_files",
    "metadata_vs_run_config",
    "rank_grad_norm_vs_metadata",
    "grad_norm_vs_param_norms",
    "grad_norm_vs_log",
    "rank_loss_vs_replay",
    "param_grad_norms_vs_replay",
    "grad_norm_vs_replay",
)
_BY_REPLAY = "made by `replay` (against the step it replays)"
# why a check was not made, when the run says nothing more precise (`Consistency.skipped`)
WHY_NOT = {
    "metadata_vs_run_config": "no parallel section in run_config.yaml",
    "rank_grad_norm_vs_metadata": "no readable grad info",
    "grad_norm_vs_param_norms": "needs every data-parallel rank's per-parameter norms",
    "grad_norm_vs_log": "no training log value at this iteration",
    "rank_loss_vs_replay": _BY_REPLAY,
    "param_grad_norms_vs_replay": _BY_REPLAY,
    "grad_norm_vs_replay": "made by `diagnose` with model evidence (a replay judges the global norm in its verdict)",
}


@dataclass
class ConsistencyProblem:
    """One disagreement: `name` says which check, `message` the numbers in words, `figures` the numbers."""

    name: str
    message: str
    figures: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ConsistencyProblem:
        """A problem as a replay result keeps it (`replay_result.json` `consistency.problems`)."""
        figures = doc.get("figures")
        return cls(str(doc.get("name")), str(doc.get("message")), dict(figures) if isinstance(figures, Mapping) else {})


@dataclass
class Consistency:
    """Whether a snapshot agrees with itself (`self_consistent`) and with the training log (`agrees_with_log`,
    None when no log had the iteration). Replaying it (`reproduced`) is a separate question."""

    checked: list[str] = field(default_factory=list)
    problems: list[ConsistencyProblem] = field(default_factory=list)
    self_consistent: bool = True
    agrees_with_log: bool | None = None
    log_grad_norm: float | None = None
    log_source: str | None = None
    merged_param_norm_bounds: list[float] | None = None  # [low, high] the recorded global norm must lie in
    skipped: dict[str, str] = field(default_factory=dict)  # check -> why this run could not make it

    def add(self, problem: ConsistencyProblem) -> None:
        self.problems.append(problem)
        if problem.name == "grad_norm_vs_log":
            self.agrees_with_log = False
        else:
            self.self_consistent = False

    def summary(self) -> str:
        """One line: agreement with itself and with the log, the checks made and those not made, with why."""
        return summary_line(
            self.self_consistent, self.agrees_with_log, self.checked, len(self.own_problems()), self.skipped
        )

    def skip(self, name: str, reason: str) -> None:
        """Say why check `name` was not made (a run that could have made it)."""
        self.skipped[name] = reason

    def own_problems(self) -> list[ConsistencyProblem]:
        """The problems of the snapshot with itself (the training log's disagreement left out)."""
        return [p for p in self.problems if p.name != "grad_norm_vs_log"]

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Consistency:
        """The checks as a replay result keeps them (`replay_result.json` `consistency`), also one written before a
        field existed (it takes its default); a value of the wrong kind reads as `consistency_line` reads it."""
        agrees, norm, bounds = doc.get("agrees_with_log"), doc.get("log_grad_norm"), doc.get("merged_param_norm_bounds")
        skipped = doc.get("skipped")
        return cls(
            checked=[str(c) for c in doc.get("checked") or []],
            problems=[ConsistencyProblem.from_json(p) for p in doc.get("problems") or [] if isinstance(p, Mapping)],
            self_consistent=doc.get("self_consistent") is True,
            agrees_with_log=agrees if isinstance(agrees, bool) else None,
            log_grad_norm=float(norm) if isinstance(norm, (int, float)) and not isinstance(norm, bool) else None,
            log_source=None if doc.get("log_source") is None else str(doc.get("log_source")),
            merged_param_norm_bounds=[float(b) for b in bounds] if isinstance(bounds, list) else None,
            skipped={str(k): str(v) for k, v in skipped.items()} if isinstance(skipped, Mapping) else {},
        )


def summary_line(
    self_consistent: bool,
    agrees_with_log: bool | None,
    checked: Sequence[str],
    own_problems: int,
    skipped: Mapping[str, str] | None = None,
) -> str:
    """`Consistency.summary`'s line from its figures: `snapshot agrees with itself; agrees with the training log (6
    checks: spike_ratio_vs_norms, ...; not made: rank_loss_vs_replay, param_grad_norms_vs_replay: made by ...)`."""
    own = "agrees with itself" if self_consistent else f"{own_problems} self-inconsistencies"
    log = {True: "agrees with the training log", False: "contradicts the training log", None: "no log value"}
    return f"snapshot {own}; {log[agrees_with_log]} ({checks_line(checked, skipped)})"


def checks_line(checked: Sequence[str], skipped: Mapping[str, str] | None = None) -> str:
    """`6 checks: spike_ratio_vs_norms, ...; not made: rank_loss_vs_replay, ...: made by ...`: the checks a run made
    by name and those it did not, grouped by why (two runs' different counts explain themselves)."""
    made = f"{len(checked)} check{'' if len(checked) == 1 else 's'}" + (f": {', '.join(checked)}" if checked else "")
    groups: dict[str, list[str]] = {}
    for name, why in not_made(checked, skipped).items():
        groups.setdefault(why, []).append(name)
    later = "; ".join(f"{', '.join(names)}: {why}" for why, names in groups.items())
    return made + (f"; not made: {later}" if later else "")


def not_made(checked: Sequence[str], skipped: Mapping[str, str] | None = None) -> dict[str, str]:
    """{check: why not} for each check of `CHECKS` not in `checked`: the run's own reason, else the usual one."""
    done = set(checked)
    return {name: (skipped or {}).get(name) or WHY_NOT.get(name, "not made") for name in CHECKS if name not in done}


def consistency_line(doc: dict[str, Any]) -> str:
    """`Consistency.summary`'s line from the JSON form a replay result keeps (`replay_result.json` `consistency`)."""
    problems = [p for p in doc.get("problems") or [] if isinstance(p, dict)]
    own = [p for p in problems if p.get("name") != "grad_norm_vs_log"]
    agrees = doc.get("agrees_with_log")
    log = agrees if isinstance(agrees, bool) else None
    checked = [str(c) for c in doc.get("checked") or []]
    skipped = doc.get("skipped") if isinstance(doc.get("skipped"), dict) else {}
    return summary_line(doc.get("self_consistent") is True, log, checked, len(own), skipped)


def _close(a: float, b: float, rel: float, abs_tol: float = 0.0) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol)


SHARDS_OF_THE_REDUCED = "reduced_shard"  # grad info's param_grad_norms_kind under FSDP
_OF_THE_REDUCED = ("reduced", SHARDS_OF_THE_REDUCED)  # kinds measured on the reduced gradient (merged exactly)


def _norm_bounds(local: dict[int, float], reduced: bool, sharded: bool = False) -> tuple[float, float]:
    """[low, high] for the norm of the DP mean of gradients whose local norms are `local` (`sharded`: each rank's
    norms are of its shard of the mean gradient, which the shards make up together)."""
    norms = list(local.values())
    world = len(norms)
    if sharded:
        merged = math.sqrt(math.fsum(n * n for n in norms))
        return merged, merged
    if world == 1 or reduced:
        return norms[0], norms[0]
    total = math.fsum(norms)
    low = max(0.0, (max(norms) - (total - max(norms))) / world)
    return low, total / world


def _check_param_norms(
    directory: Path,
    meta: AxrlMetadata,
    out: Consistency,
    read: dict[int, dict[str, Any]] | None,
    files: dict[str, dict[int, Path]],
) -> None:
    infos: dict[int, dict[str, Any]] = {}
    for rank in sorted(files["grad_info"]):
        try:
            infos[rank] = read[rank] if read is not None and rank in read else load_grad_info(directory, rank)
        except SnapshotError:
            continue  # inspect reports the unreadable file itself
    if not infos:
        out.skip("rank_grad_norm_vs_metadata", "no readable grad info file")
        out.skip("grad_norm_vs_param_norms", "no readable grad info file")
        return
    out.checked.append("rank_grad_norm_vs_metadata")
    for rank, info in infos.items():
        if not _close(info["grad_norm"], meta.grad_norm, NORM_TOLERANCE):
            out.add(
                ConsistencyProblem(
                    "rank_grad_norm_vs_metadata",
                    f"rank {rank} recorded grad norm {info['grad_norm']:.6g}, the metadata {meta.grad_norm:.6g}",
                    {"rank": rank, "rank_grad_norm": info["grad_norm"], "metadata_grad_norm": meta.grad_norm},
                )
            )
    with_norms = {r: i["param_grad_norms"] for r, i in infos.items() if i["param_grad_norms"]}
    if len(with_norms) != meta.parallel.dp or len(with_norms) != len(infos):  # bounds need every DP rank's norms
        out.skip(
            "grad_norm_vs_param_norms",
            f"needs every data-parallel rank's per-parameter norms: {len(with_norms)} of {len(infos)} grad info "
            f"file(s) hold them, data-parallel size {meta.parallel.dp}",
        )
        return
    if not math.isfinite(meta.grad_norm):
        out.skip("grad_norm_vs_param_norms", "the recorded global norm is not finite (the diagnosis reports it)")
        return
    local = {r: math.sqrt(math.fsum(v * v for v in norms.values())) for r, norms in with_norms.items()}
    if not all(math.isfinite(v) for v in local.values()):
        out.skip("grad_norm_vs_param_norms", "a rank's local norm is not finite (the diagnosis reports it)")
        return
    first = next(iter(with_norms.values()))
    reduced = len(with_norms) > 1 and all(norms == first for norms in with_norms.values())
    sharded = all(info.get("param_grad_norms_kind") == SHARDS_OF_THE_REDUCED for info in infos.values())
    merged_exactly = all(info.get("param_grad_norms_kind") in _OF_THE_REDUCED for info in infos.values())
    low, high = _norm_bounds(local, reduced, sharded)
    out.checked.append("grad_norm_vs_param_norms")
    out.merged_param_norm_bounds = [low, high]
    tolerance = MERGED_NORM_TOLERANCE if merged_exactly else NORM_TOLERANCE
    slack = tolerance * max(high, meta.grad_norm)
    if low - slack <= meta.grad_norm <= high + slack:
        return
    merged = math.sqrt(math.fsum(v * v for v in local.values()))
    bound = f"equal {high:.6g}" if low == high else f"lie in [{low:.6g}, {high:.6g}]"
    out.add(
        ConsistencyProblem(
            "grad_norm_vs_param_norms",
            f"recorded global grad norm {meta.grad_norm:.6g} contradicts the recorded per-parameter norms: from "
            f"ranks' local norms {', '.join(f'{r}: {v:.6g}' for r, v in local.items())} (merged "
            f"sqrt(sum of squares) {merged:.6g}) it must {bound} (relative tolerance {tolerance:.0e})",
            {
                "recorded_grad_norm": meta.grad_norm,
                "low": low,
                "high": high,
                "merged": merged,
                "local": local,
                "tolerance": tolerance,
            },
        )
    )


NOT_READ: Any = object()  # `check_snapshot(run_config=...)`: the caller has not read the run config


def _check_run_config(directory: Path, meta: AxrlMetadata, out: Consistency, doc: Any = NOT_READ) -> None:
    path = directory / RUN_CONFIG
    if doc is NOT_READ:
        if not path.is_file():
            out.skip("metadata_vs_run_config", f"no {RUN_CONFIG}")
            return
        try:
            doc = read_untrusted_yaml(path, "run config", within=directory)
        except AxrlError:
            out.skip("metadata_vs_run_config", f"{RUN_CONFIG} unreadable (inspect and replay say why)")
            return
    parallel = doc.get("parallel") if isinstance(doc, dict) else None
    if not isinstance(parallel, dict):
        out.skip("metadata_vs_run_config", f"no `parallel` section in {RUN_CONFIG}" if doc else f"no {RUN_CONFIG}")
        return
    out.checked.append("metadata_vs_run_config")
    for key in PARALLEL_KEYS:
        value = parallel.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, int):
            continue
        recorded = getattr(meta.parallel, key)
        if value != recorded:
            out.add(
                ConsistencyProblem(
                    "metadata_vs_run_config",
                    f"parallel.{key} is {recorded} in the metadata but {value} in {RUN_CONFIG}",
                    {"key": key, "metadata": recorded, "run_config": value},
                )
            )


def _check_files(meta: AxrlMetadata, out: Consistency, files: dict[str, dict[int, Path]]) -> None:
    out.checked.append("ranks_vs_files")
    world = meta.parallel.data_ranks
    for kind in ("batch", "grad_info"):
        missing = missing_ranks(files[kind], world)
        extra = [r for r in files[kind] if r >= world]
        if missing or extra:
            out.add(
                ConsistencyProblem(
                    "ranks_vs_files",
                    f"world size {world} in the metadata, {kind} files for ranks {ranks_text(files[kind])}"
                    + (f" (missing {rank_ranges_text(missing)})" if missing else "")
                    + (f" (beyond it: {ranks_text(extra)})" if extra else ""),
                    {"kind": kind, "world_size": world, "present": len(files[kind])},
                )
            )


def check_snapshot(
    snapshot_dir: str | Path,
    *,
    log_grad_norm: float | None = None,
    log_source: str | None = None,
    log_note: str | None = None,
    grad_infos: dict[int, dict[str, Any]] | None = None,
    meta: AxrlMetadata | None = None,
    files: dict[str, dict[int, Path]] | None = None,
    run_config: Any = NOT_READ,
) -> Consistency:
    """Check a snapshot against itself and, when `log_grad_norm` is given, the training log's value at its
    iteration (`log_note`: why there is none, for `skipped`). Reads the metadata, run config and grad info only;
    what the caller has read already in this call
    is not read again (`grad_infos`: ranks' grad info, by `load_grad_info`; `meta`: the snapshot's metadata, by
    `read_metadata`; `files`: its rank files, by `rank_files`; `run_config`: its run config as read, None when it
    is missing or unreadable)."""
    directory = Path(snapshot_dir)
    if meta is None:
        meta, _ = read_metadata(directory)
    if files is None:
        files = rank_files(directory)
    out = Consistency()
    out.checked.append("spike_ratio_vs_norms")
    if meta.median_norm > 0 and math.isfinite(meta.grad_norm):
        expected = meta.grad_norm / meta.median_norm
        if not _close(meta.spike_ratio, expected, NORM_TOLERANCE):
            out.add(
                ConsistencyProblem(
                    "spike_ratio_vs_norms",
                    f"spike ratio {meta.spike_ratio:.6g} but grad_norm / median_norm = {expected:.6g}",
                    {"spike_ratio": meta.spike_ratio, "expected": expected},
                )
            )
    _check_files(meta, out, files)
    _check_run_config(directory, meta, out, run_config)
    _check_param_norms(directory, meta, out, grad_infos, files)
    if log_grad_norm is not None:
        check_log(out, meta.grad_norm, log_grad_norm, log_source, meta.iteration)
    else:
        out.skip("grad_norm_vs_log", log_note or f"no training log value at iteration {meta.iteration}")
    return out


def check_log(out: Consistency, recorded: float, logged: float, source: str | None, iteration: int) -> None:
    """Add the log comparison: the recorded global norm against the log's value at `iteration`."""
    out.checked.append("grad_norm_vs_log")
    out.log_grad_norm, out.log_source = logged, source
    if _close(recorded, logged, LOG_TOLERANCE):
        out.agrees_with_log = True
        return
    out.add(
        ConsistencyProblem(
            "grad_norm_vs_log",
            f"snapshot grad norm {recorded:.6g} but the training log says {logged:.6g} at iteration {iteration}"
            + (f" ({source})" if source else ""),
            {"recorded_grad_norm": recorded, "log_grad_norm": logged, "iteration": iteration, "log": source},
        )
    )


def check_replayed_norm(
    out: Consistency, recorded: float, replayed: float, tolerance: float, replay: str
) -> Consistency:
    """Add the norm comparison: the recorded global grad norm against `replayed`, the norm a replay of the
    snapshot's weights and batch gave (`replay` says which replay, for the message), within `tolerance`."""
    out.checked.append("grad_norm_vs_replay")
    if not math.isfinite(recorded) and not math.isfinite(replayed):
        return out  # both non-finite: the non-finite values are reported as such, not as a mismatch
    diff = abs(replayed - recorded) / abs(recorded) if math.isfinite(recorded) and recorded else math.inf
    if diff <= tolerance:
        return out
    out.add(
        ConsistencyProblem(
            "grad_norm_vs_replay",
            f"the snapshot does not reproduce: {replay} gives grad norm {replayed:.6g} from its weights and batch, "
            f"the recorded one is {recorded:.6g} (rel diff {diff:.3g}, tolerance {tolerance:.0e}); the trainer "
            "computed something its run config does not record (a loss or gradient scale on some rank), or its stored "
            "batch or weights differ from what produced the recorded norm (`diagnose` compares each rank's record)",
            {"recorded_grad_norm": recorded, "replayed_grad_norm": replayed, "rel_diff": diff, "tolerance": tolerance},
        )
    )
    return out


def check_replayed_losses(
    out: Consistency, snapshot_dir: str | Path, rank_metrics: Sequence[dict[str, Any]]
) -> Consistency:
    """Add the per-rank loss comparison: each rank's recorded loss (grad info) against the replayed one."""
    directory = Path(snapshot_dir)
    files = rank_files(directory)["grad_info"]
    compared = False
    for metrics in rank_metrics:
        rank, replayed = metrics.get("rank"), metrics.get("loss")
        if not isinstance(rank, int) or not isinstance(replayed, float) or rank not in files:
            continue
        try:
            recorded = load_grad_info(directory, rank)["loss"]
        except SnapshotError:
            continue
        if recorded is None:
            continue
        compared = True
        if not _close(recorded, replayed, LOSS_TOLERANCE, LOSS_ABS_TOLERANCE):
            out.add(
                ConsistencyProblem(
                    "rank_loss_vs_replay",
                    f"rank {rank} recorded loss {recorded:.6g}, the replay computes {replayed:.6g} from the "
                    f"snapshot's weights and batch",
                    {"rank": rank, "recorded_loss": recorded, "replayed_loss": replayed},
                )
            )
    if compared:
        out.checked.append("rank_loss_vs_replay")
    else:
        out.skip("rank_loss_vs_replay", "no rank's grad info records its loss (or the replay kept no per-rank loss)")
    return out
