"""Every rank's inputs held to the model, as findings: a corrupt input is reported, never a reason to stop.

A rank's routing payload, tokens, stored log-probs or loss mask can fail a check against the model (its expert
count, top-k, vocabulary, the batch's own shapes). Each failure is an `InputFinding`: the rank, the field, what
fails and how often (which ids, duplicates per token, the range against the other ranks), the healthy ranks as
witnesses, and the experiments that remove the bad part (recompute that rank's routes or stored log-probs from the
snapshot's weights, drop the rank).

Two kinds, by whether the trainer's computation was defined on the input:

- `defined`: the trainer computed with it, so the replay reproduces it as recorded (forced routes listing one
  expert twice in a token's top-k count that expert twice; a positive stored log-prob enters the ratio as it is);
- not `defined`: no computation exists (an expert id past the model's experts, a token id past its vocabulary,
  a payload whose shape does not fit the batch): the computations that would use it are refused with the finding,
  and the experiments that remove the bad part still run.

`input_findings` reads the values (the routes and the few [B, T] tensors, never the weights): `inspect` runs it
against the run config's model without loading a weight, and `replay` before its first process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.models.hf_config import HFModelConfig
from axrl_spike_replay.models.mcore.megatron_config import MegatronModelConfig
from axrl_spike_replay.models.policy import ModelSpec, RoutingShape, routing_shape
from axrl_spike_replay.replay.reading.route_check import check_route_shapes
from axrl_spike_replay.snapshot.rank_data import RoutingPayload, load_rank_batch, load_rank_routes

if TYPE_CHECKING:
    import torch

    from axrl_spike_replay.snapshot.inspect import SnapshotInspection

LOGPROB_FIELDS = ("old_logprobs", "rollout_logprobs", "ref_logprobs")
POSITIVE_SLACK = 1e-3  # a log-prob above this is no log-prob (rounding of a sure token stays far below it)


@dataclass
class InputFinding:
    """One rank's input that fails a check against the model."""

    rank: int
    field: str  # routed_experts, tokens, loss_mask, old_logprobs, ...
    check: str  # duplicate_experts, expert_id_range, route_shape, token_id_range, positive_logprob, ...
    defined: bool  # the trainer's computation is defined on it: replayed as recorded
    count: int  # entries that fail
    total: int  # entries checked
    detail: str  # what fails: which ids, how often per token, where
    witnesses: str = ""  # the other ranks' figures for the same check
    experiments: list[str] = dataclass_field(default_factory=list)  # mitigation items that remove the bad part
    file: str = ""

    @property
    def message(self) -> str:
        """One line: rank, field, what fails and how often, the witnesses, the experiments."""
        return self.describe()

    def describe(self, experiments: bool = True) -> str:
        """The finding in one line (`experiments`: with the experiments that remove the bad part)."""
        share = f" ({self.count} of {self.total})" if self.total else ""
        how = (
            "replayed as recorded (the trainer's computation is defined on it)"
            if self.defined
            else "no computation is defined on it: what would use it is refused"
        )
        where = f" ({self.file})" if self.file else ""
        text = f"rank {self.rank} {self.field}{where}: {self.detail}{share}; {how}"
        if self.witnesses:
            text += f"; {self.witnesses}"
        if experiments and self.experiments:
            text += f"; experiments that remove it: {', '.join(self.experiments)}"
        return text


def input_findings(directory: str | Path, spec: ModelSpec, world_size: int) -> list[InputFinding]:
    """Every saved rank's routes and batch held to `spec` (values read; no weights): the findings, worst first
    (undefined before defined, then by how often). A file that does not read is not a finding here: the readers
    refuse it with its own error."""
    shape = routing_shape(spec)
    vocab = _vocab(spec)
    findings: list[InputFinding] = []
    route_stats: dict[int, _RouteStats] = {}
    for rank in range(world_size):
        batch = load_rank_batch(directory, rank)
        findings += _batch_findings(batch, rank, vocab)
        payload = load_rank_routes(directory, rank, batch=batch)
        if payload is None:
            continue
        try:
            check_route_shapes(payload, shape, tuple(batch["tokens"].shape))
        except SnapshotError as exc:
            findings.append(_shape_finding(rank, payload, str(exc)))
            continue
        stats = _route_stats(payload.routed_experts, shape)
        route_stats[rank] = stats
        findings += _route_findings(rank, payload, stats, shape)
    _add_witnesses(findings, route_stats, world_size)
    return sorted(findings, key=lambda f: (f.defined, -f.count, f.rank))


def refusal(findings: list[InputFinding], rank: int, what: str) -> str | None:
    """Why `what` (a computation replaying rank `rank`'s input) is refused: its undefined findings, with the
    experiments that remove the bad part; None when it is defined."""
    bad = [f for f in findings if f.rank == rank and not f.defined]
    if not bad:
        return None
    offers = sorted({e for f in bad for e in f.experiments})
    return (
        f"{what} is refused: "
        + "; ".join(f.describe(experiments=False) for f in bad)
        + (f". Run instead: {', '.join(offers)}" if offers else "")
    )


