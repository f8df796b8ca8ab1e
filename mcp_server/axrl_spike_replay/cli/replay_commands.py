"""`replay`, `sweep` and `attribute`: reproduce a spike, try mitigations on it, and find the samples behind it."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.cli.output import add_json_flag, emit, progress, table
from axrl_spike_replay.cli.remote_options import add_remote_options
from axrl_spike_replay.cli.request_options import add_request_options, request_values
from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.experiment.result import Attribution, ReplayResult, RunResult, SweepResult
from axrl_spike_replay.experiment.verdict import basis_field
from axrl_spike_replay.investigation.request import How, What, Where
from axrl_spike_replay.percent import pct, pct_plain
from axrl_spike_replay.vocabulary import Verb

if TYPE_CHECKING:
    from axrl_spike_replay.investigation.request import ReplayRequest
    from axrl_spike_replay.snapshot.consistency import Consistency


def _common(parser: argparse.ArgumentParser, verb: Verb) -> None:
    parser.add_argument("snapshot", help="spike snapshot directory (iter_<N>)")
    add_request_options(parser, verb, How)
    parser.add_argument(
        "--workspace", default=".", help="workspace root; output goes to tmp/spike-replay/<job>/<timestamp>/"
    )
    parser.add_argument("--job", default=None, help="job name for the output dir and task file (default: snapshot's)")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="run on the workspace's warm replay service (processes and weights kept between calls; started on "
        "first use, see `serve`); the same results and files as without",
    )
    parser.add_argument(
        "--server", default=None, metavar="SOCKET", help="run on the warm replay service listening at SOCKET"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print what the launcher would run (as `plan` does), start nothing"
    )
    add_json_flag(parser)


def register(sub: Any) -> None:
    """Add `replay`, `sweep` and `attribute`."""
    p = sub.add_parser(
        "replay",
        help="recompute a spike step's gradients from its snapshot (optionally with mitigations)",
        description="Recompute the spike step's gradients from the snapshot and compare the global pre-clip grad "
        "norm with the recorded one. With --mitigation, also judge the mitigation against the baseline.",
    )
    _common(p, Verb.REPLAY)
    add_remote_options(p, Verb.REPLAY)
    p.add_argument(
        "--mitigation",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="replay-only mitigation; repeat to combine (e.g. mismatch_token_clip_max=2); an unknown NAME lists "
        "the valid ones",
    )
    add_request_options(p, Verb.REPLAY, What)
    p.set_defaults(handler=_replay)

    s = sub.add_parser(
        "sweep",
        help="run many mitigation configs on one snapshot in one run (weights loaded once)",
        description="Replay the baseline and every mitigation config in one job and judge each against the baseline.",
    )
    _common(s, Verb.SWEEP)
    add_remote_options(s, Verb.SWEEP)
    group = s.add_mutually_exclusive_group(required=True)
    group.add_argument("--mitigation-set", metavar="FILE.yaml", help="YAML list of configs: - {NAME: VALUE, ...}")
    group.add_argument(
        "--mitigation",
        action="append",
        metavar="'NAME=VALUE [NAME=VALUE ...]'",
        help="one config per option (several NAME=VALUE items in one option combine)",
    )
    add_request_options(s, Verb.SWEEP, What)
    s.set_defaults(handler=_sweep)

    a = sub.add_parser(
        "attribute",
        help="rank the samples of a spike step by their contribution to the global gradient",
        description="Each sample's contribution c_s = <g_s, g>/||g|| to the global grad norm, ranked, with its "
        "signals.",
    )
    _common(a, Verb.ATTRIBUTE)
    add_request_options(a, Verb.ATTRIBUTE, What)
    add_request_options(a, Verb.ATTRIBUTE, Where)  # --timeout: an attribution runs here only
    a.add_argument("--mitigation", action="append", default=[], metavar="NAME[=VALUE]", help="attribute under a config")
    a.set_defaults(handler=_attribute)


def _request(args: argparse.Namespace, verb: Verb, **what: Any) -> ReplayRequest:
    """The library's ReplayRequest for parsed arguments: this face only maps its options onto the request's parts."""
    from axrl_spike_replay.cli.remote_options import where_from_args
    from axrl_spike_replay.investigation.request import replay_request

    return replay_request(
        What(Path(args.snapshot), verb=verb, **request_values(args, What), **what),
        where_from_args(args),
        How(**request_values(args, How)),
        workspace=Path(args.workspace),
        job=args.job,
        progress=progress,
    )


def _dry_run(args: argparse.Namespace, request: ReplayRequest) -> int:
    """--dry-run: what the request's launcher would run, started nowhere."""
    from axrl_spike_replay.investigation.placement import request_dry_run

    dry = request_dry_run(request)
    if dry is None:
        where = "the command backend" if str(request.where.backend) == "command" else f"node {request.where.target}"
        doc: dict[str, Any] = {"launcher": None, "text": f"no launcher: {where} runs the replay itself over SSH"}
    else:
        doc = dry.to_json()
    emit(doc, args.json, lambda d: str(d["text"]))
    return 0


