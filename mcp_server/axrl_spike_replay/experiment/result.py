"""What a replay, a sweep and an attribution produce (`replay_result.json`, `sweep_result.json`,
`attribution.json`). Torch-free: the MCP server names these types in its tool schemas without loading the engine.
Field docstrings become the descriptions of the tools' output schemas (`__pydantic_config__`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from axrl_spike_replay.experiment.figure_names import ATTRIBUTION_SAMPLE, with_current_names
from axrl_spike_replay.experiment.verdict import VerdictBasis, basis_from_json
from axrl_spike_replay.snapshot.consistency import Consistency
from axrl_spike_replay.training.precision import PrecisionPolicy
from axrl_spike_replay.vocabulary import Backend, Fidelity, Verdict

ATTRIBUTION_FILE = "attribution.json"  # what `attribute` writes into its run dir

# Read by pydantic when a tool returns one of these: attribute docstrings become field descriptions.
_SCHEMA_CONFIG = {"use_attribute_docstrings": True}

# baseline: reproduced / not_reproduced; mitigated: cleared ... baseline_not_a_spike (experiment.verdict); failed.
VERDICTS = Verdict.values()


FOOTPRINT_COUNTS = ("loss_tokens", "masked_tokens", "changed_tokens", "samples", "masked_samples", "touched_samples")


@dataclass
class Footprint:
    """What a mitigated config changed besides the spike, summed over the saved ranks: loss tokens masked (off the
    mask) or changed (another per-token loss), samples masked whole or touched, and the fractions the method ranking
    uses (`token_fraction`: masked or changed; `sample_fraction`: touched). `replay.compute.outcome_figures`
    counts them."""

    loss_tokens: int
    masked_tokens: int
    changed_tokens: int
    samples: int
    masked_samples: int
    touched_samples: int
    token_fraction: float
    masked_token_fraction: float
    sample_fraction: float
    masked_sample_fraction: float

    @classmethod
    def of_counts(cls, counts: Mapping[str, Any]) -> Footprint:
        """The footprint of these counts (a count missing is 0), its fractions computed from them."""
        c = {k: int(counts.get(k) or 0) for k in FOOTPRINT_COUNTS}
        tokens, samples = c["loss_tokens"], c["samples"]
        return cls(
            **c,
            token_fraction=(c["masked_tokens"] + c["changed_tokens"]) / tokens if tokens else 0.0,
            masked_token_fraction=c["masked_tokens"] / tokens if tokens else 0.0,
            sample_fraction=c["touched_samples"] / samples if samples else 0.0,
            masked_sample_fraction=c["masked_samples"] / samples if samples else 0.0,
        )

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Footprint:
        """A footprint as a result file keeps it (a fraction it lacks, from a file written before it, is computed)."""
        computed = asdict(cls.of_counts(doc))
        kept = {k: doc[k] for k in computed if k not in FOOTPRINT_COUNTS and isinstance(doc.get(k), (int, float))}
        return cls(**{**computed, **kept})


SHOWN_SAMPLES = 8  # samples named in a clean gradient's description before "and N more"
# the clean gradient's keys in the order the engine writes them (`replay.compute.clean_probe.clean_gradient`)
CLEAN_KEYS = (
    "left_out", "wholly_left_out", "tokens_left_out", "loss_tokens", "token_share_left_out", "share_left_out",
    "reached", "reason", "bar", "grad_norm", "ratio_to_median", "baseline_cosine", "passes", "probe_norms",
    "recomputed", "definition",
)  # fmt: skip


def _as_file_keeps() -> Any:
    from pydantic_core import core_schema

    return core_schema.plain_serializer_function_ser_schema(lambda value: value.to_json())


class _FileSerializer:
    """`__pydantic_serializer__` of a record that pydantic would otherwise write field by field (a tool's text
    reply, `pydantic_core.to_json`): its `to_json`, built when first asked for."""

    serializer: Any = None

    def __get__(self, record: Any, owner: type) -> Any:
        if _FileSerializer.serializer is None:
            from pydantic_core import SchemaSerializer, core_schema

            _FileSerializer.serializer = SchemaSerializer(core_schema.any_schema(serialization=_as_file_keeps()))
        return _FileSerializer.serializer


@dataclass
class CleanGradient:
    """The clean gradient a replay measured (`replay.compute.clean_gradient` has the definition): the loss tokens
    and samples left out of the baseline gradient for it to be under the spike bar, whether it got there, its size,
    and its cosine with the baseline. A key a result file lacks (the baseline under the bar lists no probes; files
    written before the token definition name samples only) stays absent when written back, and a key of another
    version is kept as read (`extra`): the JSON is the file's, byte for byte."""

    left_out: list[str] = field(default_factory=list)  # samples "rank:index", the largest pull first
    wholly_left_out: list[str] | None = None  # those whose every loss token is left out
    tokens_left_out: int | None = None
    loss_tokens: int | None = None  # over every saved rank
    token_share_left_out: float | None = None  # tokens_left_out / loss_tokens
    share_left_out: float | None = None  # of the loss's pull on the log-probs
    reached: bool | None = None  # under the spike bar
    reason: str | None = None  # why not, when not reached
    bar: float | None = None  # the spike bar's grad norm (threshold x median)
    grad_norm: float | None = None
    ratio_to_median: float | None = None
    baseline_cosine: float | None = None  # cosine of the baseline gradient with this one
    passes: int | None = None  # forward + backward passes the search took
    probe_norms: dict[str, float] | None = None  # tokens left out -> grad norm, per probe
    recomputed: list[str] | None = None  # stored log-probs recomputed at the snapshot's weights (on-policy)
    definition: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys of another version, as read
    keys: tuple[str, ...] = ()  # the keys the document has, in its order (() : every field not None, in order)
    __pydantic_serializer__ = _FileSerializer()  # a tool's text reply writes it as the file keeps it

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CleanGradient:
        """The record of a result file's `clean_gradient` object (any version)."""
        known = {k: doc[k] for k in CLEAN_KEYS if k in doc}
        return cls(**known, extra={k: v for k, v in doc.items() if k not in CLEAN_KEYS}, keys=tuple(doc))

    def to_json(self) -> dict[str, Any]:
        """The `clean_gradient` object as the result file keeps it."""
        keys = self.keys or tuple(
            [k for k in CLEAN_KEYS if getattr(self, k) is not None or k == "left_out"] + list(self.extra)
        )
        return {k: getattr(self, k) if k in CLEAN_KEYS else self.extra[k] for k in keys}

    def describe(self) -> str:
        """The clean gradient in words, for method files and summaries (results written before the token
        definition: the samples they left out)."""
        samples = [str(s) for s in self.left_out or []]
        named = ", ".join(samples[:SHOWN_SAMPLES]) + (
            f" and {len(samples) - SHOWN_SAMPLES} more" if samples[SHOWN_SAMPLES:] else ""
        )
        if self.tokens_left_out is None:
            return f"the baseline without its top-attributed samples {named or 'none'}"
        tokens, total, recomputed = self.tokens_left_out, self.loss_tokens, [str(s) for s in self.recomputed or []]
        base = (
            f"the on-policy gradient (the stored {' and '.join(s.replace('_', ' ') for s in recomputed)} recomputed "
            "at the snapshot's weights)"
            if recomputed
            else "the baseline"
        )
        if not tokens:
            what = f"{base} itself (nothing left out)" if not recomputed else base
        else:
            share = self.token_share_left_out
            of = f" ({share:.1%} of {total})" if isinstance(share, float) and total else ""
            what = f"{base} without its {tokens} highest-pull loss tokens{of}, in samples {named}"
        norm, ratio = self.grad_norm, self.ratio_to_median
        size = f"grad norm {norm:.4g}" if isinstance(norm, (int, float)) else "no grad norm"
        if isinstance(ratio, (int, float)):
            size += f", {ratio:.3g}x the median"
        if self.reached:
            return f"{what}; {size}, under the spike bar"
        return f"{what}; {size}; not under the spike bar: {self.reason or 'no reason recorded'}"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """A tool's structured reply carries the object the result file keeps (`to_json`), and reads one back."""
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(
            lambda value: value if isinstance(value, cls) else cls.from_json(value),
            json_schema_input_schema=core_schema.dict_schema(),
            serialization=_as_file_keeps(),
        )


