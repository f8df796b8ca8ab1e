"""CLI verbs for the investigation record: `task`, `method` and `report`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from axrl_spike_replay.cli.output import add_json_flag, emit, table
from axrl_spike_replay.workspace.task_record.experiment_row import ExperimentRow
from axrl_spike_replay.workspace.task_record.views import MethodAdded, MethodEntry, ReportResult, TaskView


def register(sub: Any) -> None:
    """Add `task`, `method` and `report`."""
    task = sub.add_parser(
        "task",
        help="the investigation's task file (agent-task/spike-replay/<job>.md)",
        description="Open and edit the task file of one spike investigation. Replays log themselves into it.",
    )
    verbs = task.add_subparsers(dest="task_command", metavar="ACTION")
    verbs.required = True

    p = _with_workspace(verbs.add_parser("open", help="open (or re-open) the task for JOB; history is kept"))
    p.add_argument("job", metavar="JOB", help="job name (the snapshot's job_name)")
    p.add_argument("--snapshot", default=None, metavar="PATH", help="set the active snapshot (and diagnose it)")
    p.add_argument(
        "--diagnosis",
        default="never",
        choices=("never", "auto", "always", "off"),
        help="diagnose a new snapshot into Observations and Next steps with model evidence never (default: static "
        "evidence only, the weights are not loaded), auto (attribution and route agreement when the checkpoint is "
        "at most 256 MiB), always; off: no diagnosis",
    )
    add_json_flag(p)
    p.set_defaults(handler=_task_open)

    p = _with_workspace(verbs.add_parser("note", help="add a line to Observations or Next steps"))
    p.add_argument("job", metavar="JOB", help="job name of an open task")
    p.add_argument(
        "--section", required=True, choices=("observations", "next-steps"), help="where the line goes: %(choices)s"
    )
    p.add_argument("text", metavar="TEXT", help="the line to add (markdown)")
    add_json_flag(p)
    p.set_defaults(handler=_task_note)

    p = _with_workspace(verbs.add_parser("set-snapshot", help="set the active snapshot (earlier ones are kept)"))
    p.add_argument("job", metavar="JOB", help="job name of an open task")
    p.add_argument("snapshot", metavar="PATH", help="snapshot directory (iter_<N>) the investigation now works on")
    add_json_flag(p)
    p.set_defaults(handler=_task_set_snapshot)

    p = _with_workspace(verbs.add_parser("set-command", help="set the replay command to rerun"))
    p.add_argument("job", metavar="JOB", help="job name of an open task")
    p.add_argument("command_text", metavar="TEXT", help="the command line, as one quoted argument")
    add_json_flag(p)
    p.set_defaults(handler=_task_set_command)

    p = _with_workspace(verbs.add_parser("show", help="show the task: experiments, failures, notes"))
    p.add_argument("job", metavar="JOB", help="job name of an open task")
    add_json_flag(p)
    p.set_defaults(handler=_task_show)

    method = sub.add_parser(
        "method",
        help="write up proven mitigations (spike-mitigation-methods/<slug>.md)",
        description="Write a logged, cleared or partial, non-duplicate attempt up as a method file, or list them.",
    )
    mverbs = method.add_subparsers(dest="method_command", metavar="ACTION")
    mverbs.required = True
    p = _with_workspace(mverbs.add_parser("add", help="write attempt ID of JOB up as a method file"))
    p.add_argument("--job", required=True, metavar="JOB", help="job name of the task that logged the attempt")
    p.add_argument("--attempt", required=True, metavar="ID", help="experiment id from `task show`, e.g. E3")
    p.add_argument("--name", required=True, metavar="SLUG", help="file name of the method (plain name, no path)")
    p.add_argument("--rationale", required=True, metavar="TEXT", help="why the mitigation works")
    p.add_argument(
        "--allow-reduced", action="store_true", help="accept a reduced-fidelity replay (written up as diagnostic)"
    )
    p.add_argument("--replace", action="store_true", help="overwrite the method file of the same name")
    add_json_flag(p)
    p.set_defaults(handler=_method_add)
    p = _with_workspace(mverbs.add_parser("list", help="list the method files and their status"))
    add_json_flag(p)
    p.set_defaults(handler=_method_list)

    p = _with_workspace(
        sub.add_parser(
            "report",
            help="write the investigation report (tmp/spike-replay/<job>/report.md) and print it",
            description="Render the final report from the task state, write it atomically and print it. "
            "With --release, then remove the preserved hardlink copies this investigation uses (those of the "
            "task's current snapshot); the last copy of a snapshot whose rotating iter_N is gone is kept unless "
            "--release-last-copy. Exit status 1 when a copy was not released.",
        )
    )
    p.add_argument("job", metavar="JOB", help="job name of the task to report on")
    p.add_argument("--release", action="store_true", help="after writing, release the preserved snapshot copies")
    p.add_argument(
        "--release-last-copy",
        action="store_true",
        help="with --release: also release a copy that is the last one of its snapshot (the source rotated away)",
    )
    add_json_flag(p)
    p.set_defaults(handler=_report)


def _with_workspace(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--workspace", default=".", metavar="DIR", help="workspace root (default: current directory)")
    return parser


def _task_open(args: argparse.Namespace) -> int:
    from axrl_spike_replay.investigation.task_opening import open_task

    emit(
        open_task(args.workspace, args.job, snapshot=args.snapshot, diagnosis=args.diagnosis),
        args.json,
        _task_renderer(args),
    )
    return 0


def _task_note(args: argparse.Namespace) -> int:
    from axrl_spike_replay.workspace.task_record.task_state import note

    emit(note(args.workspace, args.job, args.section, args.text), args.json, _task_renderer(args))
    return 0


def _task_set_snapshot(args: argparse.Namespace) -> int:
    from axrl_spike_replay.workspace.task_record.task_state import set_snapshot

    emit(set_snapshot(args.workspace, args.job, args.snapshot), args.json, _task_renderer(args))
    return 0


def _task_set_command(args: argparse.Namespace) -> int:
    from axrl_spike_replay.workspace.task_record.task_state import set_command

    emit(set_command(args.workspace, args.job, args.command_text), args.json, _task_renderer(args))
    return 0


def _task_show(args: argparse.Namespace) -> int:
    from axrl_spike_replay.workspace.task_record.task_state import show_task

    emit(show_task(args.workspace, args.job), args.json, _task_renderer(args))
    return 0


def _method_add(args: argparse.Namespace) -> int:
    from axrl_spike_replay.workspace.method_files.methods import add_method

    result = add_method(
        args.workspace,
        args.job,
        args.attempt,
        args.name,
        args.rationale,
        allow_reduced=args.allow_reduced,
        replace=args.replace,
    )
    emit(result, args.json, lambda m: _render_method_added(m, _workspace(args)))
    return 0


def _method_list(args: argparse.Namespace) -> int:
    from axrl_spike_replay.workspace.method_files.methods import list_methods

    emit(list_methods(args.workspace), args.json, _render_methods)
    return 0


def _report(args: argparse.Namespace) -> int:
    from axrl_spike_replay.workspace.report import write_report

    result = write_report(args.workspace, args.job, release=args.release, release_last_copy=args.release_last_copy)
    emit(result, args.json, lambda r: _render_report(r, _workspace(args)))
    return 1 if any(not entry["released"] for entry in result.released) else 0


def _change(row: ExperimentRow) -> str:
    """A mitigated row's change vs its baseline as the task file and report show it (`-99.7%`)."""
    from axrl_spike_replay.workspace.render import pct

    return "" if row.is_baseline or row.hypothesis else pct(row.change_vs_baseline)


