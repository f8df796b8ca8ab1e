"""A replay's plan before anything loads: how much memory each process needs for N processes
(`process_memory`), whether that fits where the replay would run, the smallest N at full fidelity and the layout
it suggests.

Read from the snapshot: its metadata (saved world size), the run config's `model:` section (the model is built on
the meta device: shapes only, no weights read, no memory) and the shapes of each rank's batch (meta tensors: no
data read). So `plan` works on a config-only snapshot of a model far larger than this machine.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.errors import ConfigError, SnapshotError
from axrl_spike_replay.models.chunked_head import chunk_tokens
from axrl_spike_replay.replay.compute.process_memory import (
    ModelFacts,
    ProcessMemory,
    StepDtypes,
    model_facts,
    process_memory,
    step_dtypes,
)
from axrl_spike_replay.replay.plans.layout_plan import plan_layout
from axrl_spike_replay.replay.streamed.expert_plan import planned_row
from axrl_spike_replay.replay.streamed.speeds import Speeds
from axrl_spike_replay.replay.streamed.streamed_plan import StreamedRow, model_pieces
from axrl_spike_replay.training.precision import PrecisionPolicy

if TYPE_CHECKING:
    from axrl_spike_replay.training.micro_batches import MicroBatchSpec

GPU_USABLE = 0.92  # of a GPU's total memory: the rest is the allocator's fragmentation and NCCL's buffers
HOST_USABLE = 0.9  # of this machine's available memory
GIB = 1 << 30
HERE = "here"  # plan against this machine's memory


@dataclass(frozen=True)
class Capacity:
    """Memory where the replay would run: `devices` of `bytes_each` (GPUs), or one host's memory."""

    where: str  # "this machine" or the target's name
    device: str  # cpu | cuda
    devices: int  # GPUs (cuda), 1 (cpu)
    bytes_each: int  # usable bytes of one GPU, or of the host
    source: str  # how it was learned


@dataclass
class PlanRow:
    """The replay on `nproc` processes."""

    nproc: int
    ranks_per_process: int
    fidelity: str  # full | reduced
    sharded: bool
    memory: ProcessMemory
    processes_per_device: int
    per_device: int  # bytes on one GPU (or the host) for its processes
    fits: bool | None  # None: no capacity known
    checkpointed: bool = False  # decoder layers recompute their activations in the backward


@dataclass
class ReplayPlan:
    """The plan of a snapshot's replay; `text()` says it for people and errors."""

    snapshot: str
    model: str
    parameters: int
    param_dtype: str
    grad_dtype: str
    world_size: int
    tokens_per_rank: int
    seq_len: int
    configs: int
    shard: str  # on | off | auto: which rows the choice is made from
    capacity: Capacity | None
    rows: list[PlanRow] = field(default_factory=list)
    chosen: PlanRow | None = None  # for the requested nproc (default: the saved world size)
    whole: PlanRow | None = None  # the whole-model row of the requested nproc (what `auto` judges)
    smallest_full_fidelity: PlanRow | None = None  # the layout suggested: one process per saved rank, else the most
    # processes that fit (each replaying several saved ranks in turn); every layout is full fidelity
    layout: str = ""
    notes: list[str] = field(default_factory=list)
    attention: str = "eager"  # the attention kernel replayed (`models.attention_kernels`)
    micro_batch: tuple[int, int] = (0, 0)  # [sequences, tokens] of the largest micro-batch: what one forward holds
    head_chunk: int = 0  # tokens per chunk of the head (`models.chunked_head`)
    launch: dict[str, Any] | None = None  # what the launcher would run (its dry run, as JSON), where one starts them
    streamed: StreamedRow | None = None  # one process, one decoder layer at a time (`replay.streamed`)

    @property
    def streams(self) -> bool:
        """Whether the replay runs streamed: asked for, or under auto when no full-fidelity layout fits and it does."""
        if self.shard == "streamed":
            return True
        row = self.streamed
        chosen_fails = self.chosen is not None and self.chosen.fits is False
        full_fails = self.smallest_full_fidelity is None
        return self.shard == "auto" and full_fails and chosen_fails and row is not None and row.fits is True

    @property
    def fits(self) -> bool | None:
        if self.streams and self.streamed is not None:
            return self.streamed.fits
        return None if self.chosen is None else self.chosen.fits

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for row, key in (
            (self.chosen, "chosen"),
            (self.whole, "whole"),
            (self.smallest_full_fidelity, "smallest_full_fidelity"),
        ):
            if row is not None:
                doc[key]["memory"]["peak"] = row.memory.peak
        for row, item in zip(self.rows, doc["rows"], strict=True):
            item["memory"]["peak"] = row.memory.peak
        doc["fits"] = self.fits
        doc["streams"] = self.streams
        return doc

    def text(self) -> str:
        """The plan in a few lines."""
        lines = [
            f"{self.model}: {parameter_count(self.parameters)} parameters ({self.param_dtype}, gradients "
            f"{self.grad_dtype}); saved world size {self.world_size}, {self.tokens_per_rank} tokens per rank "
            f"(sequence {self.seq_len})",
            f"one forward holds a micro-batch of {self.micro_batch[0]} x {self.micro_batch[1]} tokens; attention "
            f"{self.attention}; the head in chunks of {self.head_chunk} tokens",
        ]
        cap = self.capacity
        if cap is not None:
            what = f"{cap.devices} GPU(s) of {_gib(cap.bytes_each)} usable" if cap.device == "cuda" else None
            lines.append(
                f"capacity on {cap.where}: {what or _gib(cap.bytes_each) + ' of host memory usable'} ({cap.source})"
            )
        for label, row in (("requested", self.chosen), ("suggested", self.smallest_full_fidelity)):
            if row is not None:
                lines.append(f"{label}: {_row_text(row)}")
        if self.streamed is not None:
            lines.append(("chosen: " if self.streams else "") + self.streamed.text())
        if self.layout:
            lines.append(f"layout: {self.layout}")
        lines += self.notes
        if self.launch is not None:
            lines.append(f"would launch: {self.launch.get('text', '')}")
        return "\n".join(lines)


