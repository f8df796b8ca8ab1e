"""The TRL cross-check's settings and batches: our `trl` convention and TRL 1.16's own `GRPOTrainer._compute_loss`
on the same float64 micro-batches (2 processes, 2 accumulation steps each; varied completion lengths, an empty
completion, log-ratios past the clip ranges and the rollout-correction caps, a reference far from the policy,
mixed-sign and zero advantages). Used by test_trl_crosscheck.py and scripts/trl_crosscheck_table.py.

TRL's side is its own `_compute_loss`, run on a `GRPOTrainer` made with `object.__new__` (no model load, no
dataset) whose attributes are set from a real `GRPOConfig` as `GRPOTrainer.__init__` sets them, and whose
`_get_per_token_logps_and_entropies` returns the batch's log-probs and entropies (a leaf tensor, so the gradient
with respect to each log-prob is compared). Its accelerator is a stand-in that reports the process count: the
loss reads only `num_processes` from it; its gathers and reductions feed TRL's logged metrics, each process's
own here. Our side is `policy_loss` under `loss.convention: trl` with the section `capture.trl_loss_section`
writes for the same `GRPOConfig`, on the process's micro-batches concatenated (prompt + completion columns, NaN
log-probs off the mask) with their `micro_batch` index, as a capture of TRL writes them.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from axrl_spike_replay.capture.trl_loss_section import trl_loss_config, trl_loss_section
from axrl_spike_replay.training.policy_loss import policy_loss
from axrl_spike_replay.training.trl_convention import IS_RATIO, MICRO_BATCH, NUM_ITEMS

PROMPT, COMPLETION, ROWS, GA, PROCESSES = 3, 8, 4, 2, 2
SEEDS = (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class Case:
    """One setting: GRPOConfig keyword arguments, and what the batch carries."""

    config: dict[str, Any]
    use_vllm: bool = False  # TRL applies its rollout correction only when it generated with vLLM
    old: bool = True  # the batch carries old log-probs (else TRL's ratio is against the current ones, detached)
    sampling: bool = True  # the batch carries the rollout's (sampling) log-probs
    processes: int = PROCESSES
    accumulation: int = GA
    extra: dict[str, Any] = field(default_factory=dict)


def _cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    for loss_type in ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"):
        high = {"epsilon_high": 3.0} if loss_type == "cispo" else {}
        cases[loss_type] = Case({"loss_type": loss_type, **high})
        cases[f"{loss_type} sequence-level (GSPO)"] = Case(
            {"loss_type": loss_type, "importance_sampling_level": "sequence", **high}
        )
    cases["grpo epsilon 0.1 / epsilon_high 0.28"] = Case({"loss_type": "grpo", "epsilon": 0.1, "epsilon_high": 0.28})
    cases["dapo delta 1.5 (two-sided clip)"] = Case({"loss_type": "dapo", "delta": 1.5})
    cases["grpo sequence delta 1.2"] = Case(
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "delta": 1.2}
    )
    cases["dapo beta 0.04 (bias-corrected k3)"] = Case({"loss_type": "dapo", "beta": 0.04})
    cases["grpo beta 0.04 no bias correction"] = Case(
        {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False}
    )
    cases["gspo beta 0.04"] = Case({"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04})
    cases["sapo temperatures 0.5/2"] = Case(
        {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}
    )
    cases["vespo k/lambda 1,2,4,1"] = Case(
        {"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_pos": 2.0, "vespo_k_neg": 4.0, "vespo_lambda_neg": 1.0}
    )
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        caps = {"vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 2.0}
        cases[f"dapo rollout correction {mode} [0.5, 2]"] = Case(
            {"loss_type": "dapo", "vllm_importance_sampling_mode": mode, **caps}, use_vllm=True
        )
    cases["grpo rollout correction sequence_mask default cap 3"] = Case({"loss_type": "grpo"}, use_vllm=True)
    cases["vespo rollout correction token_truncate [0.5, 2]"] = Case(
        {
            "loss_type": "vespo",
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_min": 0.5,
            "vllm_importance_sampling_clip_max": 2.0,
        },
        use_vllm=True,
    )
    cases["dapo off-policy mask 0.05 (sampling log-probs)"] = Case(
        {"loss_type": "dapo", "off_policy_mask_threshold": 0.05}
    )
    cases["grpo off-policy mask 0.05 (old log-probs)"] = Case(
        {"loss_type": "grpo", "off_policy_mask_threshold": 0.05}, sampling=False
    )
    cases["dapo entropy_coef 0.01"] = Case({"loss_type": "dapo", "entropy_coef": 0.01})
    cases["grpo entropy_coef 0.01"] = Case({"loss_type": "grpo", "entropy_coef": 0.01})
    cases["dapo no old log-probs (ratio against the current ones)"] = Case({"loss_type": "dapo"}, old=False)
    cases["dapo one process, one micro-batch"] = Case({"loss_type": "dapo"}, processes=1, accumulation=1)
    cases["bnpo one process, one micro-batch"] = Case({"loss_type": "bnpo"}, processes=1, accumulation=1)
    cases["dapo steps_per_generation 4"] = Case({"loss_type": "dapo", "steps_per_generation": 4})
    return cases


CASES = _cases()


def _grpo_config(case: Case) -> Any:
    from trl import GRPOConfig

    with tempfile.TemporaryDirectory() as out:
        return GRPOConfig(
            output_dir=out,
            use_cpu=True,
            report_to=[],
            per_device_train_batch_size=ROWS,
            gradient_accumulation_steps=case.accumulation,
            num_generations=2,
            max_completion_length=COMPLETION,
            **case.config,
        )


class _Accelerator:
    """The loss reads `num_processes`; the collectives feed TRL's logged metrics (this process's own here)."""

    def __init__(self, processes: int) -> None:
        self.num_processes = processes
        self.sync_gradients = True

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


def trl_trainer(case: Case, args: Any) -> Any:
    """A GRPOTrainer with the attributes `_compute_loss` reads, set from `args` as `GRPOTrainer.__init__` does."""
    from trl import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)
    trainer.args = args
    trainer.loss_type = args.loss_type
    trainer.importance_sampling_level = args.importance_sampling_level
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.beta = args.beta
    trainer.off_policy_mask_threshold = args.off_policy_mask_threshold
    trainer.top_entropy_quantile = args.top_entropy_quantile
    trainer.use_vllm = case.use_vllm
    trainer.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    trainer.max_completion_length = args.max_completion_length
    trainer.current_gradient_accumulation_steps = case.accumulation
    trainer.entropy_coef = args.entropy_coef
    trainer.use_adaptive_entropy = args.use_adaptive_entropy
    trainer._entropy_bonus_enabled = args.entropy_coef != 0.0 or args.use_adaptive_entropy
    trainer._last_world_entropy = float("inf")
    trainer._entropy_window_stats = None
    trainer.aux_loss_enabled = False
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.accelerator = _Accelerator(case.processes)
    trainer.model = torch.nn.Linear(1, 1)  # `_compute_loss` reads `.training` from it: train mode
    return trainer


def _ratio(case: Case, args: Any, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The rollout correction's ratio as TRL's generation step forms it (the batch records it; both losses read it)."""
    from axrl_spike_replay.training.trl_convention import rollout_correction_ratio

    low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    return rollout_correction_ratio(old, sampling, mask, args.vllm_importance_sampling_mode, low, high)


