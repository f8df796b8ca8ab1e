"""A tiny GRPO run with TRL's own `GRPOTrainer` on CPU: our tiny qwen3_moe policy (transformers' own model class,
eager attention, float32), a word-level tokenizer built in memory, an in-memory prompt set, transformers'
generation (no vLLM), and a reward function of ours that plants a burst: at one generation it returns rewards a
thousand times larger, and with `scale_rewards="none"` the advantages (and so the gradient) follow. Used by
test_trl_callback.py, the two-process run (trl_two_process.py) and benchmarks/bench_trl_callback.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WORDS = ["<pad>", "<eos>"] + [f"w{i}" for i in range(62)]


@dataclass
class RunSpec:
    """What the run trains with; `burst_at`: the generation whose rewards are scaled by `burst` (None: never)."""

    steps: int = 6
    burst_at: int | None = 5
    burst: float = 1000.0
    gradient_accumulation_steps: int = 1
    router_aux_loss_coef: float | None = None  # None: the architecture's own (qwen3_moe: 0.001)
    loss_type: str = "dapo"
    extra: dict[str, Any] = field(default_factory=dict)


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def policy(seed: int = 0) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    from axrl_spike_replay.models.architectures import ARCHITECTURES

    cfg = ARCHITECTURES["qwen3_moe"].tiny_config()
    cfg.update(vocab_size=len(WORDS), pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="eager")


class BurstReward:
    """The reward: the completion text's length in characters mod 3, times `burst` at generation `burst_at` (from 1)."""

    __name__ = "length_mod_3"

    def __init__(self, burst_at: int | None, burst: float) -> None:
        self.burst_at, self.burst, self.calls = burst_at, burst, 0

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float]:
        self.calls += 1
        scale = self.burst if self.calls == self.burst_at else 1.0
        return [scale * (len(c) % 3) for c in completions]


def trainer(out: Path, spec: RunSpec) -> Any:
    """A GRPOTrainer for `spec`, writing under `out`."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = [" ".join(f"w{(i * 7 + j) % 60 + 2}" for j in range(3)) for i in range(64)]
    aux = {} if spec.router_aux_loss_coef is None else {"router_aux_loss_coef": spec.router_aux_loss_coef}
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=spec.steps,
        gradient_accumulation_steps=spec.gradient_accumulation_steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        scale_rewards="none",
        temperature=0.9,
        loss_type=spec.loss_type,
        seed=0,
        **aux,
        **spec.extra,
    )
    return GRPOTrainer(
        model=policy(),
        reward_funcs=BurstReward(spec.burst_at, spec.burst),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer(),
    )
