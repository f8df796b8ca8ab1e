"""Replay-only masks that leave whole samples out of the loss: outlier advantages and named samples.

Both act on a rank batch's `loss_mask` before the policy loss sees it, so a masked sample's tokens
leave the loss and its denominator exactly as if the trainer had masked them (the loss module is
untouched).

`advantage_outlier_mask` flags a sample when its advantage (the mean over its loss tokens) is an
outlier by a robust z-score: |A - median| / (1.4826 * MAD) > threshold, where median and MAD (the
median absolute deviation from the median) are taken over the samples with loss tokens in its scope:
the saved rank's whole batch (`scope: batch`, the default) or its prompt group (`scope: group`, from
the batch's `group_index`; without one the batch is the group). 1.4826 * MAD estimates the standard
deviation of normal data, so the threshold reads in standard deviations. When MAD is 0 (half the
scope shares one advantage) the mean absolute deviation * 1.2533 stands in; when that is 0 too no
sample is an outlier. A scope of fewer than 3 samples never flags one.

`drop_samples` leaves the named `rank:sample` pairs out: a diagnostic (is the spike those samples?),
never a production method. The clean gradient (`replay.clean_gradient`) leaves single loss tokens out the
same way (`TokenDrop`); no mitigation does.

Masking changes which columns hold loss tokens, never the response width verl's
`seq-mean-token-sum-norm` divides by: the batch's horizon is pinned (`response_width`) before the mask is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import ConfigError

if TYPE_CHECKING:  # torch-free at import: the mitigation registry (and the server) read SampleFilter
    import torch

MAD_SCALE = 1.4826  # 1 / Phi^-1(3/4): MAD * this estimates the standard deviation of normal data
MEAN_AD_SCALE = 1.2533  # sqrt(pi / 2): the same for the mean absolute deviation (used when MAD is 0)
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

    @property
    def drops_samples(self) -> bool:
        return self.outlier_threshold is not None or bool(self.drop)

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


def robust_z(values: torch.Tensor) -> torch.Tensor:
    """|v - median| / (1.4826 MAD) for each value (MAD 0: mean absolute deviation * 1.2533; both 0: zeros)."""
    import torch

    values = values.double()
    if values.numel() < MIN_SCOPE:
        return torch.zeros_like(values)
    deviation = (values - values.median()).abs()
    scale = MAD_SCALE * float(deviation.median())
    if scale == 0.0:
        scale = MEAN_AD_SCALE * float(deviation.mean())
    if scale == 0.0:
        return torch.zeros_like(values)
    return deviation / scale


def outlier_samples(batch: Mapping[str, torch.Tensor], threshold: float, scope: str = "batch") -> torch.Tensor:
    """[B] bool: samples whose advantage is a robust outlier (z > threshold) in their scope."""
    import torch

    adv, has_tokens = sample_advantages(batch)
    flagged = torch.zeros(adv.shape[0], dtype=torch.bool, device=adv.device)
    groups = batch.get("group_index") if scope == "group" else None
    keys = groups.reshape(-1).tolist() if groups is not None and groups.numel() == adv.shape[0] else [0] * len(adv)
    for key in sorted(set(keys)):
        members = [i for i, k in enumerate(keys) if k == key and bool(has_tokens[i])]
        if not members:
            continue
        index = torch.tensor(members, device=adv.device)
        z = robust_z(adv[index])
        flagged[index] = (z > threshold).to(adv.device)
    return flagged


def kept_samples(batch: Mapping[str, torch.Tensor], rank: int, samples: SampleFilter) -> torch.Tensor | None:
    """[B] float, 1 for a sample the filter keeps and 0 for one it leaves out; None when it keeps all."""
    import torch

    if not samples.drops_samples:
        return None
    n = batch["loss_mask"].shape[0]
    drop = torch.zeros(n, dtype=torch.bool, device=batch["loss_mask"].device)
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
    """ConfigError when `drop_samples` names a rank the snapshot does not have."""
    bad = sorted(r for r, _ in samples.drop if r >= world_size)
    if bad:
        raise ConfigError(
            f"drop_samples: rank {bad[0]} is not in the snapshot (saved ranks 0..{world_size - 1})", "mitigations"
        )