def process_batches(case: Case, seed: int, process: int) -> list[dict[str, torch.Tensor]]:
    """One process's micro-batches, TRL's inputs (completion columns only), float64."""
    gen = torch.Generator().manual_seed(1000 * seed + process)
    out = []
    total_rows = ROWS * case.accumulation * case.processes
    for _ in range(case.accumulation):
        lengths = torch.randint(0, COMPLETION + 1, (ROWS,), generator=gen)
        lengths[0] = 0 if process == 0 and not out else lengths[0]  # an empty completion
        lengths[-1] = COMPLETION  # a full one
        mask = (torch.arange(COMPLETION)[None] < lengths[:, None]).long()
        lp = -torch.rand(ROWS, COMPLETION, generator=gen, dtype=torch.float64) * 3 - 0.05
        old = lp + torch.randn(ROWS, COMPLETION, generator=gen, dtype=torch.float64) * 0.6
        sampling = old + torch.randn(ROWS, COMPLETION, generator=gen, dtype=torch.float64) * 0.5
        ref = lp + torch.randn(ROWS, COMPLETION, generator=gen, dtype=torch.float64) * 2.0
        adv = torch.randn(ROWS, generator=gen, dtype=torch.float64)
        adv[1] = 0.0
        out.append(
            {
                "prompt_ids": torch.randint(5, 50, (ROWS, PROMPT), generator=gen),
                "prompt_mask": torch.ones(ROWS, PROMPT, dtype=torch.long),
                "completion_ids": torch.randint(5, 50, (ROWS, COMPLETION), generator=gen),
                "completion_mask": mask,
                "advantages": adv,
                "logps": lp,
                "entropies": torch.rand(ROWS, COMPLETION, generator=gen, dtype=torch.float64) * 2,
                "old_per_token_logps": old,
                "sampling_per_token_logps": sampling,
                "ref_per_token_logps": ref,
            }
        )
    del total_rows
    return out


def _num_items(case: Case, seed: int) -> torch.Tensor:
    total = sum(
        float(mb["completion_mask"].sum()) for p in range(case.processes) for mb in process_batches(case, seed, p)
    )
    return torch.tensor(total, dtype=torch.float64)