PARAM_NORM_KEYS = ("name", "grad_norm")


@dataclass
class ParamNorm:
    """One parameter's gradient norm, as a result's `top_params` lists them (the largest first): the engine's, the
    Megatron route's or the command backend's. A key of another version is kept as read (`extra`), in the document's
    order (`keys`): the JSON is the file's, byte for byte."""

    name: str
    grad_norm: float | None  # None: a non-finite norm, as JSON keeps it (null)
    extra: dict[str, Any] = field(default_factory=dict)  # keys of another version, as read
    keys: tuple[str, ...] = ()  # the keys the document has, in its order (() : name, grad_norm, then extra)
    __pydantic_serializer__ = _FileSerializer()  # a tool's text reply writes it as the file keeps it

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ParamNorm:
        """The record of one `top_params` entry (any version)."""
        extra = {k: v for k, v in doc.items() if k not in PARAM_NORM_KEYS}
        return cls(name=str(doc.get("name", "")), grad_norm=doc.get("grad_norm"), extra=extra, keys=tuple(doc))

    def to_json(self) -> dict[str, Any]:
        """The entry as the result file keeps it."""
        keys = self.keys or (*PARAM_NORM_KEYS, *self.extra)
        return {k: getattr(self, k) if k in PARAM_NORM_KEYS else self.extra[k] for k in keys}

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        """A tool's structured reply carries the object the result file keeps (`to_json`), and reads one back."""
        from pydantic_core import core_schema

        return core_schema.no_info_plain_validator_function(
            lambda value: value if isinstance(value, cls) else cls.from_json(value),
            json_schema_input_schema=core_schema.dict_schema(),
            serialization=_as_file_keeps(),
        )