def _run(args: argparse.Namespace, request: ReplayRequest) -> RunResult:
    """The result of `request`: run here as always, or on the warm service with --warm / --server (its document
    read back into the result of the request's verb)."""
    if args.warm or args.server:
        from axrl_spike_replay.investigation.warm_client import run_on_service

        doc = run_on_service(request, args.server)
        kind = {Verb.SWEEP: SweepResult, Verb.ATTRIBUTE: Attribution}.get(request.what.verb, ReplayResult)
        return kind.from_json(doc)
    from axrl_spike_replay.investigation.runs import run_request

    return run_request(request)


def _replay(args: argparse.Namespace) -> int:
    from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args

    request = _request(args, Verb.REPLAY, mitigations=parse_mitigation_args(args.mitigation))
    if args.dry_run:
        return _dry_run(args, request)
    emit(_run(args, request), args.json, render_replay)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from axrl_spike_replay.experiment.mitigation.mitigations import mitigation_doc, read_mitigation_set

    # the configs as given: the sweep checks each, runs around one it refuses and reports it
    if args.mitigation_set:
        configs = read_mitigation_set(args.mitigation_set)
    else:
        configs = [mitigation_doc(_sweep_items(item)) for item in args.mitigation]
    request = _request(args, Verb.SWEEP, configs=tuple(configs))
    if args.dry_run:
        return _dry_run(args, request)
    emit(_run(args, request), args.json, render_sweep)
    return 0


def _sweep_items(option: str) -> list[str]:
    """The `NAME=VALUE` items of one sweep `--mitigation` option, split like a shell would."""
    try:
        return shlex.split(option)
    except ValueError as exc:  # an unbalanced quote
        raise ConfigError(
            f"`mitigations` {shown(option)}: cannot split it into NAME=VALUE items ({exc})", "mitigations"
        ) from None


def _attribute(args: argparse.Namespace) -> int:
    from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args

    request = _request(args, Verb.ATTRIBUTE, mitigations=parse_mitigation_args(args.mitigation))
    if args.dry_run:
        return _dry_run(args, request)
    emit(_run(args, request), args.json, render_attribution)
    return 0


def _num(value: Any, digits: int = 6) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return "n/a" if value is None else str(value)


def fidelity_label(result: ReplayResult | SweepResult) -> str:
    """`full` or `REDUCED (diagnostic: ...)`: a reduced replay is always labelled as such."""
    saved, used = result.world_size_saved, result.world_size_used
    if result.fidelity == "full":
        if used == saved:
            return f"full ({used} process(es) = saved world size {saved})"
        return f"full ({used} process(es) replay the {saved} saved ranks, several each in turn)"
    return f"REDUCED, a diagnostic ({used} process(es) replay {saved} saved ranks; summation order differs)"


def _threshold_label(result: ReplayResult) -> str:
    source = basis_field(result.verdict_basis, "threshold_source")
    return "your clear threshold" if source == "clear_threshold" else "detector threshold"


def render_replay(result: ReplayResult) -> str:
    """A replay result for people."""
    r = result
    lines = [
        f"replay of {r.snapshot} (job {r.job_name}, iteration {r.iteration}, {r.device})",
        f"  fidelity      {fidelity_label(r)}",
        f"  grad norm     {_num(r.grad_norm, 10)}  (recorded {_num(r.recorded_grad_norm, 10)}"
        + (f", rel_diff {_num(r.rel_diff, 3)}, tolerance {_num(r.tolerance, 3)})" if not r.mitigations else ")"),
        f"  spike ratio   {_num(r.spike_ratio, 4)} x median {_num(r.median_norm, 6)} "
        f"({_threshold_label(r)} {_num(r.threshold, 4)})",
    ]
    if r.mitigations:
        items = ", ".join(f"{k}={v}" for k, v in r.mitigations.items())
        lines.append(f"  mitigations   {items}")
        lines.append(
            f"  vs baseline   grad norm {_num(r.baseline_grad_norm, 8)} -> {_num(r.grad_norm, 8)} "
            f"({pct(r.change_vs_baseline)})"
        )
    if r.hypothesis:  # judged against the recording, rank by rank: no mitigation
        for row in basis_field(r.verdict_basis, "rank_losses") or []:
            said = {True: "matches", False: "DIFFERS", None: "not compared"}[row.get("matches")]
            lines.append(
                f"  rank {row['rank']} loss   {_num(row.get('replayed_loss'), 10)} (recorded "
                f"{_num(row.get('recorded_loss'), 10)}): {said}"
            )
    lines.append(f"  verdict       {r.finding or r.verdict}" + (f": {r.error}" if r.error else ""))
    lines += [f"  {line}" for line in _input_lines(r)]
    footprint = r.footprint
    if footprint:
        lines.append(
            f"  footprint     {pct_plain(footprint.token_fraction)} of loss tokens masked or changed "
            f"({footprint.masked_tokens} masked, {footprint.changed_tokens} changed of "
            f"{footprint.loss_tokens}), {pct_plain(footprint.sample_fraction)} of samples touched"
        )
    if r.clean_gradient:
        lines.append(f"  cos to clean  {_num(r.cosine_to_clean, 4)} (clean gradient: {r.clean_gradient.describe()})")
    if r.repeat_grad_norms:
        lines.append(
            f"  repeat        {len(r.repeat_grad_norms)} runs, spread {_num(r.repeat_spread, 3)}"
            + (" (deterministic)" if r.repeat_spread == 0 else "")
        )
    lines += _consistency_lines(r.consistency)
    if r.top_params:
        tops = ", ".join(f"{p.name} {_num(p.grad_norm, 4)}" for p in r.top_params[:3])
        lines.append(f"  top params    {tops}")
    if r.output_dir:
        lines.append(f"  output        {r.output_dir}")
    return "\n".join(lines)


