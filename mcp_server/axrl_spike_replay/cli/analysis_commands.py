"""CLI verbs that read what a snapshot and its logs say: analyze, grads, diagnose, logs."""

from __future__ import annotations

import argparse
from typing import Any

from axrl_spike_replay.cli.output import add_json_flag, emit, table
from axrl_spike_replay.cli.request_options import add_declared_option
from axrl_spike_replay.errors import ConfigError


def register(sub: Any) -> None:
    """Add `analyze`, `grads`, `diagnose` and `logs`."""
    p = sub.add_parser(
        "analyze",
        help="per-sample and per-token batch signals across ranks, with top-K outliers",
        description="Advantages, old/ref/rollout logprobs, rollout-vs-old importance ratios (log_ratio = old - "
        "rollout), loss-mask lengths, token ids, turns, rewards and routing; summary statistics, the sign balance "
        "of advantages and the top-K outlier tokens and samples by |log-ratio| and by |advantage|.",
    )
    p.add_argument("snapshot", help="a snapshot dir (iter_<N>)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="outliers to list (default 10)")
    add_json_flag(p)
    p.set_defaults(handler=_analyze)

    p = sub.add_parser("grads", help="the largest parameter grad norms, per rank and merged across ranks")
    p.add_argument("snapshot", help="a snapshot dir (iter_<N>)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="parameters to list (default 10)")
    add_json_flag(p)
    p.set_defaults(handler=_grads)

    p = sub.add_parser(
        "diagnose",
        help="the likely causes of the spike, ranked, with evidence as numbers and the experiments to run",
        description="Reads the batch signals, per-rank grad info, consistency checks, the job's log at the "
        "iteration and (when cheap, or from --attribution) per-sample attribution and route agreement per MoE "
        "layer; ranks the causes (log-prob mismatch, outlier advantage, negative-advantage dominance, routing "
        "mismatch, one rank's data, non-finite values, or none found) and lists --mitigation items to replay, "
        "least invasive first.",
    )
    p.add_argument("snapshot", help="a snapshot dir (iter_<N>)")
    p.add_argument("--attribution", default=None, metavar="FILE", help="an attribution.json from `attribute`")
    p.add_argument(
        "--logs",
        nargs="+",
        default=None,
        metavar="PATH",
        help="the job's log files (default: the logs of the job output dir the snapshot sits in)",
    )
    p.add_argument(
        "--model",
        choices=("auto", "always", "never"),
        default="auto",
        help="compute attribution and route agreement here: auto (when the checkpoint is small), always, never",
    )
    p.add_argument("--top", type=int, default=10, metavar="K", help="samples to attribute (default 10)")
    add_declared_option(p, "shard")  # the model evidence's replay; streamed computes no loss channel
    add_declared_option(p, "nproc")
    p.add_argument(
        "--workspace",
        default=".",
        help="workspace root: with a task open there for the snapshot's job, the diagnosis is kept in it (the "
        "report shows the strongest one run) (default: .)",
    )
    add_json_flag(p)
    p.set_defaults(handler=_diagnose)

    p = sub.add_parser(
        "logs",
        help="copy training logs into the workspace and scan them: grad norm / loss series, spikes, errors",
        description="Copy log files (or the *.log / logs/*.log of dirs) to ./tmp/spike-replay/<job>/logs/ "
        "(or --dest) and scan the copies: per-iteration grad norm and loss (Megatron-style and key=value lines), "
        "spikes by the spike guard's median-ratio detector, and error lines.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="log files or dirs (e.g. a role output dir)")
    p.add_argument("--dest", default=None, metavar="DIR", help="where the copies go")
    p.add_argument("--window", type=int, default=None, help="detector window (default: the run's, else 20)")
    p.add_argument("--threshold", type=float, default=None, help="detector threshold (default: the run's, else 5.0)")
    p.add_argument("--warmup", type=int, default=None, help="detector warm-up points (default: the run's, else 10)")
    p.add_argument(
        "--warmup-ratio",
        default=None,
        metavar="R|off",
        help="during the warm-up, flag a norm more than R times the median of the steps before it, as the guard "
        "does (default: the run's, else 10); off: a blind warm-up (non-finite norms only)",
    )
    p.add_argument(
        "--max-norm",
        type=float,
        default=None,
        metavar="M",
        help="flag any norm above M until the detector window has filled (default: the run's, else none)",
    )
    p.add_argument(
        "--full-series",
        action="store_true",
        help="with --json, every point of the series (default: a sample of about 2000, spikes and their "
        "neighbourhoods exact; `series_total` says how many there are)",
    )
    add_json_flag(p)
    p.set_defaults(handler=_logs)


def _f(value: Any, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _analyze(args: argparse.Namespace) -> int:
    from axrl_spike_replay.analysis.batch_signals import analyze_snapshot

    emit(analyze_snapshot(args.snapshot, top=args.top), args.json, render_analysis)
    return 0


def _token_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    return [
        [
            r["rank"],
            r["sample"],
            r["position"],
            r["token_id"],
            r["turn"],
            r.get("log_ratio_old_vs_rollout"),
            r.get("advantage"),
        ]
        for r in records
    ]


def render_analysis(r: Any) -> str:
    """Readable `analyze` summary: what is missing, the mismatch, the advantages, then the outliers."""
    lines = [
        f"iteration {r.iteration}: grad norm {r.grad_norm:.6g} ({r.spike_ratio:.2f}x median); ranks {r.ranks}; "
        f"{r.samples['count']} samples, {r.tokens['loss_tokens']} loss tokens of {r.tokens['total']}"
    ]
    lines += [f"missing: {m}" for m in r.missing]
    if r.ratio_old_vs_rollout.get("available"):
        abs_lr, outside = r.ratio_old_vs_rollout["abs_log_ratio"], r.ratio_old_vs_rollout["fraction_outside"]
        lines.append(
            f"old-vs-rollout log-ratio log(pi_old/pi_rollout): max |.| {_f(abs_lr['max'])}, "
            f"p99 {_f(abs_lr.get('p99'))}, mean {_f(abs_lr['mean'])}"
            f"; ratio outside [0.5, 2]: {outside['0.5-2.0']:.2%}, outside [0.8, 1.25]: {outside['0.8-1.25']:.2%}"
        )
    if r.advantages:
        adv = r.advantages["samples"]
        lines.append(f"advantages per sample: min {_f(adv['min'])}, max {_f(adv['max'])}, mean {_f(adv['mean'])}")
    if r.sign_balance:
        s = r.sign_balance
        lines.append(
            f"sign balance: negative {s['negative_total']:.4g} vs positive {s['positive_total']:.4g} "
            f"(neg/pos {_f(s['negative_to_positive'], '.3g')})"
            + ("" if s["dominant"] == "balanced" else f": {s['dominant']} dominates")
        )
    if r.routing.get("available"):
        imbalance = ", ".join(f"L{k}:{_f(v, '.2f')}" for k, v in r.routing["load_imbalance"].items())
        lines.append(f"routing ({', '.join(r.routing['sources'])}): expert load max/mean per layer {imbalance}")
    headers = ["rank", "sample", "pos", "token", "turn", "log(pi_old/pi_rollout)", "advantage"]
    for key, title in (
        ("tokens_by_abs_log_ratio_old_vs_rollout", "|log(pi_old/pi_rollout)|"),
        ("tokens_by_abs_advantage", "|advantage|"),
    ):
        if r.outliers.get(key):
            lines += ["", f"top tokens by {title}:", table(headers, _token_rows(r.outliers[key]))]
    by_ratio = r.outliers.get("samples_by_abs_log_ratio_old_vs_rollout")
    samples = by_ratio or r.outliers.get("samples_by_abs_advantage")
    if samples:
        rows = [
            [
                s["rank"],
                s["sample"],
                s["loss_tokens"],
                s["advantage"],
                s["seq_log_ratio_old_vs_rollout"],
                s["max_abs_log_ratio_old_vs_rollout"],
            ]
            for s in samples
        ]
        by = "max |log(pi_old/pi_rollout)|" if by_ratio else "|advantage|"
        lines += ["", f"top samples by {by}:"]
        lines.append(
            table(
                [
                    "rank",
                    "sample",
                    "loss tokens",
                    "advantage",
                    "mean log(pi_old/pi_rollout)",
                    "max |log(pi_old/pi_rollout)|",
                ],
                rows,
            )
        )
    return "\n".join(lines)


def _grads(args: argparse.Namespace) -> int:
    from axrl_spike_replay.analysis.grad_info import top_param_grads

    result = top_param_grads(args.snapshot, top=args.top)

    def render(r: Any) -> str:
        lines = [f"iteration {r.iteration}: recorded grad norm {r.recorded_grad_norm:.6g}", ""]
        lines.append(f"merged across ranks {[k.rank for k in r.ranks]} (sqrt of the sum of squared local norms):")
        lines.append(table(["parameter", "grad norm", "numel"], [[p.name, p.grad_norm, p.numel] for p in r.merged]))
        for k in r.ranks:
            top3 = ", ".join(f"{p.name} {p.grad_norm:.4g}" for p in k.top[:3])
            lines.append(
                f"rank {k.rank}: local grad norm {k.local_grad_norm:.4g}, loss {_f(k.loss)}, "
                f"tokens {_f(k.num_tokens, 'd')}; top: {top3}"
            )
        lines += [f"problem: {p}" for p in r.problems]
        return "\n".join(lines)

    emit(result, args.json, render)
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    from axrl_spike_replay.diagnosis.diagnose import render_diagnosis
    from axrl_spike_replay.investigation.request import How
    from axrl_spike_replay.investigation.task_opening import diagnose_into_task
    from axrl_spike_replay.vocabulary import Shard

    result = diagnose_into_task(
        args.workspace,
        args.snapshot,
        attribution=args.attribution,
        logs=args.logs,
        model=args.model,
        top=args.top,
        how=How(shard=Shard(args.shard), nproc=args.nproc),
    )
    emit(result, args.json, render_diagnosis)
    return 0


def _logs(args: argparse.Namespace) -> int:
    from axrl_spike_replay.diagnosis.evidence.log_scan import MAX_LINE_CHARS, scan_logs, with_sampled_series

    result = scan_logs(
        args.paths,
        args.dest,
        window=args.window,
        threshold=args.threshold,
        warmup=args.warmup,
        warmup_ratio=_ratio_option(args.warmup_ratio),
        max_norm=args.max_norm,
    )
    if args.json:  # one compact document, its size bounded unless every point is asked for
        _write_compact_json(result if args.full_series else with_sampled_series(result))
        return 0

    def render(r: Any) -> str:
        lines = [
            f"copied {len(r.copied)} log file(s) to {r.dest}; {r.lines} lines, {r.series_total} iterations "
            f"with grad norm / loss"
        ]
        if r.spikes:
            rows = [
                [s["iteration"], s["grad_norm"], s["spike_ratio"], s["median_norm"], "yes" if s.get("warm_up") else ""]
                for s in r.spikes
            ]
            lines += ["", "spikes:", table(["iteration", "grad norm", "x median", "median", "warm-up"], rows)]
        else:
            lines.append("no spikes")
        if r.errors:
            lines += ["", f"error lines: {r.error_lines} (first {min(10, len(r.errors))}):"]
            lines += [f"  {e['file']}:{e['line']} [{e['kind']}] {e['text'][:160]}" for e in r.errors[:10]]
        if r.long_lines:
            lines.append(f"long lines: {r.long_lines} over {MAX_LINE_CHARS} characters, left out of the series")
        if r.skipped:
            lines += ["", f"skipped {len(r.skipped)} entr{'y' if len(r.skipped) == 1 else 'ies'}:"]
            lines += [f"  {s['path']}: {s['reason']}" for s in r.skipped[:10]]
        return "\n".join(lines)

    emit(result, args.json, render)
    return 0


def _ratio_option(value: str | None) -> float | str | None:
    """`--warmup-ratio` as scan_logs takes it: a number, `off`, or None (the run's); ConfigError naming it otherwise."""
    if value is None or value.strip().lower() == "off":
        return value
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"--warmup-ratio must be a number > 1 or off, got {value!r}", "warmup_ratio") from None


def _write_compact_json(scan: Any) -> None:
    """`scan` as one compact JSON document on stdout; its (possibly long) series converted point by point only
    where a value is not finite."""
    import dataclasses
    import json
    import math
    import sys

    from axrl_spike_replay.cli.output import to_jsonable

    doc = to_jsonable(dataclasses.replace(scan, series_points=[]))
    finite = math.isfinite
    doc["series_points"] = [
        p
        if (p["grad_norm"] is None or finite(p["grad_norm"])) and (p["loss"] is None or finite(p["loss"]))
        else to_jsonable(p)
        for p in scan.series_points
    ]
    sys.stdout.write(json.dumps(doc, separators=(",", ":")))
    sys.stdout.write("\n")
