"""A rank's micro-batches as Megatron-core's own schedule runs them, against the replay's micro-batch plan.

Megatron-core's `forward_backward_no_pipelining` (pipeline_parallel/schedules.py, as installed) runs the policy
over the micro-batches; its `forward_step` divides each micro-batch's loss by `num_microbatches` before the
backward (a loss function returning `(loss, reduced)`), and with a `(sum, num_tokens, reduced)` loss function it
divides by the micro-batch's own token count as well. Ours is `training.micro_batches`' plan with its default
scale for `normalization: per_rank` (`mean`), each micro-batch's token-mean loss backpropagated as the replay's
loop does. The responses differ in length, so the flattened rank (one token mean) is held to differ.

Megatron-core runs in one spawned gloo process (its parallel state needs a process group), on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from axrl_spike_replay.models.mcore.megatron_cpu import megatron_unavailable_reason

REASON = megatron_unavailable_reason()
SAME = 1e-6


def _schedule(rank: int, world: int, payload: tuple[str]) -> None:
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.transformer import TransformerConfig

    from axrl_spike_replay.models.mcore.megatron_cpu import megatron_on_cpu
    from axrl_spike_replay.models.mcore.megatron_gpt import MegatronParallel, init_parallel
    from axrl_spike_replay.models.policy import policy_forward
    from axrl_spike_replay.models.tiny_moe import RoutingControl, TinyMoEConfig, TinyMoEPolicy
    from axrl_spike_replay.training.loss_config import LossConfig
    from axrl_spike_replay.training.micro_batches import MicroBatchSpec, plan_micro_batches, take
    from axrl_spike_replay.training.policy_loss import policy_loss

    (out,) = payload
    with megatron_on_cpu():
        init_parallel(MegatronParallel())
        torch.manual_seed(0)
        model = TinyMoEPolicy(TinyMoEConfig(vocab_size=32, d_model=16, n_layers=2, n_experts=4, max_seq_len=12))
        # what Megatron's get_model_config reads off a model (the schedule reads only its step settings)
        # (set as plain attributes: what Megatron reads off its own models)
        setattr(model, "config", TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2))  # noqa: B010
        setattr(model, "model_type", ModelType.encoder_or_decoder)  # noqa: B010
        setattr(model, "set_input_tensor", lambda tensor: None)  # noqa: B010  one stage: nothing comes from before
        gen = torch.Generator().manual_seed(3)
        b, t, prompt = 6, 12, 4
        tokens = torch.randint(0, 32, (b, t), generator=gen)
        mask = torch.zeros(b, t)
        for s, length in enumerate((8, 1, 5, 2, 7, 3)):  # uneven responses: uneven micro-batch token counts
            mask[s, prompt : prompt + length] = 1.0
        with torch.no_grad():
            old = policy_forward(model, {"tokens": tokens}, RoutingControl(), need_entropy=False).logprobs
        batch = {
            "tokens": tokens,
            "loss_mask": mask,
            "advantages": torch.randn(b, generator=gen),
            "old_logprobs": old + 0.2 * torch.randn(b, t, generator=gen),
        }
        loss = LossConfig(loss_agg_mode="token-mean")
        plan = plan_micro_batches(batch, MicroBatchSpec(split="size", size=2), loss.to_dict(), "batch_rank0.pt")
        params = list(model.parameters())

        def grads() -> list[torch.Tensor]:
            got = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
            model.zero_grad(set_to_none=True)
            return got

        def megatron(three: bool) -> list[torch.Tensor]:
            parts = iter([take(batch, mb) for mb in plan])

            def forward_step(data_iterator: Any, model: Any) -> Any:
                part = next(data_iterator)
                logprobs = policy_forward(model, part, RoutingControl(), need_entropy=False).logprobs

                def loss_func(output: torch.Tensor) -> Any:
                    result = policy_loss(output, part, loss)
                    if three:  # token sums and counts: the schedule divides by each micro-batch's own count
                        tokens = part["loss_mask"].sum().to(torch.int)
                        return result.loss * tokens, tokens, {"loss": result.loss.detach()}
                    return result.loss, {"loss": result.loss.detach()}

                return logprobs, loss_func

            zeros = torch.zeros

            def cpu_zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
                if kwargs.get("device") == "cuda" and not torch.cuda.is_available():
                    kwargs["device"] = "cpu"
                return zeros(*args, **kwargs)

            # megatron-core 0.16.1's forward_backward_no_pipelining makes its token counter with device="cuda"
            # hard-coded; on a CPU-only torch that one tensor is made on the CPU (the schedule itself is untouched)
            torch.zeros = cpu_zeros
            try:
                forward_backward_no_pipelining(
                    forward_step_func=forward_step,
                    data_iterator=parts,
                    model=[model],
                    num_microbatches=len(plan),
                    seq_length=t,
                    micro_batch_size=2,
                    forward_only=False,
                )
            finally:
                torch.zeros = zeros
            return grads()

        theirs, theirs_sums = megatron(False), megatron(True)
        for mb in plan:  # the replay's loop: each micro-batch's loss times its planned scale
            part = take(batch, mb)
            logprobs = policy_forward(model, part, RoutingControl(), need_entropy=False).logprobs
            (policy_loss(logprobs, part, loss).loss * mb.scale).backward()
        ours = grads()
        whole = policy_forward(model, batch, RoutingControl(), need_entropy=False).logprobs
        policy_loss(whole, batch, loss).loss.backward()
        flat = grads()

        def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
            num = sum(float((x - y).double().pow(2).sum()) for x, y in zip(a, b, strict=True)) ** 0.5
            return num / sum(float(y.double().pow(2).sum()) for y in b) ** 0.5

        figures = {
            "scales": [mb.scale for mb in plan],
            "ours": rel(ours, theirs),
            "sums": rel(ours, theirs_sums),
            "flat": rel(flat, theirs),
        }
        Path(out).write_text(json.dumps(figures))


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_micro_batches_scale_as_megatron_cores_schedule_scales_them(tmp_path: Path) -> None:
    from axrl_spike_replay.processes.rank_processes import spawn_ranks

    out = tmp_path / "figures.json"
    spawn_ranks(_schedule, 1, (str(out),), timeout_s=300.0, label="megatron schedule")
    figures = json.loads(out.read_text())
    assert figures["scales"] == [1 / 3] * 3, "per_rank: the mean over the micro-batches"
    assert figures["ours"] <= SAME, figures
    assert figures["sums"] <= SAME, figures
    assert figures["flat"] > 0.01, figures
