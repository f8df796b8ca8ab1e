"""Replay-only masks that leave whole samples out of the loss: outlier advantages and named samples.

Both act on a rank batch's `loss_mask` before the policy loss sees it, so a masked sample's tokens
leave the loss and its denominator exactly as if the trainer had masked them (the loss module is
untouched).

`advantage_outlier_mask` flags a sample when its advantage (the mean over its loss tokens) is an
outlier: |A - median| / scale > threshold, over the samples with loss tokens in its scope: the saved rank's
whole batch (`scope: batch`, the default) or its prompt group (`scope: group`, from the batch's `group_index`;
without one the batch is the group). `outlier_z` computes it, for this mask and for `diagnose` alike:

- the median is the true one (the mean of the two middle values; `torch.median` takes the lower one, which in a
  two-valued GRPO group is one of the two values itself, so every sample of the other value looked far out);
- deviations within float noise of the batch's magnitude (NOISE times its RMS, at least NOISE) count as 0: two
  advantages that differ by 2.8e-5 are a tie, not a spread of 2.8e-5;
- scale = max(1.4826 * MAD, the spread of the other groups): 1.4826 * MAD estimates the standard deviation of
  normal data, so the threshold reads in standard deviations. Group-normalised GRPO advantages are discrete (a
  group of n with one correct answer has one value of about sqrt(n - 1) and n - 1 equal ones), so their MAD
  collapses to 0 or to the gap between two such values; with the batch's `group_index` the floor is the median,
  over the batch's other prompt groups with a spread, of each group's RMS about its own mean: what an ordinary
  advantage of this batch looks like (about 1 after group normalisation; a median, so a few broken groups do
  not raise it). With a `group_index`, only a value further out than group normalisation can put one (sqrt(n)
  from its group's mean, for a group of n) is judged at all: a lone correct answer in one group of ten beside four
  tied groups had z 6.7 against the batch's spread, diluted by the tied groups, and one beside a group of
  near-tied rewards (its std under the normaliser's epsilon, its spread 0.05) had z 10; a sample scaled by a
  broken reward is far beyond sqrt(n). Without a `group_index`
  the data is taken as continuous and the MAD alone is the scale;
- no spread left (the scale within noise) or fewer than 3 samples in the scope: nothing is flagged (there is
  nothing to judge by; the old mean-absolute-deviation fallback gave a lone correct answer a z of 8-17).

`drop_samples` leaves the named `rank:sample` pairs out, `drop_ranks` every sample of the named saved ranks and
`keep_ranks` every sample of the others (the DP mean still divides by the saved world size, as when those ranks'
samples are masked in training): diagnostics (is the spike those samples, that rank?), never production methods.
The clean gradient (`replay.compute.clean_gradient`) leaves single loss tokens (or whole ranks) out the same way
(`TokenDrop`); no mitigation does.

Masking changes which columns hold loss tokens, never the response width verl's
`seq-mean-token-sum-norm` divides by: the batch's horizon is pinned (`response_width`) before the mask is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError

if TYPE_CHECKING:  # torch-free at import: the mitigation registry (and the server) read SampleFilter
    import torch

MAD_SCALE = 1.4826  # 1 / Phi^-1(3/4): MAD * this estimates the standard deviation of normal data
NOISE = 1e-4  # deviations below this times the batch's RMS advantage (at least 1) are float noise: a tie
FAR = 50.0  # a robust z above this leaves the value out of the spread the others are judged by
MIN_SCOPE = 3  # fewer samples than this in a scope: no robust statistic, nothing flagged
SCOPES = ("batch", "group")


class TokenDrop:
    """Loss tokens left out per saved rank: a [B, T] bool mask each, True for a token out of the loss.

    Compared and hashed by identity: it holds tensors, and two drops are the same only when they are one."""

    __slots__ = ("masks",)

    def __init__(self, masks: Mapping[int, torch.Tensor]) -> None:
        self.masks = dict(masks)

    def of(self, rank: int) -> torch.Tensor | None:
        return self.masks.get(rank)


@dataclass(frozen=True)
class SampleFilter:
    """Which samples (or, for the clean gradient, loss tokens) a replay config leaves out of the loss (nothing,
    by default)."""

    outlier_threshold: float | None = None  # advantage_outlier_mask: robust z-score above which a sample is masked
    outlier_scope: str = "batch"  # batch | group
    drop: frozenset[tuple[int, int]] = frozenset()  # drop_samples: (saved rank, sample index)
    tokens: TokenDrop | None = None  # single loss tokens left out (the clean gradient's)
    drop_ranks: frozenset[int] = frozenset()  # drop_ranks: every sample of these saved ranks
    keep_ranks: frozenset[int] | None = None  # keep_ranks: every sample of the other saved ranks is left out

    @property
    def drops_samples(self) -> bool:
        return self.outlier_threshold is not None or bool(self.drop) or self.drops_ranks

    @property
    def drops_ranks(self) -> bool:
        return bool(self.drop_ranks) or self.keep_ranks is not None

    def keeps_rank(self, rank: int) -> bool:
        return rank not in self.drop_ranks and (self.keep_ranks is None or rank in self.keep_ranks)

    @property
    def active(self) -> bool:
        return self.drops_samples or self.tokens is not None


def sample_advantages(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sample advantage [B] as the mean over its loss tokens, has-loss-tokens [B] bool)."""
    mask = batch["loss_mask"].float()
    adv = batch["advantages"].float()
    tokens = mask.sum(dim=-1)
    if adv.dim() == 1:
        return adv, tokens > 0
    per_sample = (adv * mask).sum(dim=-1) / tokens.clamp(min=1.0)
    return per_sample, tokens > 0