def param_norms(entries: list[Any]) -> list[ParamNorm]:
    """`top_params` entries as records (a mapping as a result file or a worker gives it, or a record)."""
    return [entry if isinstance(entry, ParamNorm) else ParamNorm.from_json(entry) for entry in entries]


@dataclass
class ReplayResult:
    """One replay's outcome (baseline or mitigated). `verdict` is one of VERDICTS."""

    snapshot: str
    backend: Backend
    target: str  # "local" or the SSH target as given
    fidelity: Fidelity
    world_size_saved: int
    world_size_used: int
    mitigations: dict[str, Any]  # {} for the baseline
    grad_norm: float | None
    recorded_grad_norm: float | None  # None only when rebuilt from a task row that lost a non-finite value
    rel_diff: float | None  # |grad_norm - recorded| / recorded (baseline) ; for mitigated: vs recorded too
    median_norm: float | None  # as recorded_grad_norm
    spike_ratio: float | None  # grad_norm / median_norm
    verdict: Verdict
    threshold: float | None  # detector threshold the verdict compares against
    baseline_grad_norm: float | None = None  # for mitigated replays: the baseline at the same layout
    change_vs_baseline: float | None = None  # grad_norm / baseline_grad_norm - 1
    top_params: list[ParamNorm] = field(default_factory=list)  # the largest parameter grad norms, largest first
    timings: dict[str, float] = field(default_factory=dict)  # seconds: load, compute, total
    device: str = "cpu"
    job_name: str = ""
    role: str = ""
    iteration: int = -1
    config_id: str = "baseline"
    patch_sha256: str | None = None
    node: dict[str, Any] | None = None  # remote node facts (GPUs) when run over SSH
    error: str | None = None  # why, when verdict == "failed"
    created_at: str = ""
    tolerance: float | None = None  # rel_diff a baseline may show and still count as reproduced
    repeat_grad_norms: list[float] = field(default_factory=list)  # one per repeat (`--repeat N`)
    repeat_spread: float | None = None  # max - min of repeat_grad_norms (0.0: deterministic)
    # per saved rank: loss, loss_tokens, ..., max_abs_log_ratio_current_vs_<base>, kl_current_vs_ref (figure_names)
    rank_metrics: list[dict[str, Any]] = field(default_factory=list)
    legacy_layout: bool = False  # replayed through a temporary replay dir (legacy snapshot)
    output_dir: str = ""  # where this result's files were written ("" when none)
    # baseline: does the snapshot agree with itself, its replay (per-rank loss) and the training log? Typed here; its
    # JSON is the dataclass's. `verdict` says only whether the replay matched the recorded norm
    consistency: Consistency | None = None
    # mitigated replays: what the config changed besides the spike (replay.compute.outcome_figures has the definitions)
    footprint: Footprint | None = None  # loss tokens / samples masked or changed; token_fraction, sample_fraction
    cosine_to_clean: float | None = None  # cosine of this gradient with the clean gradient (in [-1, 1])
    # the clean gradient (replay.compute.clean_gradient): tokens and samples left out, reached (under the spike
    # bar), definition
    clean_gradient: CleanGradient | None = None
    # the numbers and rule the verdict was judged by (a shape of an earlier version: the JSON object as read)
    verdict_basis: VerdictBasis | dict[str, Any] | None = None
    # values the config names symbolically, as resolved against the snapshot's model (current_routing_layers:
    # first -> [1] on deepseek_v3); {} when every value was concrete, or for results written before
    resolved_mitigations: dict[str, Any] = field(default_factory=dict)
    # how the replay held the model: sharded with FSDP2 over its processes, or whole in each (None: not recorded)
    sharded: bool | None = None
    shard_reason: str = ""  # why: `shard` on/off as asked, or auto's reading of the replay plan
    # the precision that ran: param / reduce / output dtypes and their source (the snapshot's recorded policy, or
    # the model's own dtype when none was recorded); None for results written before it was recorded
    precision: PrecisionPolicy | None = None
    # a hypothesis replay (loss settings scoped to ranks, `experiment.mitigation.rank_scope`): the hypothesis in normal
    # form (`mitigations` is then {}: a hypothesis is no mitigation) and its finding, judged against the recording as a
    # baseline is: "reproduced under `aux_loss_coef=10.24@1`"
    hypothesis: dict[str, Any] = field(default_factory=dict)
    finding: str | None = None
    # the trainer release the snapshot was captured with, when the loss convention reproduces another one (a TRL
    # snapshot of a release other than the one checked); None when they are the same
    trainer_version_note: str | None = None
    # a rank's input that fails a check against the model (replay.reading.input_checks): rank, field, what fails and how
    # often, the healthy ranks as witnesses, the experiments that remove it; the baseline of a step whose input is
    # undefined for the model is refused (`error`) and the experiments are judged against the recorded step
    input_findings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Results are also rebuilt from files and task rows: the vocabulary fields always hold members.
        self.backend = Backend.parse(self.backend, "result backend")
        self.fidelity = Fidelity.parse(self.fidelity, "result fidelity")
        self.verdict = Verdict.parse(self.verdict, "result verdict")
        # the sub-records as a result file keeps them
        self.top_params = param_norms(self.top_params)
        if isinstance(self.consistency, dict):
            self.consistency = Consistency.from_json(self.consistency)
        if isinstance(self.footprint, dict):
            self.footprint = Footprint.from_json(self.footprint) if self.footprint else None
        if isinstance(self.verdict_basis, dict):
            self.verdict_basis = basis_from_json(self.verdict_basis)
        if isinstance(self.precision, dict):
            self.precision = PrecisionPolicy.from_result(self.precision)
        if isinstance(self.clean_gradient, dict):
            self.clean_gradient = CleanGradient.from_json(self.clean_gradient) if self.clean_gradient else None

    def to_json(self) -> dict[str, Any]:
        """The `replay_result.json` document (vocabulary members are their string values)."""
        doc = asdict(self)
        doc["top_params"] = [entry.to_json() for entry in self.top_params]
        doc["clean_gradient"] = self.clean_gradient.to_json() if self.clean_gradient is not None else None
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ReplayResult:
        """A result read back from its JSON document; AxrlError when a vocabulary field holds an unknown value."""
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in doc.items() if k in known})