def _workspace(args: argparse.Namespace) -> Path:
    """The workspace a verb used, as people should read it: absolute (the default is the current directory)."""
    return Path(args.workspace).expanduser().resolve()


def _task_renderer(args: argparse.Namespace) -> Callable[[TaskView], str]:
    return lambda task: _render_task(task, _workspace(args))


def _render_task(task: TaskView, workspace: Path) -> str:
    lines = [f"task {task.job} in workspace {workspace}: {task.task_file}", f"snapshot: {task.snapshot or '(none)'}"]
    lines.append(f"command:  {task.command or '(none)'}")
    if task.experiments:
        cols = ("id", "fidelity", "change", "grad_norm", "ratio_to_median", "change vs baseline", "verdict")
        rows = [
            [r.id, r.fidelity, r.change, r.grad_norm, r.ratio_to_median, _change(r), r.finding or r.verdict]
            for r in task.experiments
        ]
        lines += ["", table(cols, rows)]
    if task.failed:
        lines += ["", table(("id", "target", "reason"), [[f["id"], f["target"], f["reason"]] for f in task.failed])]
    for title, notes in (("observations", task.observations), ("next steps", task.next_steps)):
        if notes:
            lines += ["", f"{title}:"] + [_bullet(n["text"]) for n in notes]
    return "\n".join(lines)