def _rms(values: Sequence[float]) -> float:
    return math.sqrt(math.fsum(v * v for v in values) / len(values)) if values else 0.0


def _spread(values: Sequence[float]) -> float:
    """The RMS of `values` about their mean."""
    mean = math.fsum(values) / len(values)
    return _rms([v - mean for v in values])


def outlier_z(values: Sequence[float], groups: Sequence[Hashable] | None = None, scope: str = "batch") -> list[float]:
    """Each value's outlier score |v - median| / scale in its scope (see the module doc); 0 where there is no
    spread to judge by. `groups`: each value's prompt group (None: no group structure known); `scope`: batch or
    group (with `groups`)."""
    n = len(values)
    if groups is not None and len(groups) != n:
        raise ValueError(f"{len(groups)} group ids for {n} values")
    tol = NOISE * max(_rms(values), 1.0)
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(groups if groups is not None else [0] * n):
        members.setdefault(key, []).append(i)
    spreads = {key: _spread([values[i] for i in index]) for key, index in members.items() if len(index) >= 2}
    spreads = {key: s for key, s in spreads.items() if s > tol}
    means = {key: math.fsum(values[i] for i in index) / len(index) for key, index in members.items()}
    scopes = members if scope == "group" and groups is not None else {0: list(range(n))}
    z = [0.0] * n
    for index in scopes.values():
        if len(index) < MIN_SCOPE:
            continue
        center = statistics.median(values[i] for i in index)
        deviation = {i: abs(values[i] - center) for i in index}
        deviation = {i: (d if d > tol else 0.0) for i, d in deviation.items()}
        mad = MAD_SCALE * statistics.median(deviation.values())
        for i in index:
            floor = 0.0
            if groups is not None:
                if abs(values[i] - means[groups[i]]) <= math.sqrt(len(members[groups[i]])):
                    # within what group normalisation gives a group of n (at most sqrt(n) from its mean): an
                    # ordinary advantage whatever the other groups' spread (a group of near-tied rewards, its std
                    # below the normaliser's epsilon, has a spread far under 1 and made a lone right answer
                    # elsewhere look far out)
                    continue
                others = [s for key, s in spreads.items() if key != groups[i]]
                if others:
                    floor = statistics.median(others)
            scale = max(mad, floor)
            z[i] = deviation[i] / scale if scale > tol and scale > 0 else 0.0
    return z


def outlier_samples(batch: Mapping[str, torch.Tensor], threshold: float, scope: str = "batch") -> torch.Tensor:
    """[B] bool: samples whose advantage is an outlier (`outlier_z` > threshold) in their scope."""
    import torch

    adv, has_tokens = sample_advantages(batch)
    flagged = torch.zeros(adv.shape[0], dtype=torch.bool, device=adv.device)
    index = [i for i in range(adv.shape[0]) if bool(has_tokens[i])]
    if not index:
        return flagged
    values = adv.double().cpu()[index].tolist()
    groups = batch.get("group_index")
    keys = None
    if groups is not None and groups.numel() == adv.shape[0]:
        every = groups.reshape(-1).tolist()
        keys = [every[i] for i in index]
    z = outlier_z(values, keys, scope)
    for i, score in zip(index, z, strict=True):
        flagged[i] = score > threshold
    return flagged


def kept_samples(batch: Mapping[str, torch.Tensor], rank: int, samples: SampleFilter) -> torch.Tensor | None:
    """[B] float, 1 for a sample the filter keeps and 0 for one it leaves out; None when it keeps all."""
    import torch

    if not samples.drops_samples:
        return None
    n = batch["loss_mask"].shape[0]
    drop = torch.zeros(n, dtype=torch.bool, device=batch["loss_mask"].device)
    if not samples.keeps_rank(rank):
        return torch.zeros(n, device=drop.device)
    for r, s in samples.drop:
        if r == rank:
            if s >= n:
                raise ConfigError(f"drop_samples: rank {r} has {n} samples; there is no sample {s}", "mitigations")
            drop[s] = True
    if samples.outlier_threshold is not None:
        drop |= outlier_samples(batch, samples.outlier_threshold, samples.outlier_scope)
    return (~drop).float()