def parameter_count(n: float) -> str:
    """A parameter count for people, 3 significant digits and a suffix: 512, 43.8K, 1.2M, 30.5B, 671B, 1.5T."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale * 0.9995:  # 999,600 reads 1M, not 1e+03K
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def _row_text(row: PlanRow) -> str:
    m = row.memory
    how = "sharded (FSDP2)" if row.sharded else "whole model in each process"
    how += ", decoder layers checkpointed" if row.checkpointed else ""
    fits = {True: "fits", False: "DOES NOT FIT", None: "capacity unknown"}[row.fits]
    return (
        f"{row.nproc} process(es), {row.fidelity} fidelity, {how}: per process parameters {_gib(m.parameters)}, "
        f"gradients {_gib(m.gradients)}, activations {_gib(m.activations)}, "
        + (f"units gathered in the backward {_gib(m.gathered)}, " if m.gathered else "")
        + f"runtime {_gib(m.runtime)}, loading {_gib(m.loading)} -> peak {_gib(m.peak)}; "
        f"{row.processes_per_device} per device = {_gib(row.per_device)}: {fits}"
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


class PlanRefused(ConfigError):
    """A replay that cannot fit where it would run, refused before anything loads; the plan is in the message."""

    def __init__(self, plan: ReplayPlan) -> None:
        super().__init__(
            "the replay does not fit where it would run, so nothing was loaded. The plan:\n" + plan.text(), "nproc"
        )
        self.plan = plan


def snapshot_shapes(snapshot: Path, world_size: int) -> tuple[int, int]:
    """(batch, seq) of the largest rank batch (by tokens), from the batch files' shapes only (no data read)."""
    return max((shapes[0] for shapes in _rank_shapes(snapshot, world_size)), key=lambda s: s[0] * s[1])


