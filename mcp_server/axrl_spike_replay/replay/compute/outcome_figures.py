"""What a mitigated replay changed besides the spike: how much of the loss it touched, and how much of the
healthy gradient it kept.

Footprint: against the baseline's loss at the same layout, the loss tokens a config masks (out of the loss)
or changes (still in the loss, but with a per-token loss that differs from the baseline's by more than
rtol 1e-5 / atol 1e-7: clipped, reweighted or recomputed), and the samples it masks entirely or touches
at all. A config that only changes the aggregation (`loss_agg_mode`) touches no token: the cosine shows it.

Clean gradient (`replay.compute.clean_gradient` has the definition): the baseline gradient with the loss tokens the
baseline loss pulls hardest on left out of the loss, as few as get it under the verdict's spike bar (grad
norm / median < threshold), at most half the loss tokens (`reached` false when even that does not).

Cosine to clean: <g_cfg, g_clean> / (||g_cfg|| ||g_clean||) over every parameter of the reduced global
gradients (float64). 1: the config kept the healthy gradient's direction exactly (it removed only what the
spike tokens added); a no-op config scores the baseline's own cosine, well under 1 when the spike
dominates. Cost: about 2 log2(k) + 1 forward + backward passes of the batch for k tokens left out, per
replay or sweep, shared by all its configs (`clean_gradient.passes`, `clean_gradient.seconds`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from axrl_spike_replay.experiment.result import FOOTPRINT_COUNTS, Footprint
from axrl_spike_replay.replay.compute.clean_gradient import CLEAN_DEFINITION

CHANGE_RTOL = 1e-5
CHANGE_ATOL = 1e-7
DEFINITION = (
    f"{CLEAN_DEFINITION}; cosine_to_clean: cosine of the config's reduced global gradient with the clean one; "
    "footprint: loss tokens masked or "
    f"changed (per-token loss differs from the baseline's beyond rtol {CHANGE_RTOL:g}, atol {CHANGE_ATOL:g}) and "
    "samples masked or touched, as fractions of the baseline's"
)


@dataclass
class RankTrace:
    """What one rank's loss used under one config: the mask and the per-token loss (detached)."""

    mask: torch.Tensor  # [B, T]
    per_token: torch.Tensor  # [B, T], 0 off the mask


def footprint_counts(base: RankTrace, cfg: RankTrace) -> dict[str, int]:
    """Token and sample counts of what `cfg` changed against the baseline on one rank."""
    on = base.mask > 0
    masked = on & ~(cfg.mask > 0)
    kept = on & (cfg.mask > 0)
    same = torch.isclose(cfg.per_token.double(), base.per_token.double(), rtol=CHANGE_RTOL, atol=CHANGE_ATOL)
    changed = kept & ~same
    has_tokens = on.any(dim=-1)
    return {
        "loss_tokens": int(on.sum()),
        "masked_tokens": int(masked.sum()),
        "changed_tokens": int(changed.sum()),
        "samples": int(has_tokens.sum()),
        "masked_samples": int((has_tokens & ~kept.any(dim=-1)).sum()),
        "touched_samples": int((has_tokens & (masked | changed).any(dim=-1)).sum()),
    }


def merge_footprint(parts: Sequence[Mapping[str, int]]) -> Footprint:
    """Counts summed over ranks, with the fractions the ranking uses (`token_fraction`, `sample_fraction`)."""
    return Footprint.of_counts({k: sum(int(p.get(k, 0)) for p in parts) for k in FOOTPRINT_COUNTS})


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """A copy of every parameter's `.grad` (zeros where there is none)."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float | None:
    """Cosine similarity of two gradients given per parameter (float64); None when either is 0 or not finite."""
    dot = na = nb = 0.0
    for x, y in zip(a, b, strict=True):
        x64, y64 = x.double(), y.double()
        dot += float((x64 * y64).sum())
        na += float((x64 * x64).sum())
        nb += float((y64 * y64).sum())
    if not (na > 0 and nb > 0) or not all(math.isfinite(v) for v in (dot, na, nb)):
        return None
    return max(-1.0, min(1.0, dot / math.sqrt(na * nb)))


class _PolicyOutputsOf(torch.nn.Module):
    """One rank batch's per-token log-probs (and entropies) as a module call, so `functional_call` can swap in
    dual parameters."""

    def __init__(self, model: torch.nn.Module, batch: dict[str, Any], routing: Any, need_entropy: bool) -> None:
        super().__init__()
        self.model = model
        self.batch = batch
        self.routing = routing
        self.need_entropy = need_entropy

    def forward(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        from axrl_spike_replay.models.policy import policy_forward

        out = policy_forward(self.model, self.batch, self.routing, need_entropy=self.need_entropy)
        return out.logprobs, out.entropy


def jvp_policy(
    model: torch.nn.Module,
    batch: dict[str, Any],
    routing: Any,
    direction: dict[str, torch.Tensor],
    need_entropy: bool = False,
) -> tuple[Any, Any]:
    """J g for the per-token log-probs [B, T] (and entropies, else None): one forward pass with dual numbers
    (parameter, tangent = g). Any policy kind: the outputs are `policy_forward`'s. Kernels without forward-mode AD
    are swapped for ones with it for this pass: the math attention kernel, eager experts for transformers'
    `grouped_mm` (`models.hf_policy.experts_for_forward_ad`)."""
    import torch.autograd.forward_ad as fwad
    from torch.func import functional_call
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from axrl_spike_replay.models.hf_policy import experts_for_forward_ad

    wrapped = _PolicyOutputsOf(model, batch, routing, need_entropy)
    # the fused CPU attention kernel has no forward-mode AD; the math kernel has
    with sdpa_kernel(SDPBackend.MATH), experts_for_forward_ad(model), torch.no_grad(), fwad.dual_level():
        with warnings.catch_warnings():  # torch registers its forward-AD decompositions with torch.jit.script
            warnings.filterwarnings("ignore", message=".*torch.jit.script.* is deprecated", category=DeprecationWarning)
            duals = {
                f"model.{name}": fwad.make_dual(p.detach(), direction[name]) for name, p in model.named_parameters()
            }
        logprobs, entropy = functional_call(wrapped, duals, ())
        d_entropy = fwad.unpack_dual(entropy).tangent if entropy is not None else None
        return fwad.unpack_dual(logprobs).tangent, d_entropy