def _consistency_lines(found: Consistency | None) -> list[str]:
    """The snapshot's agreement with itself and the training log, the checks made and each problem."""
    from axrl_spike_replay.snapshot.consistency import checks_line

    if found is None:
        return []
    own = "agrees with itself" if found.self_consistent else "DISAGREES with itself"
    log = {True: "agrees with", False: "CONTRADICTS", None: "no value in"}[found.agrees_with_log]
    return [
        f"  snapshot      {own}; {log} the training log",
        f"  checks        {checks_line(found.checked, found.skipped)}",
        *(f"  problem       [{p.name}] {p.message}" for p in found.problems),
    ]


def render_sweep(sweep: SweepResult) -> str:
    """A sweep as a table: one row per config, the baseline first."""
    base = sweep.baseline
    rows = [["baseline", base.grad_norm, base.spike_ratio, "", base.verdict]]
    for r in sweep.results:
        change = r.change_vs_baseline
        shown_change = "" if change is None else pct(change)
        rows.append([r.config_id, r.grad_norm, r.spike_ratio, shown_change, r.finding or r.verdict])
    head = [
        f"sweep of {sweep.snapshot} ({sweep.device}), fidelity {fidelity_label(sweep)}",
        f"recorded grad norm {_num(base.recorded_grad_norm, 8)}, baseline rel_diff {_num(base.rel_diff, 3)}, "
        f"{_threshold_label(base)} {_num(sweep.threshold, 4)} x median {_num(base.median_norm, 6)}",
        "",
    ]
    tail = ["", *_input_lines(base)]
    if base.error:
        tail.append(f"baseline {base.verdict}: {base.error}; the configs are judged against the recorded step")
    tail += [f"{r.config_id} {r.verdict}: {r.error}" for r in sweep.results if r.error]  # refused, the others ran
    tail += [f"output {sweep.output_dir}"] if sweep.output_dir else []
    return "\n".join([*head, table(["config", "grad norm", "x median", "vs baseline", "verdict"], rows), *tail])


def _input_lines(result: ReplayResult) -> list[str]:
    """A result's input findings (a rank's input failing a check against the model), one line each."""
    return [f"input finding: {line}" for line in result.input_findings]


def render_attribution(att: Attribution) -> str:
    """The top samples by contribution to the global grad norm."""
    rows = [
        [
            s.rank,
            s.sample,
            s.contribution,
            pct_plain(s.share),
            s.advantage,
            s.reward,
            s.max_abs_log_ratio_current_vs_base,
            s.loss_tokens,
        ]
        for s in att.samples
    ]
    fidelity = "full" if att.fidelity == "full" else "REDUCED (one process for all saved ranks)"
    lines = [
        f"attribution of {att.snapshot}: grad norm {_num(att.grad_norm, 8)} "
        f"(recorded {_num(att.recorded_grad_norm, 8)}, fidelity {fidelity})",
        f"sum of contributions {_num(att.contribution_sum, 8)} incl. router term {_num(att.router_term, 4)} "
        f"(rel error {_num(att.sum_rel_error, 2)}); top {len(rows)} of {att.total_samples} samples:",
        "",
        table(
            [
                "rank",
                "sample",
                "contribution",
                "share",
                "advantage",
                "reward",
                f"max |log(pi/pi_{att.log_ratio_base})|",
                "tokens",
            ],
            rows,
        ),
    ]
    if att.passes:
        lines += ["", att.passes]
    if att.output_dir:
        lines += ["", f"output {att.output_dir}"]
    return "\n".join(lines)
