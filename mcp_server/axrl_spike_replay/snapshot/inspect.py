"""Inspect a snapshot without reading its tensor data: metadata, per-rank counts, model size, problems.

Cost model. Each rank file is opened once with `load_pt(mmap=True)`: torch parses the small
pickle and maps the file, so every tensor's shape and dtype is known without a byte of tensor
data read (a second `meta` load would only parse the pickle twice). The two counts that need
values read just their own tensors through the mapping: `loss_mask` ([B, T], a few bytes per
token) for `num_loss_tokens`, and `routed_experts` ([B, T, L, K] int) for the routing counts.
Large tensors (activations, logits, anything else in a batch file) are never touched, so the
cost does not grow with the snapshot's size. Model size comes from the checkpoint's `.metadata`.

Sizes a file declares never size the work: one row per rank that has a file, missing ranks of the
declared world size as ranges (a world size of 10^9 with two rank files gives two rows), every
`.pt` bounded by its own size (see `safe_load`), and the checkpoint's declared tensor bytes checked
against its `.distcp` files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl_spike_replay.errors import AxrlError, SnapshotError
from axrl_spike_replay.snapshot.completeness import checkpoint_data_files, missing_ranks, rank_ranges_text, ranks_text
from axrl_spike_replay.snapshot.consistency import Consistency, check_snapshot
from axrl_spike_replay.snapshot.dcp.checkpoint import check_checkpoint_storage, summarize_checkpoint
from axrl_spike_replay.snapshot.fields import FIELD_ALIASES, find_field
from axrl_spike_replay.snapshot.layout import DCP_METADATA, RUN_CONFIG, rank_files
from axrl_spike_replay.snapshot.log_point import log_point
from axrl_spike_replay.snapshot.metadata import AxrlMetadata, ParallelLayout, read_metadata
from axrl_spike_replay.snapshot.rank_data import load_grad_info, load_grad_norm, load_routing_payload
from axrl_spike_replay.snapshot.safe_load import load_pt
from axrl_spike_replay.snapshot.trainer_formats.megatron_checkpoint import (
    is_megatron_checkpoint,
    layout_problems,
    read_megatron_checkpoint,
)
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml


@dataclass
class RankInspection:
    """One rank's files. Counts are None where the file is missing or unreadable (see `problems`)."""

    rank: int
    batch_file: str | None
    num_samples: int | None = None
    num_loss_tokens: int | None = None
    routing_payload_counts: dict[int, int] | None = None  # {global MoE layer id: tokens with a route}
    seq_len: int | None = None
    fields: list[str] = field(default_factory=list)  # batch field names as saved
    grad_norm: float | None = None
    grad_info_file: str | None = None
    routing_payload_file: str | None = None
    routing_source: str | None = None


@dataclass
class ModelSummary:
    tensors: int
    bytes: int


@dataclass
class SnapshotInspection:
    """What `inspect` reports. `problems` lists every inconsistency found; empty means none."""

    path: str
    iteration: int
    job_name: str
    role: str
    world_size: int
    tp: int
    pp: int
    dp: int
    ep: int
    etp: int
    cp: int
    grad_norm: float
    median_norm: float
    spike_ratio: float
    legacy_metadata: bool
    ranks: list[RankInspection]
    model: ModelSummary | None
    problems: list[str]
    detector: dict[str, Any] = field(default_factory=dict)
    created_at: str = ""
    consistency: Consistency | None = None  # agreement with itself and with the training log (named problems)
    megatron: dict[str, Any] | None = None  # a Megatron torch_dist checkpoint: what its shards and keys say
    # the run config's sections a person checks first, as the trainer recorded them: loss, routing, parallel, and
    # the detector (the run config's own section, else the metadata's); a section the config lacks is absent
    settings: dict[str, Any] = field(default_factory=dict)
    # every rank's inputs held to the run config's model (replay.reading.input_checks, through `inspect_with_inputs`)
    input_findings: list[str] = field(default_factory=list)


def _batch_parts(raw: Any, path: Path) -> list[Any]:
    if isinstance(raw, dict) and "micro_batches" in raw:
        parts = raw["micro_batches"]
        if not isinstance(parts, (list, tuple)) or not parts:
            raise SnapshotError(f"{path}: 'micro_batches' must be a non-empty list of dicts")
        return list(parts)
    return [raw]


