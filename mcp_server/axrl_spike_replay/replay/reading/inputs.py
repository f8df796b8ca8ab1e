"""What a torch replay reads from a snapshot, validated before any process starts or any file is written."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from axrl_spike_replay.display import shown, shown_names
from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.experiment.mitigation.mitigations import (
    AppliedConfig,
    apply_config,
    check_current_layers,
    parse_config,
)
from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.mcore.megatron_weights import check_saved_layout
from axrl_spike_replay.models.policy import ModelSpec, check_policy_weights, parse_model_config
from axrl_spike_replay.replay.reading.input_checks import InputFinding, input_findings, refusal
from axrl_spike_replay.snapshot.completeness import missing_ranks, rank_ranges_text, ranks_text
from axrl_spike_replay.snapshot.layout import RUN_CONFIG, batch_file, rank_files
from axrl_spike_replay.snapshot.metadata import AxrlMetadata, ParallelLayout, read_metadata
from axrl_spike_replay.snapshot.rank_data import load_rank_batch, load_rank_routes
from axrl_spike_replay.training.loss_normalization import GRAD_INFO_KEY, GlobalCounts
from axrl_spike_replay.training.micro_batches import MicroBatchSpec, plan_micro_batches
from axrl_spike_replay.training.policy_loss import LossConfig
from axrl_spike_replay.training.precision import PrecisionPolicy
from axrl_spike_replay.training.routing_replay import RoutingConfig
from axrl_spike_replay.training.trl_settings import NUM_ITEMS_LOSS_TYPES
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml

# Sections the engine rebuilds from, and sections it reads but need not rebuild (the trainer's own).
ENGINE_SECTIONS = ("model", "loss", "routing", "parallel")
INFO_SECTIONS = ("train", "detector")
# the trainer's mixed-precision policy (absent: the model's own dtype); its micro-batches (absent: as recorded)
OPTIONAL_SECTIONS = ("precision", "micro_batches")
COMMAND_BACKEND_HINT = "use the command backend (`backend` command) with the trainer's own replay command"


@dataclass(frozen=True)
class ReplayInputs:
    """A snapshot as the torch engine sees it: metadata, the rebuilt configs and the ranks on disk."""

    snapshot: str  # as the user named it
    replay_dir: str  # where files are read from (a temporary replay dir for a legacy snapshot)
    legacy: bool
    metadata: AxrlMetadata
    model: ModelSpec
    loss: LossConfig
    routing: RoutingConfig
    world_size: int
    routing_ranks: tuple[int, ...]  # saved ranks with recorded routes (a routing payload, or in a verl batch)
    batch_fields: frozenset[str]
    counts: GlobalCounts | None = None  # the step's global counts, recorded by the trainer (normalization global)
    precision: PrecisionPolicy | None = None  # the run config's `precision:` section (None: none recorded)
    findings: tuple[InputFinding, ...] = ()  # ranks' inputs that fail a check against the model (input_checks)
    # how each rank's step was split (`training.micro_batches`)
    micro_batches: MicroBatchSpec = field(default_factory=MicroBatchSpec)

    @property
    def job_name(self) -> str:
        return self.metadata.job_name

    @property
    def effective_precision(self) -> PrecisionPolicy:
        """The precision the replay computes in: the recorded policy, else the model's own dtype throughout."""
        if self.precision is not None:
            return self.precision
        spec = self.model.hf if isinstance(self.model, MegatronModelConfig) else self.model
        return PrecisionPolicy.of_model(spec.dtype if isinstance(spec, HFModelConfig) else "float32")