def micro_batch_count(snapshot: Path, world_size: int, spec: MicroBatchSpec) -> int:
    """The most micro-batches any rank is replayed in, from shapes only (a token budget's split needs the
    sequences' lengths: counted as more than one)."""
    most = 1
    for rank_shape, parts in _rank_shapes(snapshot, world_size):
        if spec.split == "size" and spec.size is not None:
            most = max(most, -(-rank_shape[0] // spec.size))
        elif spec.split == "token_budget":
            most = max(most, 2)
        elif spec.split == "recorded":
            most = max(most, len(parts))
    return most


def micro_batch_shapes(snapshot: Path, world_size: int, spec: MicroBatchSpec) -> tuple[int, int]:
    """(batch, seq) of the largest micro-batch any rank is replayed in (`training.micro_batches`: the batch files'
    own split, or the run config's `size`), from shapes only; a token budget's split needs the sequences' lengths,
    so it counts the whole rank."""
    best = (0, 0)
    for rank_shape, parts in _rank_shapes(snapshot, world_size):
        if spec.split == "size" and spec.size is not None:
            parts = [(min(spec.size, rank_shape[0]), rank_shape[1])]
        elif spec.split != "recorded":
            parts = [rank_shape]
        for shape in parts:
            if shape[0] * shape[1] > best[0] * best[1]:
                best = shape
    return best


def _rank_shapes(snapshot: Path, world_size: int) -> list[tuple[tuple[int, int], list[tuple[int, int]]]]:
    """Per rank: (its batch's (batch, seq), each recorded micro-batch's (batch, seq)), shapes only."""
    from axrl_spike_replay.snapshot.fields import MICRO_BATCH_ROWS, MICRO_BATCH_WIDTHS
    from axrl_spike_replay.snapshot.rank_data import load_rank_batch

    out = []
    for rank in range(world_size):
        try:
            batch = load_rank_batch(snapshot, rank, meta=True)
            tokens = batch["tokens"]
        except (OSError, KeyError) as exc:
            raise SnapshotError(f"{snapshot}: rank {rank}'s batch cannot be read for the plan ({exc})") from None
        shape = (int(tokens.shape[0]), int(tokens.shape[1])) if tokens.dim() == 2 else (0, 0)
        rows, widths = batch.get(MICRO_BATCH_ROWS), batch.get(MICRO_BATCH_WIDTHS)  # made by the reader: real
        parts = [shape]
        if rows is not None and widths is not None and not rows.is_meta and not widths.is_meta:
            parts = [(int(r), int(w)) for r, w in zip(rows.tolist(), widths.tolist(), strict=False)] or [shape]
        out.append((shape, parts))
    return out


def machine_capacity(device: str) -> Capacity:
    """This machine's memory for a replay: its GPUs' (cuda) or its available host memory (cpu)."""
    if device == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count:
            total = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
            return Capacity("this machine", "cuda", count, int(total * GPU_USABLE), "torch.cuda")
        return Capacity("this machine", "cuda", 0, 0, "no GPU visible to torch")
    usable = int(available_memory() * HOST_USABLE)
    return Capacity("this machine", "cpu", 1, usable, "MemAvailable of /proc/meminfo")


def available_memory() -> int:
    """This machine's available memory in bytes (`MemAvailable` of /proc/meminfo; the physical memory where that
    cannot be read)."""
    import os

    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def node_capacity(report: Any, device: str) -> Capacity | None:
    """A probed node's GPUs (`remote.nodes.node_probe.NodeReport`); None for a CPU replay (the probe reads no host
    memory)."""
    if device != "cuda":
        return None
    sizes = [g.memory_total_mib for g in report.gpus if g.memory_total_mib]
    bytes_each = int(min(sizes) * (1 << 20) * GPU_USABLE) if sizes else 0
    return Capacity(report.target, "cuda", report.gpu_count, bytes_each, "nvidia-smi on the node")


def _sharing(processes: int, cap: Capacity | None) -> int:
    """How many of a streamed replay's `processes` share one memory: all of them the host's, or a GPU each."""
    if cap is None or cap.device != "cuda":
        return processes
    return math.ceil(processes / max(cap.devices, 1))


def _row(facts: ModelFacts, nproc: int, world: int, shape: tuple[int, int], sharded: bool, cap: Capacity | None,
         device: str, configs: int, nodes: int, dtypes: StepDtypes, checkpointed: bool = False,
         micro_batches: int = 1) -> PlanRow:  # fmt: skip
    memory = process_memory(facts, nproc, world, *shape, sharded=sharded, device=device, configs=configs,
                            dtypes=dtypes, checkpointed=checkpointed, micro_batches=micro_batches)  # fmt: skip
    if cap is None:
        per_device, fits, share = memory.peak, None, 1
    elif cap.device == "cuda":
        gpus = max(cap.devices * nodes, 1)
        share = math.ceil(nproc / gpus)
        per_device = share * memory.step  # loading happens in host memory
        fits = cap.devices > 0 and per_device <= cap.bytes_each
    else:
        share = math.ceil(nproc / nodes)
        per_device = share * memory.peak
        fits = per_device <= cap.bytes_each
    fidelity = str(plan_layout(world, nproc).fidelity)  # every saved rank replayed, by as many processes or fewer
    return PlanRow(nproc, math.ceil(world / nproc), fidelity, sharded, memory, share, per_device, fits,
                   checkpointed)  # fmt: skip


def _choose(facts: ModelFacts, nproc: int, world: int, shape: tuple[int, int], shard: str, cap: Capacity | None,
            device: str, configs: int, nodes: int, dtypes: StepDtypes,
            checkpoint: bool | None = None, micro_batches: int = 1) -> PlanRow:  # fmt: skip
    """The first layout that fits, in this order: the whole model, then with checkpointed layers, then sharded (when
    `shard` allows it and there is more than one process), then sharded and checkpointed; the last one tried when
    none fits. Unknown capacity keeps the whole model, not checkpointed. `checkpoint` True / False: only the
    layouts with (without) checkpointed layers."""
    ways = [] if shard == "on" else [(False, False), (False, True)]
    if shard == "on" or (shard == "auto" and nproc > 1):
        ways += [(True, False), (True, True)]
    if checkpoint is not None:
        ways = [(sh, ck) for sh, ck in ways if ck == checkpoint]
    rows = [_row(facts, nproc, world, shape, sh, cap, device, configs, nodes, dtypes, ck, micro_batches)
            for sh, ck in ways]  # fmt: skip
    return next((row for row in rows if row.fits is not False), rows[-1])


def plan_replay(
    snapshot: str | Path,
    *,
    nproc: int | None = None,
    device: str = "cpu",
    capacity: Capacity | str | None = HERE,
    shard: str = "auto",
    configs: int = 1,
    nodes: int = 1,
    checkpoint: bool | None = None,
    measure_speeds: bool = False,
    speeds_cache: Path | None = None,
    speeds: Speeds | None = None,
) -> ReplayPlan:
    """The plan of a replay of `snapshot` on `nproc` processes (default: the saved world size) over `nodes` nodes,
    against `capacity` (default: this machine's; None: unknown, nothing judged). `shard`: off (the whole model in
    each process), on (FSDP2), or auto (whole when it fits). `checkpoint`: decoder layers checkpointed (True), not
    (False), or where the layout needs it (None). Reads metadata, the run config and batch shapes; never a
    weight. `measure_speeds`: the streamed row's time at this machine's read and compute speeds (`node_speeds`:
    a bounded read of the checkpoint's largest file, a matmul; kept in `speeds_cache` when given), else at `speeds`
    where given (a node's, measured there: `remote.nodes.remote_speeds`), else at the assumed ones, said."""
    from axrl_spike_replay.models.policy import parse_model_config
    from axrl_spike_replay.replay.reading.inputs import read_micro_batches, read_run_config
    from axrl_spike_replay.snapshot.metadata import read_metadata

    if shard not in ("on", "off", "auto", "streamed"):
        raise ConfigError(f"`shard` must be on, off, auto or streamed, got {shard!r}", "shard")
    path = Path(snapshot).expanduser().resolve()
    meta, _legacy = read_metadata(path)
    world = meta.parallel.data_ranks
    run_config = read_run_config(path)
    spec = parse_model_config(run_config["model"])
    facts = model_facts(spec)
    recorded = run_config.get("precision")
    precision = None if recorded is None else PrecisionPolicy.from_dict(recorded, f"{path}: precision")
    dtypes = step_dtypes(facts.dtype, precision)
    rank_shape = snapshot_shapes(path, world)
    # what one forward holds at a time
    split = read_micro_batches(path, run_config)
    shape = micro_batch_shapes(path, world, split)
    count = micro_batch_count(path, world, split)
    cap = machine_capacity(device) if isinstance(capacity, str) else capacity
    wanted = nproc or world
    if not 1 <= wanted <= world:
        raise ConfigError(f"`nproc` {wanted}: give 1 to the saved world size {world}", "nproc")
    candidates = sorted({n for n in range(1, world + 1) if world % n == 0 and n % nodes == 0} | {wanted})
    ways = "off" if shard == "streamed" else shard  # a streamed replay's own row is `streamed`
    streaming = nproc or 1  # a streamed replay splits the saved ranks over `nproc` processes (default one)
    rows = [_choose(facts, n, world, shape, ways, cap, device, configs, nodes, dtypes, checkpoint, count)
            for n in candidates]  # fmt: skip
    chosen = next(r for r in rows if r.nproc == wanted)
    # every layout replays every saved rank (full fidelity): one process per saved rank when that fits, else the
    # most processes that fit, each replaying several saved ranks in turn
    fitting = [r for r in rows if r.fits is not False]
    full = next((r for r in fitting if r.nproc == world), max(fitting, key=lambda r: r.nproc, default=None))
    if measure_speeds:
        speeds = _speeds(spec, path, device, dtypes.params, speeds_cache)
    elif speeds is None:
        speeds = _assumed(device, cap)
    plan = ReplayPlan(
        snapshot=str(path),
        model=facts.description,
        parameters=facts.parameters,
        param_dtype=dtypes.params,
        grad_dtype=dtypes.grads,
        world_size=world,
        tokens_per_rank=rank_shape[0] * rank_shape[1],
        seq_len=rank_shape[1],
        configs=configs,
        attention=facts.attention,
        micro_batch=shape,
        head_chunk=chunk_tokens(facts.vocab),
        shard=shard,
        capacity=cap,
        rows=rows,
        chosen=chosen,
        whole=chosen
        if not chosen.sharded
        else _choose(facts, wanted, world, shape, "off", cap, device, configs, nodes, dtypes, checkpoint, count),
        smallest_full_fidelity=full,
        streamed=planned_row(
            spec,
            facts,
            model_pieces(spec),
            world=world,
            rank_tokens=rank_shape[0] * rank_shape[1],
            micro_batch=shape,
            device=device,
            configs=configs,
            capacity_bytes=None if cap is None else cap.bytes_each,
            element=dtypes.compute,
            processes=streaming,
            sharing=_sharing(streaming, cap),
            speeds=speeds,
        ),
    )
    plan.layout = _layout(plan, nodes)
    if shape != rank_shape:
        plan.notes.append(
            f"activations counted for one micro-batch of {shape[0]} x {shape[1]} tokens: the replay runs each "
            "rank's step micro-batch by micro-batch, as the trainer split it"
        )
    return plan


def _assumed(device: str, cap: Capacity | None) -> Speeds:
    """The assumed speeds, saying where they were not measured."""
    where = "" if cap is None or cap.where == "this machine" else f" on {cap.where}"
    return Speeds.assumed(device, "not measured" + where)


def _speeds(spec: Any, path: Path, device: str, dtype: str, cache: Path | None) -> Speeds:
    """This machine's speeds for the streamed row (`node_speeds`), reading where the replay reads the weights."""
    from axrl_spike_replay.replay.plans.node_speeds import node_speeds
    from axrl_spike_replay.replay.plans.speed_inputs import weights_read

    return node_speeds(weights_read(spec, path), device, dtype, cache)


def _layout(plan: ReplayPlan, nodes: int) -> str:
    """The layout the plan suggests, in words."""
    row, cap = plan.smallest_full_fidelity, plan.capacity
    if plan.streams:
        return "one process, streamed: every saved rank, one decoder layer at a time read from the checkpoint"
    streamed = plan.streamed is not None and plan.streamed.fits is True
    if row is None and streamed and not any(r.fits for r in plan.rows):
        return (
            "no layout holding the whole step fits; streamed (`shard` streamed or auto) does, at full fidelity; "
            f"to hold it whole or sharded: {_more_nodes(plan)}"
        )
    if row is None:
        said = f"no layout fits here: no number of processes from 1 to {plan.world_size} is under the memory"
        return f"{said}; {_more_nodes(plan)}"
    how = "sharded over them (FSDP2)" if row.sharded else "each with the whole model"
    if row.nproc < plan.world_size:
        how += f", each replaying its {row.ranks_per_process} saved ranks in turn (full fidelity)"
    if cap is not None and cap.device == "cuda" and cap.devices:
        per_node = math.ceil(row.nproc / nodes)
        return f"{row.nproc} processes ({nodes} node(s) x {per_node}), {row.processes_per_device} per GPU, {how}" + (
            f": torchrun --nnodes {nodes} --nproc-per-node {per_node}" if nodes > 1 else ""
        )
    return f"{row.nproc} processes on {nodes} node(s), {how}"


def _more_nodes(plan: ReplayPlan) -> str:
    """What full fidelity needs beyond the capacity planned against: how many nodes like it, on GPUs."""
    cap = plan.capacity
    full = next((r for r in plan.rows if r.nproc == plan.world_size), None)
    if cap is None or cap.device != "cuda" or not cap.devices or full is None:
        return "replay on more nodes or GPUs (a multinode: or slurm: target), or use `--backend command`"
    per_gpu = cap.bytes_each // max(full.memory.step, 1)
    how = "sharded (FSDP2)" if full.sharded else "each with the whole model"
    if per_gpu < 1:
        return (
            f"one full-fidelity process ({_gib(full.memory.step)}, {how}) is over a GPU's {_gib(cap.bytes_each)}: "
            "no number of such GPUs holds it; use `--backend command` (the trainer's own model parallelism)"
        )
    gpus = math.ceil(plan.world_size / per_gpu)
    nodes = math.ceil(gpus / cap.devices)
    return (
        f"full fidelity needs {nodes} node(s) like {cap.where} ({plan.world_size} processes, {per_gpu} per GPU, "
        f"{how}): a multinode: or slurm: target"
    )


def check_fits(plan: ReplayPlan) -> None:
    """PlanRefused when the requested layout does not fit (unknown capacity passes: nothing to say)."""
    if plan.fits is False:
        raise PlanRefused(plan)