@dataclass
class SweepResult:
    """A sweep: the baseline replay and one replay result per config, each judged against the baseline."""

    __pydantic_config__ = _SCHEMA_CONFIG

    snapshot: str
    """The snapshot replayed"""
    fidelity: Fidelity
    """full, or reduced (fewer processes than the saved world size: a diagnostic)"""
    world_size_saved: int
    """Ranks of the training run"""
    world_size_used: int
    """Replay processes"""
    device: str
    """cpu or cuda"""
    threshold: float
    """Spike threshold (ratio to the median) the verdicts compare against"""
    baseline: ReplayResult
    """The baseline replay (no mitigation)"""
    results: list[ReplayResult] = field(default_factory=list)
    """One result per config, in the order given"""
    output_dir: str = ""
    """tmp/spike-replay/<job>/<timestamp>/ holding every result"""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: load, total"""

    def __post_init__(self) -> None:
        self.fidelity = Fidelity.parse(self.fidelity, "sweep fidelity")  # also when read back from a file

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["baseline"] = self.baseline.to_json()
        doc["results"] = [r.to_json() for r in self.results]
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SweepResult:
        values = dict(doc)
        values["baseline"] = ReplayResult.from_json(doc["baseline"])
        values["results"] = [ReplayResult.from_json(r) for r in doc.get("results", [])]
        return cls(**{k: v for k, v in values.items() if k in cls.__dataclass_fields__})

    def cleared(self) -> list[ReplayResult]:
        """The configs whose verdict is `cleared`."""
        return [r for r in self.results if r.verdict == Verdict.CLEARED]


ROUTER_NOTE = (
    "router aux/z losses are batch-level (not per-sample): their share of the gradient is reported as "
    "router_term, so sum(contribution over all samples) + router_term = grad_norm"
)


@dataclass
class SampleContribution:
    """One sample's share of the spike and its signals."""

    __pydantic_config__ = _SCHEMA_CONFIG

    rank: int
    """Saved data-parallel rank"""
    sample: int
    """Sample index in that rank's batch"""
    contribution: float
    """<g_s, g> / ||g||: this sample's part of the global grad norm"""
    share: float
    """contribution / grad_norm"""
    advantage: float
    """The sample's advantage"""
    reward: float | None
    """The sample's reward"""
    max_abs_log_ratio_current_vs_base: float
    """Largest |log(pi / pi_base)| on its loss tokens: the replayed current policy against the attribution's
    `log_ratio_base` (old or rollout log-probs), not the batch analysis's max_abs_log_ratio_old_vs_rollout (stored old
    against stored rollout). Files written before it was named so call it `max_abs_log_ratio`"""
    loss_tokens: int
    """Tokens of it in the loss"""
    group: int | None = None
    """Prompt group"""

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SampleContribution:
        """A sample row of `attribution.json`, also one written under the old figure names."""
        row = with_current_names(doc, ATTRIBUTION_SAMPLE)
        return cls(**{k: row[k] for k in cls.__dataclass_fields__ if k in row})


