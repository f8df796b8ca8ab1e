#!/usr/bin/env python3
"""A real-length step replayed on CPU: the trainer's micro-batches, sdpa, the head in chunks, checkpointed layers.

The policy (defaults): Qwen3-30B-A3B's attention and vocabulary (hidden 2,048; 32 query and 4 KV heads of 128;
vocab 151,936) with a cut-down expert set (2 layers, 16 experts, top-4, width 768), ~0.81B parameters, float32,
random weights, saved world size 2. Each snapshot is recorded in this run, by the trainer's own step functions
(`training.rank_step`: the micro-batches forwarded, each loss token-mean over its own tokens and divided by the
micro-batch count, the gradients accumulated, then the data-parallel mean), in a fresh process.

Rows (each replay in its own fresh process, `replay` with one process for both saved ranks, `shard` off, layers
checkpointed, against the plan made for that layout):
1. one `--tokens` (4,096) sequence per rank;
2. the same tokens per rank as two uneven micro-batches (5/8 and 3/8 of them, each its own sequence).
Per row: the process's peak RSS (VmHWM: everything, loading included) against the plan's peak, their ratio, the
replay's wall time, and the grad norm's rel_diff to the recording.

Then: whether eager attention with the whole model and no checkpointing (the engine before) fits this machine at
`--tokens` (the plan against this machine's available memory; its refusal printed when it does not fit); at
`--check-tokens` (1,024), where both fit, the new path's grad norm against eager's (<= 1e-5 relative); and memory
against sequence length: one forward + backward's activation bytes (the resident high-water mark of that step above
the resident size before it, the gradients allocated beforehand) at `--check-tokens` and 4x that, for eager with the
full-vocabulary head and for sdpa + chunked head + checkpointed layers (linear: 4x the tokens, <= 4.5x the bytes).

Usage: .venv/bin/python benchmarks/bench_real_length.py [--tokens 4096] [--check-tokens 1024] [--hidden 2048]
       [--heads 32] [--kv-heads 4] [--head-dim 128] [--workdir DIR [--reuse]]
A smaller run (say so where its figures are shown): --tokens 1024 --check-tokens 256 --hidden 512 --heads 8
       --kv-heads 1 --head-dim 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.vocabulary import Shard

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "mcp_server"))
MIB = float(1 << 20)


def hf_config(args: argparse.Namespace) -> dict[str, Any]:
    """The policy's transformers config (qwen3_moe)."""
    return {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": 3 * args.hidden,
        "moe_intermediate_size": args.expert_width,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "max_position_embeddings": max(8192, 2 * args.tokens),
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


# ---- child: record a snapshot with the trainer's step ----


def record(root: Path, config: dict[str, Any], tokens: int, parts: list[int], attention: str) -> dict[str, Any]:
    """Record a world-size-2 snapshot whose ranks each hold `tokens` tokens in micro-batches of `parts` (one
    sequence each); the trainer's step as the module doc says."""
    import torch

    from axrl_spike_replay.capture.snapshot_writer import RankPayload, write_snapshot
    from axrl_spike_replay.models.policy import build_policy, parse_model_config, policy_forward
    from axrl_spike_replay.models.tiny_moe import RoutingControl
    from axrl_spike_replay.snapshot.metadata import AxrlMetadata, DetectorSpec, ParallelLayout
    from axrl_spike_replay.testing.hf_snapshot import LOSS, run_config
    from axrl_spike_replay.training.micro_batches import MicroBatch, take, take_routing
    from axrl_spike_replay.training.policy_loss import LossConfig
    from axrl_spike_replay.training.rank_step import global_grad_norm, rank_forward_backward, reduce_gradients
    from axrl_spike_replay.training.routing_replay import RoutingConfig, routing_control

    torch.set_num_threads(2)
    section = {"kind": "hf", "architecture": "qwen3_moe", "config": config, "dtype": "float32"}
    section |= {"attn_implementation": attention, "experts_implementation": "eager"}
    spec = parse_model_config(section)
    torch.manual_seed(0)
    model = build_policy(spec)
    cfg = run_config(spec, 2)  # type: ignore[arg-type]
    cfg["loss"] = {**LOSS, "loss_agg_mode": "token-mean", "normalization": "per_rank"}
    loss_cfg = LossConfig.from_dict(cfg["loss"])
    routing_cfg = RoutingConfig.from_dict(cfg["routing"])
    width, vocab = max(parts), int(config["vocab_size"])
    payloads: dict[int, tuple[dict[str, Any], Any, float]] = {}
    start = time.perf_counter()
    for rank in range(2):
        g = torch.Generator().manual_seed(100 + rank)
        size = len(parts)
        batch: dict[str, Any] = {"tokens": torch.zeros(size, width, dtype=torch.long)}
        batch["attention_mask"] = torch.zeros(size, width, dtype=torch.long)
        batch["loss_mask"] = torch.zeros(size, width)
        for row, n in enumerate(parts):
            batch["tokens"][row, :n] = torch.randint(3, vocab, (n,), generator=g)
            batch["attention_mask"][row, :n] = 1
            batch["loss_mask"][row, n // 4 : n] = 1.0
        with torch.no_grad():  # the rollout's routes and log-probs
            rollout = policy_forward(model, batch, RoutingControl(), need_entropy=False)
        routes, old = rollout.routes.to(torch.int32), rollout.logprobs.float()
        rewards = torch.rand(size, generator=g)
        batch |= {
            "advantages": rewards - rewards.mean() if size > 1 else rewards - 0.5,
            "old_logprobs": old,
            "ref_logprobs": old - 0.05 * torch.rand(size, width, generator=g),
            "rollout_logprobs": old - 0.01 * torch.rand(size, width, generator=g) * batch["loss_mask"],
            "rewards": rewards,
            "group_index": torch.zeros(size, dtype=torch.long) + rank,
        }
        control = routing_control(routing_cfg, batch, routes.long())
        loss = 0.0
        for row, n in enumerate(parts):  # the trainer's micro-batches, each loss divided by their count
            mb = MicroBatch((row,), n, 1.0 / size)
            result = rank_forward_backward(
                model, take(batch, mb), loss_cfg, take_routing(control, mb, size), backward=False
            )
            (result.loss * mb.scale).backward()
            loss += float(result.loss.detach()) * mb.scale
        saved = (
            batch
            if size == 1
            else {"micro_batches": [take(batch, MicroBatch((r,), n, 1.0)) for r, n in enumerate(parts)]}
        )
        payloads[rank] = (saved, routes, loss)
    reduce_gradients(model, 2)
    grad_norm = global_grad_norm(model)
    wall = time.perf_counter() - start
    meta = AxrlMetadata(
        job_name="real-length",
        role="actor",
        iteration=7,
        grad_norm=grad_norm,
        median_norm=grad_norm / 8.0,
        spike_ratio=8.0,
        detector=DetectorSpec(kind="median_ratio", window=10, threshold=5.0),
        parallel=ParallelLayout(world_size=2, dp=2),
    )
    ranks = {
        rank: RankPayload(
            batch=saved,
            grad_info={"grad_norm": grad_norm, "loss": loss},
            routing_payload={"routed_experts": routes, "moe_layers": list(spec.moe_layer_ids), "source": "rollout"},
        )
        for rank, (saved, routes, loss) in payloads.items()
    }
    model.zero_grad(set_to_none=True)
    snap = write_snapshot(root, meta, cfg, model.state_dict(), ranks)
    return {"snapshot": str(snap), "grad_norm": grad_norm, "wall": wall}


# ---- child: replay ----


def replay(snapshot: str, checkpoint: bool) -> dict[str, Any]:
    """One replay in this process (one process for both saved ranks, shard off): peak RSS, wall, rel_diff."""
    import torch

    from axrl_spike_replay.replay.engine import run_replay

    torch.set_num_threads(2)
    start = time.perf_counter()
    result = run_replay(
        replay_request(What(Path(snapshot)), how=How(nproc=1, shard=Shard.OFF)), checkpoint=checkpoint, capacity=None
    )
    wall = time.perf_counter() - start
    return {
        "grad_norm": result.grad_norm,
        "recorded": result.recorded_grad_norm,
        "rel_diff": result.rel_diff,
        "wall": wall,
        "peak": _status("VmHWM:"),
        "reason": result.shard_reason,
        "error": result.error,
    }


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


# ---- child: one forward + backward's activations ----


def side(config: dict[str, Any], name: str, n: int) -> dict[str, Any]:
    """One forward + backward of one n-token sequence into gradients that already exist: the step's resident
    high-water mark above the resident size before it (the activations, and the backward's transient per-parameter
    gradients before they are added in)."""
    import ctypes
    import gc

    import torch

    from axrl_spike_replay.models.layer_checkpoint import checkpoint_layers
    from axrl_spike_replay.models.policy import build_policy, parse_model_config, policy_forward
    from axrl_spike_replay.models.tiny_moe import RoutingControl

    torch.set_num_threads(2)
    kernel = "eager" if name == "eager_full_head" else "sdpa"
    spec = parse_model_config(
        {"kind": "hf", "architecture": "qwen3_moe", "config": config, "attn_implementation": kernel}
    )
    torch.manual_seed(0)
    model = build_policy(spec)
    if name != "eager_full_head":
        checkpoint_layers(model)
    tokens = torch.randint(3, int(config["vocab_size"]), (1, n), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(1, n)
    mask[:, n // 4 :] = 1.0
    batch = {"tokens": tokens, "loss_mask": mask, "attention_mask": torch.ones_like(tokens)}
    for p in model.parameters():  # the gradient exists before the step: what the step adds is its activations
        p.grad = torch.zeros_like(p)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")
    if name == "eager_full_head":  # every logit in float32, as the engine took them before
        out = model(tokens, RoutingControl(), attention_mask=batch["attention_mask"], logits_to_keep=n - n // 4 + 1)
        logp = out.logits[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, n // 4 :, None]).squeeze(-1)
        loss = -logp.mean() + 1e-3 * out.z_loss + 1e-2 * out.aux_loss
    else:
        out = policy_forward(model, batch, RoutingControl(), need_entropy=False)
        loss = -(out.logprobs * mask).sum() / mask.sum() + 1e-3 * out.z_loss + 1e-2 * out.aux_loss
    loss.backward()
    return {"activations": _status("VmHWM:") - before}


# ---- parent ----


def _child(*argv: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO / "mcp_server")}
    done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{argv[0]} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _with_attention(snapshot: str, attention: str, where: Path) -> str:
    copy = where / f"{attention}-{Path(snapshot).parent.name}"
    shutil.copytree(snapshot, copy)
    doc = yaml.safe_load((copy / "run_config.yaml").read_text())
    doc["model"]["attn_implementation"] = attention
    (copy / "run_config.yaml").write_text(yaml.safe_dump(doc))
    return str(copy)


def _plan_peak(snapshot: str, checkpoint: bool) -> int:
    from axrl_spike_replay.replay.plans.replay_plan import plan_replay

    row = plan_replay(snapshot, nproc=1, capacity=None, shard="off", checkpoint=checkpoint).chosen
    assert row is not None
    return row.memory.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--check-tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--expert-width", type=int, default=768)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true", help="replay the recordings an earlier run left in --workdir")
    parser.add_argument("--child", nargs="+", default=None)
    parser.add_argument("--sections", default="rows,eager,check,sides", help="which parts to run (comma-separated)")
    args = parser.parse_args()
    config = hf_config(args)
    if args.child:
        what, *rest = args.child
        if what == "record":
            out = record(Path(rest[0]), config, int(rest[1]), [int(x) for x in rest[3:]], rest[2])
        elif what == "replay":
            out = replay(rest[0], rest[1] == "1")
        else:
            out = side(config, rest[0], int(rest[1]))
        print(json.dumps(out))
        return
    from axrl_spike_replay.models.policy import parameter_count, parse_model_config
    from axrl_spike_replay.replay.plans.replay_plan import PlanRefused, check_fits, plan_replay

    spec = parse_model_config({"kind": "hf", "architecture": "qwen3_moe", "config": config})
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-real-length-"))
    work.mkdir(parents=True, exist_ok=True)
    n, check = args.tokens, args.check_tokens
    geometry = ["--tokens", str(n), "--check-tokens", str(check), "--hidden", str(args.hidden), "--heads",
                str(args.heads), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim), "--vocab",
                str(args.vocab), "--expert-width", str(args.expert_width)]  # fmt: skip
    print(
        f"policy: qwen3_moe, hidden {args.hidden}, {args.heads} query / {args.kv_heads} KV heads of {args.head_dim}, "
        f"vocab {args.vocab}, 2 layers of 16 experts (top-4, width {args.expert_width}): "
        f"{parameter_count(spec):,} parameters, float32; saved world size 2; CPU, 2 threads",
        flush=True,
    )
    sections = set(args.sections.split(","))
    rows = {"one sequence": [n], "two uneven micro-batches": [n * 5 // 8, n - n * 5 // 8]}
    print(f"{'row':>26} {'tokens/rank':>11} {'peak RSS':>10} {'plan':>10} {'plan/meas':>9} {'wall':>8} {'rel_diff':>9}")
    first = ""
    for label, parts in rows.items() if sections & {"rows", "eager"} else ():
        rec = _recorded(work / label.replace(" ", "-"), args.reuse) or _child(
            "record", str(work / label.replace(" ", "-")), str(n), "sdpa", *map(str, parts), *geometry
        )
        first = first or rec["snapshot"]
        out = _child("replay", rec["snapshot"], "1", *geometry)
        if out["error"]:
            raise SystemExit(f"{label}: the replay failed: {out['error']}")
        plan = _plan_peak(rec["snapshot"], True)
        print(
            f"{label:>26} {n:>11} {out['peak'] / MIB:>9.0f}M {plan / MIB:>9.0f}M {plan / out['peak']:>9.2f} "
            f"{out['wall']:>7.1f}s {out['rel_diff']:>9.2e}   (recorded in {rec['wall']:.0f}s)",
            flush=True,
        )
    eager = _with_attention(first, "eager", work) if "eager" in sections else ""
    plan = plan_replay(eager, nproc=1, device="cpu", shard="off", checkpoint=False) if eager else None
    try:
        if plan is None:
            raise LookupError
        check_fits(plan)
        row = plan.chosen
        assert row is not None
        print(
            f"eager at {n} tokens, whole model, no checkpointing: the plan says it fits ({row.memory.peak / MIB:.0f}M)"
        )
    except PlanRefused as refused:
        print(f"eager at {n} tokens, whole model, no checkpointing, refused by the plan:\n{refused}")
    except LookupError:
        pass
    if "check" in sections:
        _check(work, check, geometry, args.reuse)
    if "sides" in sections:
        _sides(check, geometry)
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


def _recorded(out: Path, reuse: bool) -> dict[str, Any] | None:
    """The snapshot an earlier run recorded into `out`, when asked to reuse it (its recording time unknown)."""
    found = sorted(out.glob("iter_*/axrl_metadata.json")) if reuse else []
    return {"snapshot": str(found[-1].parent), "wall": float("nan")} if found else None


def _check(work: Path, check: int, geometry: list[str], reuse: bool) -> None:
    rec = _recorded(work / "check", reuse) or _child(
        "record", str(work / "check"), str(check), "sdpa", str(check), *geometry
    )
    new = _child("replay", rec["snapshot"], "1", *geometry)
    old = _child("replay", _with_attention(rec["snapshot"], "eager", work), "0", *geometry)
    between = abs(new["grad_norm"] - old["grad_norm"]) / abs(old["grad_norm"])
    print(
        f"at {check} tokens: sdpa + chunked head + checkpointed {new['grad_norm']:.9g} (rel_diff to the recording "
        f"{new['rel_diff']:.2e}, peak {new['peak'] / MIB:.0f}M); eager {old['grad_norm']:.9g} ({old['rel_diff']:.2e}, "
        f"peak {old['peak'] / MIB:.0f}M); new against eager {between:.2e} (bound 1e-5)",
        flush=True,
    )


def _sides(check: int, geometry: list[str]) -> None:
    print(f"activations of one forward + backward, {check} and {4 * check} tokens:")
    for name in ("sdpa_chunked_ckpt", "eager_full_head"):
        low = _child("side", name, str(check), *geometry)["activations"]
        high = _child("side", name, str(4 * check), *geometry)["activations"]
        print(
            f"  {name:>18}: {low / MIB:>8.0f}M -> {high / MIB:>8.0f}M: {high / low:.2f}x for 4x the tokens", flush=True
        )


if __name__ == "__main__":
    main()