def _inspect_batch(path: Path, info: RankInspection, problems: list[str]) -> None:
    import torch

    parts = _batch_parts(load_pt(path), path)
    samples = loss_tokens = 0
    seq_len = 0
    names: list[str] = []
    for i, part in enumerate(parts):
        where = f"{path}" + (f" micro_batches[{i}]" if len(parts) > 1 else "")
        if not isinstance(part, dict):
            raise SnapshotError(f"{where}: a rank batch must be a dict of tensors, got {type(part).__name__}")
        names += [str(k) for k in part if str(k) not in names]
        tokens = find_field(part, "tokens")
        if tokens is None or not isinstance(tokens[1], torch.Tensor) or tokens[1].dim() != 2:
            accepted = ", ".join(FIELD_ALIASES["tokens"])
            raise SnapshotError(f"{where}: no [batch, seq] token tensor (accepted names: {accepted})")
        samples += int(tokens[1].shape[0])
        seq_len = max(seq_len, int(tokens[1].shape[1]))
        mask = find_field(part, "loss_mask")
        if mask is None or not isinstance(mask[1], torch.Tensor):
            problems.append(f"{where}: no loss mask (accepted: {', '.join(FIELD_ALIASES['loss_mask'])})")
            loss_tokens = -1
        elif loss_tokens >= 0:
            if mask[1].shape[0] != tokens[1].shape[0]:
                rows = (mask[1].shape[0], tokens[1].shape[0])
                problems.append(f"{where}: {mask[0]} has {rows[0]} rows but {tokens[0]} has {rows[1]}")
            loss_tokens += int(torch.count_nonzero(mask[1]))  # reads only the mask's pages
    info.num_samples = samples
    info.seq_len = seq_len
    info.num_loss_tokens = loss_tokens if loss_tokens >= 0 else None
    info.fields = names


def _inspect_routing(directory: Path, rank: int, info: RankInspection, problems: list[str]) -> None:
    payload = load_routing_payload(directory, rank)
    routes = payload.routed_experts
    routed = (routes >= 0).any(dim=-1).sum(dim=(0, 1))  # [L]: tokens with at least one expert per layer
    info.routing_payload_counts = {layer: int(n) for layer, n in zip(payload.moe_layers, routed.tolist(), strict=True)}
    info.routing_source = payload.source
    if info.num_samples is not None and routes.shape[0] != info.num_samples:
        problems.append(
            f"{info.routing_payload_file}: routed_experts covers {routes.shape[0]} samples but the batch has "
            f"{info.num_samples}"
        )


def _read_rank_grad_info(directory: Path, rank: int, info: RankInspection, infos: dict[int, dict[str, Any]]) -> None:
    """The rank's grad norm; its whole grad info kept for the consistency checks when it reads (read once)."""
    try:
        infos[rank] = load_grad_info(directory, rank)
    except SnapshotError:  # the grad norm alone may still read: its own error is the problem to list
        info.grad_norm = load_grad_norm(directory, rank)
        return
    info.grad_norm = infos[rank]["grad_norm"]


def _collect(problems: list[str], step: Callable[..., None], *args: Any) -> None:
    """Run one reading step; a SnapshotError (missing, truncated, unsafe file) becomes a problem entry."""
    try:
        step(*args)
    except SnapshotError as exc:
        problems.append(str(exc))


def _read_run_config(path: Path, problems: list[str]) -> Any:
    """The run config as read (None when unreadable: the reason is a problem). It must read as YAML we accept (no
    aliases, bounded) and be a mapping of sections; what the sections hold is the replay's to check."""
    try:
        doc = read_untrusted_yaml(path, "run config", within=path.parent)
    except AxrlError as exc:
        problems.append(str(exc))
        return None
    if not isinstance(doc, dict):
        problems.append(f"run config {path}: expected a mapping of sections, got {type(doc).__name__}")
    return doc