def read_run_config(snapshot_dir: Path) -> dict[str, Any]:
    """The snapshot's `run_config.yaml` as a mapping (read without aliases, size and depth bounded).

    Sections the engine does not know are an error; every error names the file.
    """
    path = snapshot_dir / RUN_CONFIG
    if not path.is_file():
        raise SnapshotError(f"{path}: run config not found (the torch backend rebuilds the model from it)")
    doc = read_untrusted_yaml(path, "run config", within=snapshot_dir)
    if not isinstance(doc, dict):
        raise ConfigError(f"run config {path}: expected a mapping of sections, got {type(doc).__name__}")
    unknown = sorted(str(k) for k in set(doc) - set(ENGINE_SECTIONS) - set(INFO_SECTIONS) - set(OPTIONAL_SECTIONS))
    if unknown:
        known = sorted((*ENGINE_SECTIONS, *INFO_SECTIONS, *OPTIONAL_SECTIONS))
        raise ConfigError(
            f"{path}: unknown sections {shown_names(unknown)} the torch engine cannot replay (known: {known})"
        )
    for section in ENGINE_SECTIONS:
        if not isinstance(doc.get(section), dict):
            raise ConfigError(f"{path}: section {section!r} is missing or not a mapping")
    return doc


def _parallel(doc: dict[str, Any], path: Path, meta: AxrlMetadata, model_parallel_ok: bool = False) -> ParallelLayout:
    """The saved layout, checked against the run config. Model-parallel layouts (TP/PP/EP/ETP/CP > 1) replay only
    from a Megatron checkpoint (`model_parallel_ok`), which reads back in any layout; the data-parallel ranks'
    batches then replay one per saved data-parallel rank."""
    known = {f.name for f in fields(ParallelLayout)} | {"strategy"}  # strategy: ddp | fsdp, how weights were spread
    unknown = sorted(str(k) for k in set(doc) - known)
    if unknown:
        raise ConfigError(f"{path}: parallel: unknown keys {shown_names(unknown)} (known: {sorted(known)})")
    strategy = doc.get("strategy", "ddp")
    if strategy not in ("ddp", "fsdp"):
        raise ConfigError(f"{path}: parallel.strategy must be ddp or fsdp, got {shown(strategy, 40)}")
    layout = meta.parallel
    split = {name: getattr(layout, name) for name in ("tp", "pp", "ep", "etp", "cp") if getattr(layout, name) > 1}
    if split and model_parallel_ok:
        if layout.tp * layout.pp * layout.dp * layout.cp != layout.world_size:
            raise ConfigError(
                f"saved layout: tp={layout.tp} x pp={layout.pp} x dp={layout.dp} x cp={layout.cp} is not the "
                f"world size {layout.world_size}"
            )
    elif split:
        listed = ", ".join(f"{k}={v}" for k, v in split.items())
        raise ConfigError(
            f"{meta.job_name or path.parent}: the saved layout has {listed}; the torch backend rebuilds "
            f"data-parallel layouts only (tp=pp=ep=etp=cp=1); {COMMAND_BACKEND_HINT}"
        )
    if not model_parallel_ok and layout.dp != layout.world_size:
        raise ConfigError(f"saved layout: dp={layout.dp} but world_size={layout.world_size}; they must agree")
    saved = doc.get("world_size")
    if saved is not None and (isinstance(saved, bool) or not isinstance(saved, int)):
        raise ConfigError(f"{path}: parallel.world_size must be an integer, got {shown(saved, 40)}")
    if saved is not None and saved != layout.world_size:
        raise ConfigError(f"{path}: parallel.world_size={saved} but the snapshot metadata says {layout.world_size}")
    return layout


def _check_ranks(directory: Path, world_size: int) -> None:
    """SnapshotError unless batch and grad-info files cover exactly [0, world_size)."""
    files = rank_files(directory)
    for kind in ("batch", "grad_info"):
        missing = missing_ranks(files[kind], world_size)
        extra = [rank for rank in files[kind] if rank >= world_size]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {kind}_rank<r>.pt for ranks {rank_ranges_text(missing)}")
            if extra:
                parts.append(f"unexpected {kind} files for ranks {ranks_text(extra)}")
            raise SnapshotError(f"{directory}: saved world size is {world_size} but {'; '.join(parts)}")


