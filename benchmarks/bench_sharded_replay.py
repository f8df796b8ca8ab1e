"""Sharded replay (FSDP2 over N gloo processes) vs the unsharded replay of a >= 300 M parameter transformers MoE.

A qwen3_moe policy of 338 M parameters (float32, hidden 1024, 8 layers of 20 experts, vocab 32 000) is recorded
at saved world size 4 by `axrl_spike_replay.testing.hf_snapshot` (the trainer's own rank step; DCP weights,
1.35 GB). Each replay then runs in a fresh process, side by side in one run:

- unsharded on 1 process (in the calling process) and on 2 (every process holds the whole model);
- sharded (`shard: on`) on 1, 2 and 4 processes (each holds 1/N of the parameters and gradients, loaded straight
  into its shards; one decoder layer gathered at a time).

Peak RSS per process is the largest replay process's `ru_maxrss` (the calling process's own for the in-process
run, its children's otherwise). Each process also pays a fixed floor: what a sharded replay process imports
(torch with FSDP2 and DCP, the architecture's transformers modelling, this package), measured in a process that
imports them and builds nothing. Prints per run the wall time, the peak, the grad norm's rel_diff to the
recorded one and the replay plan's predicted peak for the same layout, then the issue's two figures:

- memory: peak RSS per process <= 1.3 x (the unsharded peak) / N + activations, for N = 1, 2, 4, where the
  activations are one process's, from the replay plan (`replay.compute.process_memory.activation_bytes`: what autograd
  keeps for the largest saved rank's forward); not measured separately;
- wall at N = 2, sharded vs unsharded (target <= 1.5x).

Usage: .venv/bin/python benchmarks/bench_sharded_replay.py [--workdir DIR] [--layers 8] [--experts 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2048,
    "num_experts": 20,
    "moe_intermediate_size": 512,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "norm_topk_prob": True,
}

RECORD = """
import json, sys
from pathlib import Path
from axrl_spike_replay.testing.hf_snapshot import record_hf_snapshot
config = json.loads(sys.argv[2])
print(json.dumps(str(record_hf_snapshot(Path(sys.argv[1]), "qwen3_moe", world_size=4, config=config))))
"""

REPLAY = """
import json, resource, sys, time
def main():
    from axrl_spike_replay.investigation.request import How, What, replay_request
    from axrl_spike_replay.replay.engine import run_replay
    t = time.perf_counter()
    result = run_replay(replay_request(What(sys.argv[1]), how=How(nproc=int(sys.argv[2]), shard=sys.argv[3])))
    wall = time.perf_counter() - t
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"wall": wall, "self_mib": own, "children_mib": children, "grad_norm": result.grad_norm,
                      "rel_diff": result.rel_diff, "verdict": result.verdict, "sharded": result.sharded,
                      "fidelity": result.fidelity}))
if __name__ == "__main__":
    main()
"""

FLOOR = """
import json, resource
import torch, torch.distributed.fsdp, torch.distributed.checkpoint  # what a sharded replay process imports
from transformers.models.qwen3_moe import modeling_qwen3_moe
import axrl_spike_replay.replay.jobs.job_runner, axrl_spike_replay.models.hf_policy
print(json.dumps({"self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

PLAN = """
import json, sys
from axrl_spike_replay.replay.plans.replay_plan import plan_replay
row = plan_replay(sys.argv[1], nproc=int(sys.argv[2]), shard=sys.argv[3], capacity=None).chosen
print(json.dumps({"peak_mib": row.memory.peak / 2**20, "activations_mib": row.memory.activations / 2**20}))
"""


def _child(code: str, *args: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parameters(config: dict[str, object]) -> int:
    """Parameters of the benchmark's model, from its config (built on the meta device: nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"](**config))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where the snapshot is written (kept; reused when there)")
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    parser.add_argument("--experts", type=int, default=CONFIG["num_experts"])
    args = parser.parse_args()
    config = {**CONFIG, "num_hidden_layers": args.layers, "num_experts": args.experts}
    count = parameters(config)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="axrl-bench-sharded-"))
    if not sorted(workdir.glob("iter_*")):
        _child(RECORD, str(workdir), json.dumps(config))
    snapshot = sorted(workdir.glob("iter_*"))[-1]
    size = sum(p.stat().st_size for p in snapshot.glob("*.distcp"))
    print(f"qwen3_moe {count / 1e6:.0f} M parameters (float32), weights {size / 2**30:.2f} GiB, saved world size 4")
    floor = float(_child(FLOOR)["self_mib"])  # type: ignore[arg-type]
    runs = [(1, "off"), (2, "off"), (1, "on"), (2, "on"), (4, "on")]
    rows: dict[tuple[int, str], dict[str, float]] = {}
    for nproc, shard in runs:
        plan = _child(PLAN, str(snapshot), str(nproc), shard)
        out = _child(REPLAY, str(snapshot), str(nproc), shard)
        in_process = nproc == 1 and shard == "off"
        peak = float(out["self_mib"] if in_process else out["children_mib"])  # type: ignore[arg-type]
        rows[(nproc, shard)] = {"wall": float(out["wall"]), "peak": peak, **plan}  # type: ignore[arg-type]
        predicted = float(plan["peak_mib"])  # type: ignore[arg-type]
        print(
            f"{'sharded' if shard == 'on' else 'unsharded':>9} N={nproc}: wall {float(out['wall']):7.1f} s, "  # type: ignore[arg-type]
            f"peak RSS per process {peak:7.0f} MiB (plan {predicted:6.0f} MiB, {predicted / peak:.2f}x), "
            f"rel_diff {out['rel_diff']:.1e}, {out['verdict']}, fidelity {out['fidelity']}",
            flush=True,
        )
    whole = rows[(1, "off")]["peak"]
    print(f"process floor (imports only, in every process): {floor:.0f} MiB")
    for nproc in (1, 2, 4):
        row = rows[(nproc, "on")]
        activations = row["activations_mib"]
        bound = 1.3 * whole / nproc + activations
        print(
            f"sharded N={nproc}: peak {row['peak']:.0f} MiB vs bound 1.3 x {whole:.0f} / {nproc} + activations "
            f"{activations:.0f} (plan) = {bound:.0f} MiB: **{row['peak'] / bound:.2f}x** of the bound "
            f"({'met' if row['peak'] <= bound else 'NOT met'})"
        )
    ratio = rows[(2, "on")]["wall"] / rows[(2, "off")]["wall"]
    print(
        f"wall at N=2: sharded {rows[(2, 'on')]['wall']:.1f} s vs unsharded {rows[(2, 'off')]['wall']:.1f} s "
        f"(**{ratio:.2f}x**, target <= 1.5x)"
    )


if __name__ == "__main__":
    main()