def _check_rank_sets(directory: Path, files: dict[str, dict[int, Path]], world_size: int, problems: list[str]) -> None:
    """Rank files against the declared world size; work and messages grow with the files, not the world size."""
    for kind in ("batch", "grad_info"):
        missing = missing_ranks(files[kind], world_size)
        if missing:
            problems.append(
                f"{directory}: no {kind}_rank<r>.pt for ranks {rank_ranges_text(missing)} (world size {world_size})"
            )
    for kind in ("batch", "grad_info", "routing_payload"):
        extra = [rank for rank in files[kind] if rank >= world_size]
        if extra:
            problems.append(
                f"{directory}: {kind}_rank<r>.pt files for ranks {ranks_text(extra)} beyond the world size "
                f"{world_size} in the metadata"
            )
    routed = [rank for rank in files["routing_payload"] if rank < world_size]
    if routed and len(routed) != world_size:
        problems.append(
            f"{directory}: routing payloads only for ranks {ranks_text(routed)} of world size {world_size} "
            f"(none for {rank_ranges_text(missing_ranks(routed, world_size))})"
        )


def _check_model(directory: Path, problems: list[str]) -> ModelSummary | None:
    if not (directory / DCP_METADATA).is_file():
        problems.append(f"{directory / DCP_METADATA}: missing (no checkpoint weights to replay from)")
        return None
    try:
        summary = summarize_checkpoint(directory)
        missing = [name for name in checkpoint_data_files(directory) if not (directory / name).is_file()]
        oversized = check_checkpoint_storage(directory)
    except SnapshotError as exc:
        problems.append(str(exc))
        return None
    problems += [f"{directory / name}: missing (named by the checkpoint metadata)" for name in missing]
    problems += oversized
    return ModelSummary(tensors=summary.tensors, bytes=summary.bytes)


def _same_norm(a: float, b: float) -> bool:
    """Two records of one norm agree: within 1e-3, or the same non-finite value (NaN == NaN here)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=1e-3)


def inspect_snapshot(path: str | Path) -> SnapshotInspection:
    """Read a snapshot's metadata, per-rank counts and model size; list its problems. Reads no large tensor."""
    directory = Path(os.path.abspath(path))
    meta, legacy = read_metadata(directory)
    par = meta.parallel
    problems: list[str] = []
    if par.tp * par.pp * par.dp * par.cp != par.world_size:
        problems.append(
            f"parallel layout tp={par.tp} x pp={par.pp} x dp={par.dp} x cp={par.cp} does not make the "
            f"world size {par.world_size}"
        )
    # a non-finite norm has a non-finite ratio (the guard records inf): nothing to compare
    finite = math.isfinite(meta.grad_norm) or math.isfinite(meta.spike_ratio)
    if finite and meta.median_norm > 0 and not _same_norm(meta.spike_ratio, meta.grad_norm / meta.median_norm):
        problems.append(
            f"spike_ratio {meta.spike_ratio:.6g} != grad_norm / median_norm = {meta.grad_norm / meta.median_norm:.6g}"
        )
    run_config = None
    if not (directory / RUN_CONFIG).is_file():
        problems.append(f"{directory / RUN_CONFIG}: missing (replay needs the run's config)")
    else:
        run_config = _read_run_config(directory / RUN_CONFIG, problems)
    files = rank_files(directory)
    _check_rank_sets(directory, files, par.data_ranks, problems)

    ranks: list[RankInspection] = []
    infos: dict[int, dict[str, Any]] = {}
    for rank in sorted(set(files["batch"]) | set(files["grad_info"]) | set(files["routing_payload"])):
        info = RankInspection(
            rank=rank,
            batch_file=str(files["batch"][rank]) if rank in files["batch"] else None,
            grad_info_file=str(files["grad_info"][rank]) if rank in files["grad_info"] else None,
            routing_payload_file=str(files["routing_payload"][rank]) if rank in files["routing_payload"] else None,
        )
        if info.batch_file is not None:
            _collect(problems, _inspect_batch, files["batch"][rank], info, problems)
        if info.grad_info_file is not None:
            _collect(problems, _read_rank_grad_info, directory, rank, info, infos)
        if info.routing_payload_file is not None:
            _collect(problems, _inspect_routing, directory, rank, info, problems)
        if info.grad_norm is not None and not _same_norm(info.grad_norm, meta.grad_norm):
            problems.append(
                f"{info.grad_info_file}: grad_norm {info.grad_norm:.6g} differs from the metadata's "
                f"{meta.grad_norm:.6g}"
            )
        ranks.append(info)

    consistency = _consistency(directory, meta, files, problems, infos, run_config)
    model = _check_model(directory, problems)
    return SnapshotInspection(
        path=str(directory),
        iteration=meta.iteration,
        job_name=meta.job_name,
        role=meta.role,
        world_size=par.world_size,
        tp=par.tp,
        pp=par.pp,
        dp=par.dp,
        ep=par.ep,
        etp=par.etp,
        cp=par.cp,
        grad_norm=meta.grad_norm,
        median_norm=meta.median_norm,
        spike_ratio=meta.spike_ratio,
        legacy_metadata=legacy,
        ranks=ranks,
        model=model,
        problems=problems,
        detector={"kind": meta.detector.kind, "window": meta.detector.window, "threshold": meta.detector.threshold},
        created_at=meta.created_at,
        consistency=consistency,
        megatron=_megatron(directory, par, problems) if model is not None else None,
        settings=recorded_settings(run_config, meta),
    )


