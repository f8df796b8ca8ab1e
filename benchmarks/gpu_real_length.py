#!/usr/bin/env python3
"""GPU: one replayed forward + backward at real length, for a GPU node (not part of CI; it has not run here).

The policy has Qwen3-30B-A3B's attention and vocabulary (hidden 2,048; 32 query and 4 KV heads of 128; vocab
151,936) and a cut-down expert set (2 layers, 16 experts, top-4, width 768): ~0.8B parameters, random weights, no
download. In bfloat16, with sdpa (or `--attention flash_attention_2` where flash_attn is installed), the head in
chunks and the decoder layers checkpointed, one sequence of `--tokens` (8,192) with recorded routes forced on half
the tokens. Prints the peak CUDA memory against the plan's (`replay.compute.process_memory`: parameters, one gradient,
activations), tokens per second, and, on a short step (`--check-tokens`, 512), the kernel's replay against a float32
eager replay of the same weights: rel_diff of the log-probs and of the gradient's norm, with the dtype's bound
(`models.attention_kernels.KERNEL_BOUNDS`).

Usage: .venv/bin/python benchmarks/gpu_real_length.py [--tokens 8192] [--attention sdpa] [--check-tokens 512]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from axrl_spike_replay.models.attention_kernels import KERNEL_BOUNDS
from axrl_spike_replay.models.layer_checkpoint import checkpoint_layers
from axrl_spike_replay.models.policy import build_policy, parse_model_config, policy_forward
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.replay.compute.process_memory import CUDA_CONTEXT_BYTES, activation_bytes, model_facts

CONFIG = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def _batch(n: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, CONFIG["vocab_size"], (1, n), generator=g)
    mask = torch.zeros(1, n)
    mask[:, n // 4 :] = 1.0
    return {
        "tokens": tokens.to(device),
        "loss_mask": mask.to(device),
        "attention_mask": torch.ones_like(tokens).to(device),
    }


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor], routing: RoutingControl) -> torch.Tensor:
    out = policy_forward(model, batch, routing, need_entropy=False)
    mask = batch["loss_mask"]
    loss = -(out.logprobs * mask).sum() / mask.sum() + 1e-3 * out.z_loss + 1e-2 * out.aux_loss
    loss.backward()
    return out.logprobs.detach().float()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--check-tokens", type=int, default=512)
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "flash_attention_2"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_real_length.py needs a CUDA device")
    device = "cuda"
    section = {"kind": "hf", "architecture": "qwen3_moe", "config": CONFIG, "attn_implementation": args.attention}
    spec = parse_model_config({**section, "dtype": "bfloat16"})
    torch.manual_seed(0)
    model = build_policy(spec, "cpu").to(device)
    checkpoint_layers(model)
    batch = _batch(args.tokens, device)
    with torch.no_grad():
        routes = policy_forward(model, batch, RoutingControl(), need_entropy=False).routes
    half = torch.rand(1, args.tokens, generator=torch.Generator().manual_seed(2)).to(device) < 0.5
    routing = RoutingControl(routes=routes, replay_tokens=half)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    _step(model, batch, routing)
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated()
    facts = model_facts(spec)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    planned = 2 * params + activation_bytes(facts, 1, args.tokens, 2, attention=args.attention, checkpointed=True)
    gib = float(1 << 30)
    print(f"device {torch.cuda.get_device_name(0)}, {params / 2 / 1e9:.2f}B parameters, bf16, {args.attention}")
    print(
        f"{args.tokens} tokens: peak allocated {peak / gib:.2f} GiB, plan {planned / gib:.2f} GiB "
        f"(+ {CUDA_CONTEXT_BYTES / gib:.2f} GiB CUDA context, outside the allocator), "
        f"plan/measured {planned / peak:.2f}; "
        f"{args.tokens / wall:.0f} tokens/s ({wall:.2f} s, forward + backward)"
    )
    # the kernel in bf16 against float32 eager on a short step, same weights
    state = {k: v.float().cpu() for k, v in model.state_dict().items()}
    short = _batch(args.check_tokens, device)
    results = []
    for kernel, dtype in ((args.attention, "bfloat16"), ("eager", "float32")):
        variant = dataclasses.replace(spec, attn_implementation=kernel, dtype=dtype)
        m = build_policy(variant, "cpu")
        m.load_state_dict({k: v.to(getattr(torch, dtype)) for k, v in state.items()})
        m.to(device)
        logp = _step(m, short, RoutingControl())
        squares = [float(p.grad.double().pow(2).sum()) for p in m.parameters() if p.grad is not None]
        results.append((logp, sum(squares) ** 0.5))
        del m
    (lp, norm), (lp_ref, norm_ref) = results
    rel_lp = float((lp - lp_ref).norm() / lp_ref.norm())
    bound = KERNEL_BOUNDS["bfloat16"]
    print(
        f"{args.check_tokens}-token step, {args.attention} bf16 vs eager float32: log-probs rel_diff {rel_lp:.2e} "
        f"(bf16 bound {bound.logprobs:g}), grad norm rel_diff {abs(norm - norm_ref) / norm_ref:.2e}"
    )


if __name__ == "__main__":
    main()