@dataclass
class Attribution:
    """Each sample's contribution to the spike's gradient, top K ranked."""

    __pydantic_config__ = _SCHEMA_CONFIG

    snapshot: str
    """The snapshot"""
    grad_norm: float
    """Replayed global grad norm"""
    recorded_grad_norm: float
    """Grad norm the trainer recorded"""
    rel_diff: float | None
    """|grad_norm - recorded| / recorded"""
    fidelity: Fidelity
    """full: every saved rank's batch replayed and reduced over the saved world size, as the trainer did (in one
    process, so float summation order may differ from training's by about 1e-6)"""
    world_size_saved: int
    """Ranks of the training run"""
    total_samples: int
    """Samples across all ranks"""
    samples: list[SampleContribution]
    """The top samples by contribution"""
    router_term: float
    """Batch-level router losses' part of the norm (not per sample)"""
    contribution_sum: float
    """Sum over all samples plus router_term (equals grad_norm)"""
    sum_rel_error: float
    """|contribution_sum - grad_norm| / grad_norm"""
    method: str = "jvp"
    """How contributions were computed"""
    log_ratio_base: str = "old"
    """The log-probs the samples' max_abs_log_ratio_current_vs_base is taken against: old or rollout (the loss's
    ratio base)"""
    mitigations: dict[str, Any] = field(default_factory=dict)
    """Mitigations applied before attributing"""
    resolved_mitigations: dict[str, Any] = field(default_factory=dict)
    """Values named symbolically, as resolved against the snapshot's model (current_routing_layers: first -> [1])"""
    note: str = ROUTER_NOTE
    """How to read router_term"""
    device: str = "cpu"
    """Where it was computed (cpu or cuda): how closely its grad_norm can match the recorded one"""
    sharded: bool = False
    """The policy was sharded with FSDP2 over world_size_used processes (each sample's gradient by a backward)"""
    world_size_used: int = 1
    """Processes that computed it"""
    passes: str = ""
    """Streamed: its passes over the checkpoint and per sample (empty: not streamed)"""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds"""
    output_dir: str = ""
    """Where attribution.json was written"""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Attribution:
        """An `attribution.json` document, also one written under the old figure names."""
        samples = [SampleContribution.from_json(s) for s in doc["samples"]]
        return cls(samples=samples, **{k: doc[k] for k in cls.__dataclass_fields__ if k in doc and k != "samples"})


RunResult = ReplayResult | SweepResult | Attribution  # what a request gives, by its verb: replay, sweep, attribute