def _section_config(build: Any, doc: Any, path: Path, section: str) -> Any:
    """`build(doc)`, with a type error from an untrusted value turned into a ConfigError naming the file."""
    try:
        return build(doc)
    except ConfigError as exc:
        raise ConfigError(f"run config {path}: {exc}") from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise ConfigError(
            f"run config {path}: {section}: invalid value ({shown(str(exc), 160, quote=False)})"
        ) from None


def load_inputs(snapshot: str | Path, replay_dir: str | Path, legacy: bool) -> ReplayInputs:
    """Read and validate everything the engine needs except tensors (batches are read as meta tensors)."""
    directory = Path(replay_dir)
    metadata, _ = read_metadata(directory)
    doc = read_run_config(directory)
    path = directory / RUN_CONFIG
    model = _section_config(parse_model_config, dict(doc["model"]), path, "model")
    layout = _parallel(doc["parallel"], path, metadata, model_parallel_ok=isinstance(model, MegatronModelConfig))
    loss = _section_config(LossConfig.from_dict, dict(doc["loss"]), path, "loss")
    routing = _section_config(RoutingConfig.from_dict, dict(doc["routing"]), path, "routing")
    precision = None
    if doc.get("precision") is not None:
        precision = _section_config(PrecisionPolicy.from_dict, doc["precision"], path, "precision")
    micro = read_micro_batches(directory, doc)
    ranks = layout.data_ranks  # the saved ranks whose batches replay (the data-parallel ones)
    _check_ranks(directory, ranks)
    check_policy_weights(directory, model, "the snapshot's checkpoint")
    if isinstance(model, MegatronModelConfig):
        check_saved_layout(directory, layout)
    # Every rank file is read as meta tensors now (pickles only), so a malformed one is an error here,
    # before any rank process starts, not a failure inside one.
    batches = [load_rank_batch(directory, rank, meta=True) for rank in range(ranks)]
    batch = batches[0]  # _check_ranks found a batch file for each rank
    routing_ranks = _routing_ranks(directory, batches)
    findings = tuple(input_findings(directory, model, ranks))
    _check_micro_batches(directory, batches, micro, loss.to_dict())
    counts = recorded_counts(directory, ranks) if loss.normalization == "global" else None
    return ReplayInputs(
        micro_batches=micro,
        precision=precision,
        counts=counts,
        snapshot=str(snapshot),
        replay_dir=str(directory),
        legacy=legacy,
        metadata=metadata,
        model=model,
        loss=loss,
        routing=routing,
        world_size=ranks,
        routing_ranks=routing_ranks,
        batch_fields=frozenset(batch),
        findings=findings,
    )


def read_micro_batches(directory: Path, doc: dict[str, Any] | None = None) -> MicroBatchSpec:
    """The run config's `micro_batches:` section (absent: each rank's batch file as it was split); ConfigError
    naming the file when it is malformed."""
    doc = read_run_config(directory) if doc is None else doc
    return _section_config(MicroBatchSpec.from_dict, doc.get("micro_batches"), directory / RUN_CONFIG, "micro_batches")


def _check_micro_batches(
    directory: Path, batches: list[dict[str, Any]], spec: MicroBatchSpec, loss: dict[str, Any]
) -> None:
    """Every rank's split fits its batch (a recorded split tiles it, a size divides it, no sequence breaks the
    token budget), checked before any process starts; SnapshotError naming the batch file and the field."""
    for rank, batch in enumerate(batches):
        rows = batch.get("micro_batch_rows")
        if spec.split == "token_budget" or getattr(rows, "is_meta", False):
            batch = load_rank_batch(directory, rank)  # lengths (or a file's own split) are data, not shapes
        plan_micro_batches(batch, spec, loss, directory / batch_file(rank))