def filtered_batch(batch: dict[str, torch.Tensor], rank: int, samples: SampleFilter) -> dict[str, torch.Tensor]:
    """The batch with the filtered-out samples' (and tokens') loss tokens masked (the batch itself when nothing
    is), its response horizon pinned to the unmasked batch's."""
    import torch

    from axrl_spike_replay.training.verl_convention import response_horizon

    keep = kept_samples(batch, rank, samples)
    dropped = samples.tokens.of(rank) if samples.tokens is not None else None
    if keep is None and dropped is None:
        return batch
    mask = batch["loss_mask"].float()
    width = torch.tensor(response_horizon(mask > 0, batch))  # before masking: a masked first column must not move it
    if keep is not None:
        mask = mask * keep[:, None]
    if dropped is not None:
        mask = mask * (~dropped).float()
    return {**batch, "loss_mask": mask, "response_width": width}


def parse_pairs(name: str, raw: Any) -> list[str]:
    """`rank:sample` pairs from `0:3,1:2`, a list of such strings or of [rank, sample]; sorted `r:s` strings."""
    items: Iterable[Any]
    if isinstance(raw, str):
        items = [part for part in raw.replace(";", ",").split(",") if part.strip()]
    elif isinstance(raw, (list, tuple)):
        items = raw
    else:
        raise ConfigError(f"mitigation {name}: expected rank:sample pairs such as 0:3,1:2, got {shown(raw)}")
    pairs: set[tuple[int, int]] = set()
    for item in items:
        parts = item if isinstance(item, (list, tuple)) else str(item).strip().split(":")
        try:
            rank, sample = (int(str(p).strip()) for p in parts) if len(parts) == 2 else (-1, -1)
        except ValueError:
            rank, sample = -1, -1
        if rank < 0 or sample < 0 or isinstance(item, bool):
            raise ConfigError(f"mitigation {name}: {shown(item)} is not a rank:sample pair of integers >= 0")
        pairs.add((rank, sample))
    if not pairs:
        raise ConfigError(f"mitigation {name}: name at least one rank:sample pair")
    return [f"{r}:{s}" for r, s in sorted(pairs)]


def pairs_of(value: Iterable[str]) -> frozenset[tuple[int, int]]:
    """The (rank, sample) pairs of a normal-form `drop_samples` value."""
    return frozenset((int(r), int(s)) for r, s in (str(v).split(":") for v in value))


def check_ranks(samples: SampleFilter, world_size: int) -> None:
    """ConfigError when `drop_samples`, `drop_ranks` or `keep_ranks` names a rank the snapshot does not have, or
    the ranks named leave no rank in the loss."""
    for name, ranks in (
        ("drop_samples", {r for r, _ in samples.drop}),
        ("drop_ranks", set(samples.drop_ranks)),
        ("keep_ranks", set(samples.keep_ranks or ())),
    ):
        bad = sorted(r for r in ranks if r >= world_size)
        if bad:
            raise ConfigError(
                f"{name}: rank {bad[0]} is not in the snapshot (saved ranks 0..{world_size - 1})", "mitigations"
            )
    if samples.drops_ranks and not any(samples.keeps_rank(r) for r in range(world_size)):
        raise ConfigError("drop_ranks / keep_ranks leave no saved rank in the loss", "mitigations")


def parse_ranks(name: str, raw: Any) -> list[int]:
    """Saved DP ranks from `1`, `0,2`, `rank1` or a list; a sorted list of distinct integers >= 0."""
    if isinstance(raw, bool):
        raise ConfigError(f"mitigation {name}: expected rank ids such as 1 or 0,2, got {shown(raw)}")
    items: Iterable[Any]
    if isinstance(raw, int):
        items = [raw]
    elif isinstance(raw, str):
        items = [part for part in raw.replace(";", ",").strip("[] ").split(",") if part.strip()]
    elif isinstance(raw, (list, tuple)):
        items = raw
    else:
        raise ConfigError(f"mitigation {name}: expected rank ids such as 1 or 0,2, got {shown(raw)}")
    ranks = set()
    for item in items:
        text = str(item).strip().lower().removeprefix("rank")
        if isinstance(item, bool) or not text.isdigit():
            raise ConfigError(f"mitigation {name}: {shown(item)} is not a rank id (an integer >= 0)")
        ranks.add(int(text))
    if not ranks:
        raise ConfigError(f"mitigation {name}: name at least one rank")
    return sorted(ranks)