SETTINGS_SECTIONS = ("loss", "routing", "parallel")


def recorded_settings(run_config: Any, meta: AxrlMetadata) -> dict[str, Any]:
    """The run config's loss, routing and parallel sections and the detector, as recorded (no defaults filled
    in: what the trainer wrote is what a person checks). The detector is the run config's `detector` section
    when it has one, else the metadata's."""
    doc = run_config if isinstance(run_config, dict) else {}
    settings = {name: doc[name] for name in SETTINGS_SECTIONS if name in doc}
    detector = doc.get("detector")
    settings["detector"] = (
        detector
        if isinstance(detector, dict)
        else {"kind": meta.detector.kind, "window": meta.detector.window, "threshold": meta.detector.threshold}
    )
    return settings


def _megatron(directory: Path, layout: ParallelLayout, problems: list[str]) -> dict[str, Any] | None:
    """A Megatron checkpoint's facts (format, layers, experts, the TP/ETP its shards show, its keys and global
    shapes) and where they disagree with the saved layout; None for another kind of checkpoint."""
    if not is_megatron_checkpoint(directory):
        return None
    try:
        ckpt = read_megatron_checkpoint(directory)
    except SnapshotError as exc:
        problems.append(str(exc))
        return None
    problems += layout_problems(ckpt, layout)
    return {
        "backend": f"{ckpt.backend} v{ckpt.backend_version}",
        "num_layers": ckpt.num_layers,
        "num_experts": ckpt.num_experts,
        "tp_from_shards": ckpt.tp,
        "etp_from_shards": ckpt.etp,
        "writer_ranks": list(ckpt.writer_ranks),
        "tensors": {key: list(shape) for key, (shape, _) in ckpt.tensors.items()},
    }


# added to `problems` under their names (inspect makes the others itself above, except the per-parameter norm
# bound, which stays in `consistency`: synthetic test snapshots record arbitrary per-parameter norms)
_PROBLEM_CHECKS = ("grad_norm_vs_log", "metadata_vs_run_config")


def _consistency(
    directory: Path,
    meta: AxrlMetadata,
    files: dict[str, dict[int, Path]],
    problems: list[str],
    infos: dict[int, dict[str, Any]],
    run_config: Any,
) -> Consistency | None:
    """Consistency checks against the per-parameter norms, the run config and the job's log (when found next to
    the snapshot and small enough to read here). The metadata, rank files, grad info and run config are this
    call's."""
    try:
        point = log_point(directory, meta.iteration)
        found = check_snapshot(
            directory,
            log_grad_norm=point.grad_norm,
            log_source=point.source,
            log_note=point.note,
            grad_infos=infos,
            meta=meta,
            files=files,
            run_config=run_config,
        )
    except SnapshotError:
        return None  # the files' own problems are listed already
    problems += [f"[{p.name}] {p.message}" for p in found.problems if p.name in _PROBLEM_CHECKS]
    return found
