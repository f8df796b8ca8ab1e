"""CLI verbs that find, preserve and read snapshots: resolve, snapshots, preserve, release, inspect, prepare."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from axrl_spike_replay.cli.output import add_json_flag, emit, table
from axrl_spike_replay.display import shown


def register(sub: Any) -> None:
    """Add `resolve`, `snapshots`, `preserve`, `release`, `inspect` and `prepare`."""
    p = sub.add_parser(
        "resolve",
        help="find a job's role output dirs (*~JOB__ROLE) and their logs",
        description="Find the output dirs named <run>~JOB__<role> directly under the roots (--root, then "
        "$AXRL_OUTPUT_ROOTS colon-separated; the current directory if neither), with their *.log / logs/*.log.",
    )
    p.add_argument("job", help="job name")
    p.add_argument("--root", action="append", default=[], metavar="DIR", help="output root to search (repeatable)")
    add_json_flag(p)
    p.set_defaults(handler=_resolve)

    p = sub.add_parser(
        "snapshots",
        help="list an output dir's retained and preserved snapshots, worst first",
        description="List the retained and preserved snapshots of an output dir, in the order to investigate them: "
        "the largest spike ratio first (a preserved copy beside its rotating source), unreadable metadata last.",
    )
    p.add_argument("output_dir", help="a role output dir (<run>~<job>__<role>)")
    p.add_argument("--by-iteration", action="store_true", help="order the table by iteration instead")
    p.add_argument(
        "--workspace", default=".", metavar="DIR", help="also list copies preserved into this workspace (default: .)"
    )
    add_json_flag(p)
    p.set_defaults(handler=_snapshots)

    p = sub.add_parser(
        "preserve",
        help="hardlink snapshots into checkpoints/spike_snapshots-active/ so rotation cannot delete them",
        description="Preserve retained snapshot N (default: every retained one) as a hardlinked copy under "
        "checkpoints/spike_snapshots-active/ (a real copy only across filesystems). Idempotent; the source is "
        "only read. Exit status 1 when a snapshot could not be preserved (e.g. rotated away mid-copy). Where the "
        "output root is not writable, or with --into-workspace, the copies go into WORKSPACE/preserved-snapshots/"
        "<output dir name>/ instead (hardlinks where the filesystem allows, copies otherwise, free space checked "
        "first).",
    )
    p.add_argument("output_dir", help="a role output dir")
    p.add_argument("--iteration", type=int, default=None, metavar="N", help="only this iteration")
    _add_workspace_options(p, "--into-workspace", "write nothing under the output root: preserve into the workspace")
    add_json_flag(p)
    p.set_defaults(handler=_preserve)

    p = sub.add_parser(
        "release",
        help="delete preserved copies made by this tool (never anything else)",
        description="Delete preserved copy N (default: every preserved copy) under checkpoints/"
        "spike_snapshots-active/. Refuses any dir this tool did not make; exit status 1 when one was refused.",
    )
    p.add_argument("output_dir", help="a role output dir")
    p.add_argument("--iteration", type=int, default=None, metavar="N", help="only this iteration")
    _add_workspace_options(p, "--in-workspace", "release the copies preserve made in the workspace for this dir")
    add_json_flag(p)
    p.set_defaults(handler=_release)

    p = sub.add_parser(
        "inspect", help="a snapshot's metadata, per-rank counts, model size and problems (reads no large tensor)"
    )
    p.add_argument("snapshot", help="a snapshot dir (iter_<N>)")
    add_json_flag(p)
    p.set_defaults(handler=_inspect)

    p = sub.add_parser(
        "prepare",
        help="make a replay dir for a legacy snapshot (AXRL keys in metadata.json); the snapshot is not touched",
    )
    p.add_argument("snapshot", help="a snapshot dir (iter_<N>)")
    p.add_argument("--dest", default=None, metavar="DIR", help="replay dir to create (default: a new temp dir)")
    add_json_flag(p)
    p.set_defaults(handler=_prepare)


def _add_workspace_options(p: argparse.ArgumentParser, flag: str, help_text: str) -> None:
    p.add_argument(flag, dest="workspace_copies", action="store_true", help=help_text)
    p.add_argument("--workspace", default=".", metavar="DIR", help="the workspace for copies made there (default: .)")


def size(n: int | None) -> str:
    """Bytes for people: 1.5 GiB."""
    if n is None:
        return ""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _resolve(args: argparse.Namespace) -> int:
    from axrl_spike_replay.snapshot.discovery import resolve_job

    result = resolve_job(args.job, args.root)

    def render(r: Any) -> str:
        lines = [f"job {r.job}: {len(r.roles)} output dir(s) under {', '.join(r.roots)}", ""]
        lines.append(
            table(["role", "run", "logs", "output dir"], [[d.role, d.run, len(d.logs), d.output_dir] for d in r.roles])
        )
        for d in r.roles:
            lines += [f"  {log}" for log in d.logs[:5]] + ([f"  ... {len(d.logs) - 5} more"] if len(d.logs) > 5 else [])
        return "\n".join(lines)

    emit(result, args.json, render)
    return 0


def _snapshots(args: argparse.Namespace) -> int:
    from axrl_spike_replay.snapshot.listing import list_snapshots

    result = list_snapshots(args.output_dir, workspace=args.workspace)

    def render(r: Any) -> str:
        skipped = [f"skipped {x.path}: {x.reason}" for x in r.skipped]
        if not r.snapshots:
            empty = f"{r.output_dir}: no snapshots (looked in checkpoints/spike_snapshots and -active)"
            return "\n".join([empty, *skipped])
        place = {Path(k.path).name: k.order for k in r.ranking}  # worst first: the order to investigate
        listed = (
            r.snapshots
            if args.by_iteration
            else sorted(r.snapshots, key=lambda s: (place.get(Path(s.path).name, len(place) + 1), not s.preserved))
        )
        rows = [[s.iteration, _kind(s), s.spike_ratio, s.grad_norm, size(s.bytes), s.path] for s in listed]
        lines = [table(["iteration", "kind", "spike ratio", "grad norm", "size", "path"], rows)]
        lines += [f"problem: {s.problem}" for s in r.snapshots if s.problem] + skipped
        lines += ["", "order to investigate:"] + [f"{k.order}. iteration {k.iteration}: {k.reason}" for k in r.ranking]
        return "\n".join(lines)

    emit(result, args.json, render)
    return 0


def _kind(entry: Any) -> str:
    """How a listed snapshot is kept: rotating, preserved under the output root, or copied into the workspace."""
    if entry.in_workspace:
        return "preserved (workspace)"
    return "preserved" if entry.preserved else "retained"


def _preserve(args: argparse.Namespace) -> int:
    from axrl_spike_replay.snapshot.preservation.preserve import preserve

    result = preserve(args.output_dir, args.iteration, workspace=args.workspace, no_writes=args.workspace_copies)

    def render(r: Any) -> str:
        lines = [f"preserving into the workspace ({r.preserved_root}): {r.reason}"] if r.in_workspace else []
        for c in r.preserved:
            if c.status == "already_preserved":
                lines.append(f"iter {c.iteration}: already preserved at {c.path}")
            else:
                lines.append(
                    f"iter {c.iteration}: preserved at {c.path} ({c.linked_files} hardlinked, {c.copied_files} copied)"
                )
        lines += [f"iter {f.iteration}: FAILED: {f.error}" for f in r.failed]
        lines += [f"iter {x.iteration}: skipped {x.path}: {x.reason}" for x in r.skipped]
        return "\n".join(lines) or f"{r.output_dir}: no retained snapshots to preserve"

    emit(result, args.json, render)
    return 1 if result.failed else 0


def _release(args: argparse.Namespace) -> int:
    from axrl_spike_replay.snapshot.preservation.preserve import release

    result = release(args.output_dir, args.iteration, workspace=args.workspace if args.workspace_copies else None)

    def render(r: Any) -> str:
        lines = [f"released iter {c.iteration}: {c.path}" for c in r.released]
        lines += [f"refused {x.path}: {x.reason}" for x in r.refused]
        return "\n".join(lines) or f"{r.output_dir}: no preserved copies"

    emit(result, args.json, render)
    return 1 if result.refused else 0


def _inspect(args: argparse.Namespace) -> int:
    from axrl_spike_replay.replay.reading.input_checks import inspect_with_inputs

    emit(inspect_with_inputs(args.snapshot), args.json, render_inspection)
    return 0


def render_inspection(r: Any) -> str:
    """Readable `inspect` summary: the spike first, then layout, model, ranks and problems."""
    threshold = r.detector.get("threshold")
    lines = [
        f"iteration {r.iteration} of job {r.job_name} ({r.role}): grad norm {r.grad_norm:.6g} = "
        f"{r.spike_ratio:.2f}x the median {r.median_norm:.6g}" + (f" (threshold {threshold})" if threshold else ""),
        f"layout: world size {r.world_size} (tp {r.tp}, pp {r.pp}, dp {r.dp}, ep {r.ep}, etp {r.etp}, cp {r.cp})"
        + ("; LEGACY metadata: run `prepare` before replay" if r.legacy_metadata else ""),
        f"model: {r.model.tensors} tensors, {size(r.model.bytes)}" if r.model else "model: no readable checkpoint",
        "",
    ]
    rows = []
    for k in r.ranks:
        routed = k.routing_payload_counts
        routed_text = ", ".join(f"L{layer}:{n}" for layer, n in routed.items()) if routed else "-"
        rows.append([k.rank, k.num_samples, k.num_loss_tokens, k.seq_len, k.grad_norm, routed_text])
    lines.append(table(["rank", "samples", "loss tokens", "seq len", "grad norm", "routed tokens per MoE layer"], rows))
    lines.append("")
    lines += _settings_lines(r.settings)
    lines += [f"problem: {p}" for p in r.problems] or ["no problems found"]
    if r.consistency is not None:
        lines.append(r.consistency.summary())
        lines += [f"  [{p.name}] {p.message}" for p in r.consistency.problems if p.name == "grad_norm_vs_param_norms"]
    return "\n".join(lines)


def _settings_lines(settings: dict[str, Any]) -> list[str]:
    """The recorded loss, routing, parallel and detector settings, one line per section (`key=value, ...`)."""
    lines = []
    for name, section in settings.items():
        if isinstance(section, dict):
            text = (
                ", ".join(f"{shown(str(k), 40, quote=False)}={shown(v, 60)}" for k, v in section.items()) or "(empty)"
            )
        else:
            text = shown(section, 120)
        lines.append(f"{shown(name, 40, quote=False)}: {text}")
    return [*lines, ""] if lines else ["no run config settings recorded", ""]


def _prepare(args: argparse.Namespace) -> int:
    from axrl_spike_replay.snapshot.legacy import prepare_replay_dir

    result = prepare_replay_dir(args.snapshot, args.dest)
    emit(result, args.json, lambda r: f"{r.message}\nreplay dir: {r.replay_dir}")
    return 0