def _routing_ranks(directory: Path, batches: list[dict[str, Any]]) -> tuple[int, ...]:
    """The ranks with recorded routes (meta tensors: nothing but the pickles is read). Their shapes and values
    against the model are `input_findings`' (a payload that does not fit refuses the configs that replay it)."""
    return tuple(
        rank
        for rank, batch in enumerate(batches)
        if load_rank_routes(directory, rank, meta=True, batch=batch) is not None
    )


def uses_input(cfg: AppliedConfig, finding: InputFinding) -> bool:
    """Whether `cfg` computes with the input `finding` is about: a rank it leaves out uses none of its inputs
    (its forward runs on the model's own routing and blanked token ids, and nothing of it reaches the step);
    recomputed routes or log-probs replace the stored ones."""
    rank = finding.rank
    if not cfg.samples.keeps_rank(rank):
        # a left-out rank's forward still runs (it keeps the passes in step) on its tokens with ids outside the
        # vocabulary blanked (`input_checks.blank_tokens`): nothing of it reaches the step
        return False
    if finding.field == "routed_experts":
        return cfg.routing.replay != "off" and cfg.recompute.route_layers(rank) is not None
    if finding.field in ("old_logprobs", "rollout_logprobs"):
        return not cfg.recompute.logprobs(finding.field, rank)
    return True


def input_refusal(inputs: ReplayInputs, cfg: AppliedConfig) -> str | None:
    """Why `cfg` cannot be computed on this snapshot's inputs (an input no computation is defined on, which it
    uses), naming the finding and the experiments that remove the bad part; None when it can."""
    for rank in sorted({f.rank for f in inputs.findings if not f.defined}):
        used = [f for f in inputs.findings if f.rank == rank and uses_input(cfg, f)]
        why = refusal(used, rank, cfg.label)
        if why is not None:
            return why
    return None


def recorded_counts(directory: Path, world_size: int) -> GlobalCounts | None:
    """The step's global counts as the trainer recorded them on every rank: its grad info's `global_batch_info`,
    else the counts its batch carries (verl's engine sets them on the mini-batch). None when no rank records any
    (the replay recounts them from the rank batches); SnapshotError when ranks disagree, some lack them, or the
    DP size is not the saved one."""
    found: dict[int, GlobalCounts] = {}
    for rank in range(world_size):
        counts = _rank_counts(directory, rank)
        if counts is not None:
            found[rank] = counts
    if not found:
        return None
    first = found[min(found)]
    if len(found) != world_size or any(c != first for c in found.values()):
        raise SnapshotError(
            f"{directory}: the ranks' global counts ({GRAD_INFO_KEY} in the grad info, or the batch's "
            "dp_size / batch_num_tokens / global_batch_size) differ or are missing on some ranks"
        )
    if first.dp_size != world_size:
        raise SnapshotError(
            f"{directory}: the recorded global counts' dp_size is {first.dp_size} but the world size is {world_size}"
        )
    return first


def _rank_counts(directory: Path, rank: int) -> GlobalCounts | None:
    from axrl_spike_replay.snapshot.rank_data import load_batch_counts, load_grad_info

    doc = load_grad_info(directory, rank).get(GRAD_INFO_KEY)
    if doc is not None:
        return GlobalCounts.from_doc(doc, f"{directory}/grad_info_rank{rank}.pt")
    in_batch = load_batch_counts(directory, rank)
    if in_batch is None:
        return None
    return GlobalCounts.from_doc(in_batch, f"{directory}/{batch_file(rank)}", entry="the batch's counts")