def _bullet(text: str) -> str:
    """A note as one bullet; its own lines (a cause's evidence, each a `- ...`) indented under it."""
    first, *rest = str(text).splitlines() or [""]
    return "\n".join([f"  - {first}", *(f"    {line.strip()}" for line in rest if line.strip())])


def _render_method_added(method: MethodAdded, workspace: Path) -> str:
    text = f"{method.status} method {method.slug} in workspace {workspace} -> {method.path}\n{method.summary}"
    if method.confirms_shipped:
        text += f"\nsame change as the shipped method {method.confirms_shipped}: this spike confirms it"
    return text + "".join(f"\nwarning: {w}" for w in method.warnings)


def _render_methods(methods: list[MethodEntry]) -> str:
    """The workspace's methods, then the shipped ones apart: those were measured on the reference trainer's spikes,
    not on this workspace's, and a shipped change this workspace confirmed is said so rather than shown as new."""
    if not methods:
        return "no method files"
    own = [m for m in methods if m.source != "shipped"]
    shipped = [m for m in methods if m.source == "shipped"]
    confirmed = {
        str(m.front_matter.get("confirms_shipped")): m.slug for m in own if m.front_matter.get("confirms_shipped")
    }
    heads = ("rank", "method", "status", "cos to clean", "tokens touched", "summary")
    lines = []
    if own:
        lines += [
            "methods of this workspace (measured on its spikes; rank: one ranking with the shipped ones):",
            table(heads, [_method_row(m) for m in own]),
        ]
    if shipped:
        rows = [
            [*_method_row(m)[:-1], f"(same change as this workspace's {confirmed[m.slug]}) {m.summary}"]
            if m.slug in confirmed
            else _method_row(m)
            for m in shipped
        ]
        lines += ["" if own else None, "shipped with the tool (measured on the reference trainer's spikes, not on "
                  "yours; job: the reference run):", table((*heads[:-1], "job", "summary"),
                  [[*r[:-1], m.front_matter.get("job_name") or m.front_matter.get("job"), r[-1]]
                   for r, m in zip(rows, shipped, strict=True)])]  # fmt: skip
    return "\n".join(line for line in lines if line is not None)


def _method_row(m: MethodEntry) -> list[Any]:
    """rank (in the one ranking of both lists), name, status, cosine to clean, footprint, summary."""
    return [
        m.rank,
        m.slug,
        m.status,
        _figure(m.front_matter.get("cosine_to_clean"), "{:.4f}")
        + (" (rough)" if m.front_matter.get("clean_reached") is False else ""),
        _figure(m.front_matter.get("token_fraction"), "{:.1%}"),
        m.summary,
    ]


def _figure(value: object, spec: str) -> str:
    return spec.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "n/a"


def _render_report(result: ReportResult, workspace: Path) -> str:
    lines = [result.text.rstrip("\n"), "", f"report of workspace {workspace} written to {result.path}"]
    for entry in result.released:
        state = "released" if entry["released"] else f"NOT released: {entry['error']}"
        lines.append(f"preserved copy {entry['path']}: {state}")
    return "\n".join(lines)