def _trl_inputs(case: Case, args: Any, mb: dict[str, torch.Tensor], num_items: torch.Tensor) -> dict[str, Any]:
    inputs = {k: mb[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    inputs[NUM_ITEMS] = num_items
    if case.old:
        inputs["old_per_token_logps"] = mb["old_per_token_logps"]
    if case.sampling:
        inputs["sampling_per_token_logps"] = mb["sampling_per_token_logps"]
    if args.beta:
        inputs["ref_per_token_logps"] = mb["ref_per_token_logps"]
    if case.use_vllm:
        inputs[IS_RATIO] = _ratio(
            case, args, mb["old_per_token_logps"], mb["sampling_per_token_logps"], mb["completion_mask"].double()
        )
    return inputs


def trl_side(
    case: Case, args: Any, mbs: list[dict[str, torch.Tensor]], num_items: torch.Tensor
) -> tuple[float, torch.Tensor]:
    """(sum over the micro-batches of TRL's loss, its gradient with respect to each micro-batch's log-probs)."""
    trainer = trl_trainer(case, args)
    total, grads = 0.0, []
    for mb in mbs:
        leaf = mb["logps"].clone().requires_grad_(True)
        trainer._get_per_token_logps_and_entropies = lambda *a, _l=leaf, _e=mb["entropies"], **k: (_l, _e, None)
        loss = trainer._compute_loss(trainer.model, _trl_inputs(case, args, mb, num_items))
        loss.backward()
        total += float(loss.detach())
        grads.append(leaf.grad)
    return total, torch.cat(grads)


def our_batch(case: Case, args: Any, mbs: list[dict[str, torch.Tensor]], num_items: torch.Tensor) -> dict[str, Any]:
    """The process's micro-batches as a capture writes them: concatenated, prompt + completion columns, NaN
    log-probs off the mask, a `micro_batch` index per row."""
    nan = torch.full((ROWS, PROMPT), float("nan"), dtype=torch.float64)

    def wide(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.cat([nan, x.masked_fill(mask == 0, float("nan"))], dim=1)

    parts: dict[str, list[torch.Tensor]] = defaultdict(list)
    for i, mb in enumerate(mbs):
        m = mb["completion_mask"]
        parts["tokens"].append(torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1))
        parts["attention_mask"].append(torch.cat([mb["prompt_mask"], m], dim=1))
        parts["loss_mask"].append(torch.cat([torch.zeros_like(mb["prompt_mask"]), m], dim=1))
        parts["advantages"].append(mb["advantages"])
        parts[MICRO_BATCH].append(torch.full((ROWS,), i, dtype=torch.long))
        parts["logprobs"].append(wide(mb["logps"], m))
        parts["entropy"].append(wide(mb["entropies"], m))
        if case.old:
            parts["old_logprobs"].append(wide(mb["old_per_token_logps"], m))
        if case.sampling:
            parts["rollout_logprobs"].append(wide(mb["sampling_per_token_logps"], m))
        parts["ref_logprobs"].append(wide(mb["ref_per_token_logps"], m))
        if case.use_vllm:
            ratio = _ratio(case, args, mb["old_per_token_logps"], mb["sampling_per_token_logps"], m.double())
            parts[IS_RATIO].append(
                ratio
                if ratio.shape[1] == 1
                else torch.cat([torch.ones(ROWS, PROMPT, dtype=torch.float64), ratio], dim=1)
            )
    batch: dict[str, Any] = {k: torch.cat(v) for k, v in parts.items()}
    batch[NUM_ITEMS] = num_items
    return batch


def our_side(
    case: Case, args: Any, mbs: list[dict[str, torch.Tensor]], num_items: torch.Tensor
) -> tuple[float, torch.Tensor]:
    """(our trl convention's loss on the process's batch, its gradient with respect to the completion log-probs)."""
    from trl import __version__

    section = trl_loss_section(
        args,
        gradient_accumulation_steps=case.accumulation,
        num_processes=case.processes,
        aux_loss_coef=0.0,
        version=__version__,
        use_vllm=case.use_vllm,
    )
    cfg = trl_loss_config(section)
    batch = our_batch(case, args, mbs, num_items)
    leaf = batch.pop("logprobs").clone().requires_grad_(True)
    entropy = batch.pop("entropy")
    out = policy_loss(leaf, batch, cfg, entropy=entropy)
    out.loss.backward()
    assert leaf.grad is not None
    return float(out.loss.detach()), leaf.grad[:, PROMPT:]


def compare(case: Case, seed: int = 0) -> dict[str, float]:
    """Worst relative difference of loss and gradient over the processes, and both losses summed over them."""
    args = _grpo_config(case)
    num_items = _num_items(case, seed)
    figures = {"ours": 0.0, "trl": 0.0, "loss_rel": 0.0, "grad_rel": 0.0}
    for process in range(case.processes):
        mbs = process_batches(case, seed, process)
        theirs, their_grad = trl_side(case, args, mbs, num_items)
        ours, our_grad = our_side(case, args, mbs, num_items)
        figures["ours"] += ours
        figures["trl"] += theirs
        figures["loss_rel"] = max(figures["loss_rel"], abs(ours - theirs) / max(abs(theirs), 1e-300))
        scale = float(their_grad.abs().max())
        figures["grad_rel"] = max(figures["grad_rel"], float((our_grad - their_grad).abs().max()) / max(scale, 1e-300))
    return figures