def blank_tokens(batch: dict[str, Any], spec: ModelSpec) -> bool:
    """Token ids of `batch` outside the model's vocabulary set to 0, in place; whether any was. Only for a rank that
    every config of a job leaves out: its forward runs to keep the passes in step, and nothing of it reaches the
    step, so the ids no computation is defined on never meet the embedding."""
    import torch

    vocab = _vocab(spec)
    tokens = batch.get("tokens")
    if vocab is None or not isinstance(tokens, torch.Tensor) or not tokens.numel():
        return False
    bad = (tokens < 0) | (tokens >= vocab)
    if not bool(bad.any()):
        return False
    batch["tokens"] = tokens.masked_fill(bad, 0)
    return True


def _vocab(spec: ModelSpec) -> int | None:
    model = spec.hf if isinstance(spec, MegatronModelConfig) else spec
    value = model.config.get("vocab_size") if isinstance(model, HFModelConfig) else getattr(model, "vocab_size", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass
class _RouteStats:
    low: int  # smallest expert id (-1 for none)
    high: int
    out_of_range: list[int]  # the distinct bad ids
    bad_entries: int
    bad_slots: list[int]
    duplicated_tokens: int  # tokens (per layer slot) that list one expert more than once
    most_per_token: int  # the most times one expert is listed for one token
    duplicated_experts: list[int]  # the experts listed twice, most often first
    tokens: int  # tokens x layer slots checked


def _route_stats(routes: torch.Tensor, shape: RoutingShape) -> _RouteStats:
    """The payload's id range, ids past the model, and repeats within a token's top-k; one layer slot at a time
    (a sort of [B, T, K], never of the whole payload)."""
    import torch

    if routes.numel() == 0:
        return _RouteStats(-1, -1, [], 0, [], 0, 0, [], 0)
    low, high = (int(v) for v in torch.aminmax(routes))
    out: set[int] = set()
    slots: list[int] = []
    bad_entries = tokens = most = 0
    repeats: dict[int, int] = {}
    for slot in range(routes.shape[2]):
        layer = routes[:, :, slot, :]
        bad = (layer < -1) | (layer >= shape.n_experts)
        if bool(bad.any()):
            slots.append(slot)
            bad_entries += int(bad.sum())
            out |= {int(v) for v in layer[bad].unique()[:64]}
        ordered = layer.sort(dim=-1).values
        same = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)  # [B, T, K-1]
        if not bool(same.any()):
            continue
        tokens += int(same.any(dim=-1).sum())
        values, counts = ordered[..., 1:][same].unique(return_counts=True)
        for v, n in zip(values.tolist(), counts.tolist(), strict=True):
            repeats[int(v)] = repeats.get(int(v), 0) + int(n)
        listed = torch.stack(
            [(ordered == ordered[..., k, None]).sum(dim=-1) * (ordered[..., k] >= 0) for k in range(ordered.shape[-1])]
        )
        most = max(most, int(listed.max()))  # the most times one expert is listed for one token
    experts = [v for v, _ in sorted(repeats.items(), key=lambda kv: -kv[1])]
    return _RouteStats(low, high, sorted(out), bad_entries, slots, tokens, most, experts, int(routes[..., 0].numel()))


def _route_experiments(rank: int) -> list[str]:
    # the stored old log-probs were taken under the recorded routes: recomputed with them (recompute's own advice)
    return [f"recompute=routes:rank{rank},old_logprobs:rank{rank}", f"drop_ranks={rank}"]


def _route_findings(rank: int, payload: RoutingPayload, stats: _RouteStats, shape: RoutingShape) -> list[InputFinding]:
    found = []
    where = str(payload.file or "")
    if stats.out_of_range:
        found.append(
            InputFinding(
                rank, "routed_experts", "expert_id_range", False, stats.bad_entries,
                int(payload.routed_experts.numel()),
                f"expert ids {shown(stats.out_of_range, 80)} in layer slots {shown(stats.bad_slots, 60)}; the model "
                f"has {shape.n_experts} experts per layer (ids 0-{shape.n_experts - 1}, -1 for none)",
                experiments=_route_experiments(rank), file=where,
            )
        )  # fmt: skip
    if stats.duplicated_tokens:
        found.append(
            InputFinding(
                rank, "routed_experts", "duplicate_experts", True, stats.duplicated_tokens, stats.tokens,
                f"token routes (one per token and MoE layer) list one expert more than once in a top-{shape.top_k} "
                f"(up to {stats.most_per_token} times per token; experts {shown(stats.duplicated_experts[:8], 60)})",
                experiments=_route_experiments(rank), file=where,
            )
        )  # fmt: skip
    return found


def _shape_finding(rank: int, payload: RoutingPayload, message: str) -> InputFinding:
    detail = message.split(": ", 1)[1] if ": " in message else message
    return InputFinding(
        rank, "routed_experts", "route_shape", False, 1, 1, detail,
        experiments=_route_experiments(rank), file=str(payload.file or ""),
    )  # fmt: skip