def _needed_fields(loss: LossConfig) -> dict[str, str]:
    needed = {"advantages": "the policy loss", "tokens": "the forward", "loss_mask": "the loss"}
    base = loss.is_base_logprobs
    if loss.mismatch_token_clip_max is not None:
        needed["old_logprobs"] = needed["rollout_logprobs"] = "mismatch_token_clip_max"
        base = "old"
    if loss.convention != "trl":  # TRL's ratio is against the current log-probs (detached) when it kept no old ones
        needed.setdefault(f"{base}_logprobs", f"is_base_logprobs={base}")
    elif loss.trl is not None and loss.trl.loss_type in NUM_ITEMS_LOSS_TYPES:
        needed["num_items_in_batch"] = f"TRL's loss_type {loss.trl.loss_type} (its normaliser)"
    if loss.ratio_outlier_mask is not None:
        needed.setdefault(f"{loss.ratio_outlier_mask.base}_logprobs", "ratio_outlier_mask")
    if loss.kl_coef:
        needed.setdefault("ref_logprobs", "kl_coef")
    if loss.convention == "verl" and (loss.rollout_is is not None or loss.rollout_rs is not None):
        needed.setdefault("rollout_logprobs", "verl's rollout correction")
    return needed


def one_config(inputs: ReplayInputs, mitigations: dict[str, Any] | None) -> AppliedConfig:
    """The config `mitigations` make of this snapshot's recorded step (none: the step as recorded), checked to run."""
    cfg = apply_config(parse_config(mitigations or {}), inputs.loss, inputs.routing, inputs.model.moe_layer_ids)
    check_configs(inputs, [cfg])
    return cfg


def check_configs(inputs: ReplayInputs, configs: Iterable[AppliedConfig]) -> None:
    """ConfigError when a config cannot run on this snapshot: missing fields, routes, layers or weights."""
    moe_layers = set(inputs.model.moe_layer_ids)
    for cfg in configs:
        label = cfg.label
        refused = input_refusal(inputs, cfg)
        if refused is not None:
            raise SnapshotError(f"{inputs.snapshot}: {refused}")
        for loss in cfg.losses():
            for name, why in _needed_fields(loss).items():
                if name not in inputs.batch_fields:
                    raise ConfigError(f"{label}: the rank batches have no {name!r}, needed for {why}")
        scoped = sorted(r for r in cfg.rank_losses if r >= inputs.world_size)
        if scoped:
            raise ConfigError(
                f"{label}: names rank {scoped[0]}, not in the snapshot (saved ranks 0..{inputs.world_size - 1})",
                "mitigations",
            )
        if cfg.routing.replay != "off":
            missing = sorted(set(range(inputs.world_size)) - set(inputs.routing_ranks))
            if missing:
                raise SnapshotError(
                    f"{inputs.snapshot}: routing replay is {shown(cfg.routing.replay, 60)} ({label}) but ranks "
                    f"{missing} have no routing_payload_rank<r>.pt (nor routed_experts in their batch); the spike step "
                    "cannot be recomputed without the recorded routes (restore the payload files, or replay a snapshot "
                    "whose run config has routing.replay: off)"
                )
        check_current_layers(cfg, moe_layers)
        bad = sorted(r for r in cfg.recompute.ranks() if r >= inputs.world_size)
        if bad:
            raise ConfigError(
                f"{label}: recompute names rank {bad[0]}, not in the snapshot (saved ranks 0..{inputs.world_size - 1})"
            )
        if cfg.recompute.routes and set(cfg.recompute.ranks() or range(inputs.world_size)) - set(inputs.routing_ranks):
            raise ConfigError(f"{label}: recompute=routes names a rank with no recorded routes to recompute")
        recounted = any(
            loss.normalization == "global" and (loss.rollout_rs or loss.ratio_outlier_mask) for loss in cfg.losses()
        )
        if cfg.recompute.recomputes_logprobs and recounted:
            raise ConfigError(
                f"{label}: recompute of log-probs with rejection sampling under normalization global: the step's "
                "token count would need the recomputed log-probs before the forward that computes them"
            )
        if cfg.weights is not None:
            weights = Path(cfg.weights)
            if not weights.is_dir():
                what = (
                    "a DCP checkpoint, snapshot or HF directory"
                    if isinstance(inputs.model, HFModelConfig)
                    else ("a DCP checkpoint or snapshot")
                )
                raise ConfigError(f"{label}: initial_model {weights} is not a directory ({what})")
            check_policy_weights(weights, inputs.model, f"{label}: initial_model")