def _add_witnesses(findings: list[InputFinding], stats: dict[int, _RouteStats], world_size: int) -> None:
    """Each finding's witnesses: the other ranks' figures for the same check (the healthy ones first)."""
    for finding in findings:
        others = [r for r in range(world_size) if r != finding.rank]
        if finding.field != "routed_experts" or not others:
            continue
        healthy = [r for r in others if r in stats and not stats[r].out_of_range and not stats[r].duplicated_tokens]
        if finding.check == "duplicate_experts":
            counts = {r: stats[r].duplicated_tokens for r in others if r in stats}
            finding.witnesses = "tokens with a repeated expert on the other ranks: " + ", ".join(
                f"rank {r}: {n}" for r, n in counts.items()
            )
        else:
            ranges = [f"rank {r}: {stats[r].low}-{stats[r].high}" for r in others if r in stats]
            finding.witnesses = "expert ids on the other ranks: " + (", ".join(ranges) or "no routes")
        if healthy:
            finding.witnesses += f" (healthy: ranks {', '.join(map(str, healthy))})"


def _batch_findings(batch: dict[str, Any], rank: int, vocab: int | None) -> list[InputFinding]:
    import torch

    found = []
    tokens = batch["tokens"]
    drop = [f"drop_ranks={rank}"]  # leaving the rank out removes its bad part, whichever field holds it
    if vocab is not None and tokens.numel():
        bad = (tokens < 0) | (tokens >= vocab)
        if bool(bad.any()):
            ids = sorted({int(v) for v in tokens[bad].unique()[:16]})
            found.append(
                InputFinding(
                    rank, "tokens", "token_id_range", False, int(bad.sum()), int(tokens.numel()),
                    f"token ids {shown(ids, 80)} outside the model's vocabulary of {vocab}",
                    experiments=drop,  # a left-out rank's tokens reach nothing (`blank_tokens`)
                )
            )  # fmt: skip
    mask = batch.get("loss_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == tokens.shape and mask.numel():
        odd = (mask != 0) & (mask != 1)
        if bool(odd.any()):
            values = sorted({float(v) for v in mask[odd].unique()[:8]})
            found.append(
                InputFinding(
                    rank, "loss_mask", "mask_values", True, int(odd.sum()), int(mask.numel()),
                    f"loss-mask values {shown(values, 60)} that are neither 0 nor 1 (the loss weighs those tokens by "
                    "them)", experiments=drop,
                )
            )  # fmt: skip
    for name in LOGPROB_FIELDS:
        found += _logprob_findings(batch, name, rank)
    return found


def _logprob_findings(batch: dict[str, Any], name: str, rank: int) -> list[InputFinding]:
    import torch

    values = batch.get(name)
    if not isinstance(values, torch.Tensor) or not values.is_floating_point() or values.numel() == 0:
        return []
    values = values.float()
    experiments = ([f"recompute={name}:rank{rank}"] if name != "ref_logprobs" else []) + [f"drop_ranks={rank}"]
    found = []
    positive = values > POSITIVE_SLACK
    if bool(positive.any()):
        found.append(
            InputFinding(
                rank, name, "positive_logprob", True, int(positive.sum()), int(values.numel()),
                f"log-probs above 0 (up to {float(values[positive].max()):.4g}): no probability gives them",
                experiments=experiments,
            )
        )  # fmt: skip
    nan = torch.isnan(values)
    if bool(nan.any()):
        found.append(
            InputFinding(
                rank, name, "nan_logprob", True, int(nan.sum()), int(values.numel()),
                "NaN log-probs (the loss carries them as the trainer's did)", experiments=experiments,
            )
        )  # fmt: skip
    return found


def inspect_with_inputs(path: str | Path) -> SnapshotInspection:
    """`inspect_snapshot`, plus every rank's inputs held to the run config's model (`input_findings`: widths,
    expert count, top-k, vocabulary, read from the config; no weight is loaded). Each failure is listed among the
    problems and, whole, under `input_findings`; a model section that does not parse is a problem too."""
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.models.policy import parse_model_config
    from axrl_spike_replay.snapshot.inspect import inspect_snapshot
    from axrl_spike_replay.snapshot.layout import RUN_CONFIG
    from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml

    seen = inspect_snapshot(path)
    directory = Path(seen.path)
    try:
        doc = read_untrusted_yaml(directory / RUN_CONFIG, "run config", within=directory)
        section = doc.get("model") if isinstance(doc, dict) else None
        if not isinstance(section, dict):
            return seen  # the run config's own problem is listed already
        spec = parse_model_config(dict(section))
        findings = input_findings(directory, spec, seen.dp)
    except AxrlError as exc:
        if "run config" in str(exc) or "model" in str(exc):
            seen.problems.append(f"input checks against the run config's model not run: {exc}")
        return seen  # a rank file that does not read is listed already, by its own error
    except (TypeError, ValueError) as exc:
        seen.problems.append(f"{directory / RUN_CONFIG}: model: invalid value ({shown(str(exc), 160, quote=False)})")
        return seen
    seen.input_findings = [f.message for f in findings]
    seen.problems += [f"[input] {f.message}" for f in findings]
    return seen
