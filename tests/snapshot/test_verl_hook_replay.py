"""A snapshot the verl hook writes replays on our engine to the grad norm verl's step recorded, at full fidelity.

verl's `FSDPEngine` cannot be built here (it needs ray, GPUs and its process groups), so a stand-in object carries
exactly what the patched engine hands the hook: `module` (a real tiny qwen3_moe causal LM), `optimizer`,
`optimizer_config.clip_grad`, `engine_config.router_replay`, `_autocast_dtype`, and, as the patched
`forward_backward_batch` keeps them, the rank's mini-batch (a TensorDict in the engine's jagged layout, with the
counts the engine sets on it) and its loss function `partial(ppo_loss, config=actor_config)`. The step is computed
as verl 0.9.1 computes it, with verl's own code run from the installed files (tests/training/verl_peer.py): the
driver's rollout correction before the update (`compute_rollout_correction_weights` with batch normalisation,
`compute_rollout_rejection_mask`), then verl's own `losses.ppo_loss` on that TensorDict and the model output the
engine would hand it (the unpadded log-probs and entropies over prompt + response tokens, each position scoring
the next token), composing the policy loss, entropy and KL terms with the global counts itself, and
`clip_grad_norm_` clipping the gradients in place before the hook sees the pre-clip norm, as `optimizer_step`
does. Only the actor config `ppo_loss` reads is a stand-in (`ActorConfig` below): verl's own is a dataclass
behind an import chain that reaches ray (see verl_peer.py).

The replay recomputes the step to 1e-9 of its float64 norm. The hook records that norm in float64 from the
clipped gradients (divided by the clip's coefficient): rel_diff about 6e-10, where the float32 norm verl's clip
reports gave 8.8e-7, close to the 1e-6 a full-fidelity replay is held to.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from axrl_spike_replay.integrations import VERL_PATCH
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.models.policy import build_policy, parse_model_config, policy_forward
from axrl_spike_replay.models.tiny_moe import RoutingControl
from axrl_spike_replay.replay.engine import run_replay
from axrl_spike_replay.replay.reading.inputs import load_inputs
from axrl_spike_replay.snapshot.consistency import check_snapshot
from axrl_spike_replay.snapshot.fields import canonicalize_batch
from axrl_spike_replay.snapshot.rank_data import load_grad_info
from axrl_spike_replay.testing.hf_snapshot import model_section
from axrl_spike_replay.training.loss_normalization import GlobalCounts

REPO = Path(__file__).resolve().parents[2]
VERL_HOOK_FILE = VERL_PATCH.with_name("verl.py")  # the hook shipped in the package, loaded by path as a copy
PROMPTS, RESPONSES = (4, 2, 3, 1, 4, 3), (8, 5, 7, 0, 3, 8)  # per sample; sample 3 has an empty response
PROMPT, RESPONSE = max(PROMPTS), max(RESPONSES)
ADVANTAGES = (1.0, -0.5, 0.8, 0.3, -2.0, 0.6)
TEMPERATURE = 0.7
CLIP_GRAD = 0.05  # verl's optimizer clip_grad: below the step's norm, so the clip scales every gradient
ROLLOUT_CORRECTION = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True}
ROLLOUT_RS = {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.8"}


@dataclasses.dataclass
class ActorConfig:
    """The stand-in for verl's `ActorConfig` (verl/workers/config/actor.py): the fields `ppo_loss` reads, with
    verl's defaults, and the dict-like `get` its BaseConfig gives."""

    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 2.5
    loss_agg_mode: str = "seq-mean-token-mean"
    loss_scale_factor: int | None = None
    entropy_coeff: float = 0.01
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.05
    kl_loss_type: str = "low_var_kl"
    policy_loss: dict[str, Any] = dataclasses.field(default_factory=lambda: {"loss_mode": "vanilla"})
    global_batch_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


@pytest.fixture(scope="module")
def verl() -> dict[str, Any]:
    if importlib.util.find_spec("verl") is None or importlib.util.find_spec("tensordict") is None:
        pytest.skip("needs verl 0.9.1 and tensordict installed (verl's ppo_loss computes the step)")
    spec = importlib.util.spec_from_file_location("verl_peer_for_hook", REPO / "tests" / "training" / "verl_peer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    peer = module.load_verl()
    assert peer["version"] == "0.9.1"
    return peer


def _load_hook() -> Any:
    spec = importlib.util.spec_from_file_location("axrl_verl_hook_replay", VERL_HOOK_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _padded_batch(vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """verl's padded batch: prompts left-padded, responses right-padded, position ids from the attention mask."""
    batch = len(PROMPTS)
    input_ids = torch.zeros(batch, PROMPT + RESPONSE, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        attention[b, PROMPT - p : PROMPT + r] = 1
        input_ids[b, PROMPT - p : PROMPT + r] = torch.randint(3, vocab, (p + r,), generator=gen)
    return {
        "prompts": input_ids[:, :PROMPT],
        "responses": input_ids[:, PROMPT:],
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0),
        "response_mask": attention[:, PROMPT:].float(),
    }


def _token_logprobs(policy: Any, data: dict[str, Any], need_entropy: bool) -> Any:
    """The policy's [B, PROMPT + RESPONSE] log-probs (and entropies) on the padded batch, temperature applied:
    column t scores token t (computed from the first response column on, 0 before it)."""
    out = policy_forward(policy, canonicalize_batch(data, "mini-batch"), RoutingControl(), need_entropy=need_entropy)
    return out.logprobs, out.entropy


def _rollout_fields(policy: Any, padded: dict[str, torch.Tensor], gen: torch.Generator, verl: dict[str, Any]) -> None:
    """Old / rollout / reference log-probs and advantages as a run has them, then the driver's rollout correction
    (decoupled mode) by verl's own functions: IS weights added, rejection sampling applied to response_mask."""
    mask = padded["response_mask"]
    with torch.no_grad():
        current = _token_logprobs(policy, padded, need_entropy=False)[0][:, PROMPT:]
    old = current + 0.15 * torch.randn(current.shape, generator=gen)
    old[4, :2] = current[4, :2] - 1.5  # a negative-advantage sample past the dual clip (ratio e^1.5 > 2.5)
    rollout = old + 0.1 * torch.randn(old.shape, generator=gen)
    rollout[0, 1:4] = old[0, 1:4] - 2.0  # a rollout mismatch burst: truncated and rejected
    padded["old_log_probs"] = old * mask
    padded["rollout_log_probs"] = rollout * mask
    padded["ref_log_prob"] = (old - 0.05 * torch.rand(old.shape, generator=gen)) * mask
    padded["advantages"] = torch.tensor(ADVANTAGES)[:, None] * mask
    rc = verl["rollout_corr"]
    log_ratio = padded["old_log_probs"] - padded["rollout_log_probs"]
    padded["rollout_is_weights"], _ = rc.compute_rollout_correction_weights(log_ratio, mask, **ROLLOUT_CORRECTION)
    padded["response_mask"], _ = rc.compute_rollout_rejection_mask(log_ratio, mask, **ROLLOUT_RS)


def _engine_layout(padded: dict[str, torch.Tensor], verl: dict[str, Any]) -> Any:
    """The engine's mini-batch: a TensorDict laid out as verl's `left_right_2_no_padding` lays it out (input and
    position ids jagged, `loss_mask` the response mask; the metadata it adds, which `ppo_loss` does not read, left
    out), with the trainer's temperature and `global_batch_size` and the counts `forward_backward_batch` sets on it,
    each set by verl's own `tensordict_utils`."""
    from tensordict import TensorDict

    tu = verl["losses"].tu
    fields: dict[str, torch.Tensor] = dict(padded)
    valid = padded["attention_mask"].bool()
    offsets = torch.nn.functional.pad(valid.sum(dim=1).cumsum(dim=0), (1, 0))
    for name in ("input_ids", "position_ids"):
        fields[name] = torch.nested.nested_tensor_from_jagged(padded[name][valid], offsets=offsets)
    fields["loss_mask"] = padded["response_mask"]
    data = TensorDict(fields, batch_size=[len(PROMPTS)])
    # the trainer's: global_batch_size is ppo_mini_batch_size x rollout.n, over the data-parallel group
    tu.assign_non_tensor(data, temperature=TEMPERATURE, global_batch_size=len(PROMPTS))
    batch_num_tokens = data["loss_mask"].sum()  # all-reduced over a DP group of one
    tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item(), dp_size=1)
    return data


def _engine_output(values: torch.Tensor, data: Any) -> torch.Tensor:
    """Per-token `values` [B, T] of the padded batch (column t scores token t) as the engine's model output: a jagged
    tensor over each sample's prompt + response tokens, split at the input ids' offsets, whose position t scores
    the next token (the engine's labels are the input ids rolled left by one). A sequence's last position scores
    none of its tokens: 0 there, a position `ppo_loss` never reads."""
    valid = data["attention_mask"].bool()
    scores_next = torch.nn.functional.pad(valid[:, 1:], (0, 1))
    shifted = torch.nn.functional.pad(values[:, 1:], (0, 1))
    flat = torch.where(scores_next, shifted, torch.zeros_like(shifted))[valid]
    return torch.nested.nested_tensor_from_jagged(flat, offsets=data["input_ids"].offsets())


@dataclasses.dataclass(frozen=True)
class HookStep:
    snapshot: Path  # the snapshot dir the hook wrote
    exact_norm: float  # the step's pre-clip norm in float64 (verl's clip reports it in float32)


def verl_step(verl: dict[str, Any], actor: ActorConfig, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> HookStep:
    """Train one spiking step through the hook as the patched engine calls it."""
    monkeypatch.setenv("AXRL_SPIKE_DIR", str(tmp / "spikes"))
    monkeypatch.setenv("AXRL_SPIKE_WARMUP", "3")
    monkeypatch.setenv("AXRL_SPIKE_WINDOW", "5")
    monkeypatch.setenv("AXRL_JOB_NAME", "verl-qwen3")
    spec = parse_model_config(model_section("qwen3_moe", temperature=TEMPERATURE))
    torch.manual_seed(0)
    policy = build_policy(spec)
    gen = torch.Generator().manual_seed(7)
    padded = _padded_batch(int(spec.config["vocab_size"]), gen)
    _rollout_fields(policy, padded, gen, verl)
    data = _engine_layout(padded, verl)
    loss_function = functools.partial(verl["losses"].ppo_loss, config=actor)
    engine = SimpleNamespace(
        module=policy.causal_lm,  # the HF model: its parameters are the policy's, named as transformers names them
        optimizer=torch.optim.SGD(policy.parameters(), lr=0.0),
        optimizer_config=SimpleNamespace(clip_grad=CLIP_GRAD),
        engine_config=SimpleNamespace(router_replay=SimpleNamespace(mode="disabled")),
        _autocast_dtype=torch.float32,
        _axrl_spike_batch=data,  # what the patched forward_backward_batch keeps
        _axrl_spike_loss_fn=loss_function,
    )
    hook = _load_hook()
    assert all(hook.guard_step(engine, torch.tensor(1e-3)) for _ in range(4))  # quiet steps before the spike
    log_probs, entropy = _token_logprobs(policy, padded, need_entropy=True)  # forward_backward_batch
    model_output = {"log_probs": _engine_output(log_probs, data), "entropy": _engine_output(entropy, data)}
    loss, _ = loss_function(model_output=model_output, data=data, dp_group=None)
    loss.backward()
    exact = math.sqrt(math.fsum(float(p.grad.double().pow(2).sum()) for p in policy.parameters() if p.grad is not None))
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm=CLIP_GRAD)  # optimizer_step
    assert hook.guard_step(engine, grad_norm) is False  # tripped: snapshotted and skipped
    (written,) = (tmp / "spikes").glob("iter_*")
    return HookStep(written, exact)


@pytest.fixture(scope="module")
def hook_step(verl: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> HookStep:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return verl_step(verl, ActorConfig(), tmp_path_factory.mktemp("verl-hook-step"), monkeypatch)


@pytest.fixture(scope="module")
def hook_snapshot(hook_step: HookStep) -> Path:
    return hook_step.snapshot


def test_the_snapshot_records_the_actor_s_loss_settings(hook_snapshot: Path) -> None:
    loss = yaml.safe_load((hook_snapshot / "run_config.yaml").read_text(encoding="utf-8"))["loss"]
    assert loss["convention"] == "verl" and loss["normalization"] == "global"
    assert (loss["clip_eps_low"], loss["clip_eps_high"], loss["dual_clip_c"]) == (0.2, 0.28, 2.5)
    assert (loss["loss_agg_mode"], loss["entropy_coef"]) == ("seq-mean-token-mean", 0.01)
    assert (loss["kl_coef"], loss["kl_estimator"]) == (0.05, "low_var_kl")
    assert "unreproduced" not in loss
    batch = torch.load(hook_snapshot / "batch_rank0.pt", weights_only=True)
    assert "rollout_is_weights" in batch  # the driver's rollout correction travels with the batch


def test_the_replay_reads_the_global_counts_verl_set_on_the_mini_batch(hook_snapshot: Path) -> None:
    assert "global_batch_info" not in load_grad_info(hook_snapshot, 0)
    batch = torch.load(hook_snapshot / "batch_rank0.pt", weights_only=True)
    inputs = load_inputs(hook_snapshot, hook_snapshot, legacy=False)
    assert inputs.counts == GlobalCounts(1, float(batch["response_mask"].sum()), float(len(PROMPTS)))


def test_the_hook_snapshot_replays_to_verl_s_grad_norm(hook_step: HookStep) -> None:
    result = run_replay(replay_request(What(hook_step.snapshot), how=How(nproc=1)))
    recorded, exact = result.recorded_grad_norm, hook_step.exact_norm
    trainer = load_grad_info(hook_step.snapshot, 0).get("trainer_grad_norm")
    print(f"hook snapshot: replayed {result.grad_norm!r}, recorded (float64) {recorded!r}, verl's clip {trainer!r}")
    print(f"  the step's float64 norm {exact!r}, rel_diff {result.rel_diff!r}")
    assert result.fidelity == "full" and result.verdict == "reproduced"
    assert result.grad_norm is not None and recorded is not None and result.rel_diff is not None
    assert abs(result.grad_norm - hook_step.exact_norm) <= 1e-9 * hook_step.exact_norm  # the step itself, recomputed
    # recorded in float64: only the clip's float32 multiply (at most 2^-24 per element) stands between it and the step
    assert abs(recorded - exact) <= 2**-24 * exact and result.rel_diff <= 1e-7
    assert trainer is not None and abs(trainer - exact) > abs(recorded - exact)  # verl's float32 norm, kept


def test_without_the_loss_settings_the_step_does_not_reproduce(hook_snapshot: Path, tmp_path: Path) -> None:
    cut = _edited_copy(hook_snapshot, tmp_path)
    config = yaml.safe_load((cut / "run_config.yaml").read_text(encoding="utf-8"))
    config["loss"] = {"convention": "verl"}  # what the hook wrote before it mapped the actor config
    (cut / "run_config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = run_replay(replay_request(What(cut), how=How(nproc=1)))
    print(f"loss section cut to {{convention: verl}}: rel_diff {result.rel_diff!r}, verdict {result.verdict}")
    assert result.verdict == "not_reproduced"


def test_the_recorded_parameter_norms_are_pre_clip_and_merge_to_the_global_norm(hook_snapshot: Path) -> None:
    info = load_grad_info(hook_snapshot, 0)
    assert info["clip_coef"] < 0.1  # the clip scaled the gradients the hook read
    merged = math.sqrt(math.fsum(v * v for v in info["param_grad_norms"].values()))
    assert abs(merged - info["grad_norm"]) <= 1e-12 * info["grad_norm"]  # clipped, they would merge to CLIP_GRAD
    consistency = check_snapshot(hook_snapshot)
    assert "grad_norm_vs_param_norms" in consistency.checked
    assert consistency.self_consistent, [p.message for p in consistency.problems]


def _edited_copy(snapshot: Path, dest: Path) -> Path:
    return shutil.copytree(snapshot, dest / snapshot.name)


def test_the_replay_applies_the_is_weights_verl_s_driver_recorded(hook_snapshot: Path, tmp_path: Path) -> None:
    cut = _edited_copy(hook_snapshot, tmp_path)
    batch = torch.load(cut / "batch_rank0.pt", weights_only=True)
    del batch["rollout_is_weights"]
    torch.save(batch, cut / "batch_rank0.pt")
    result = run_replay(replay_request(What(cut), how=How(nproc=1)))
    print(f"without the recorded rollout_is_weights: rel_diff {result.rel_diff!r}")
    assert result.verdict == "not_reproduced"


def test_a_loss_section_listing_unreproduced_settings_is_refused_by_name(hook_snapshot: Path, tmp_path: Path) -> None:
    from axrl_spike_replay.errors import ConfigError

    cut = _edited_copy(hook_snapshot, tmp_path)
    config = yaml.safe_load((cut / "run_config.yaml").read_text(encoding="utf-8"))
    config["loss"]["unreproduced"] = ["policy_loss.loss_mode=gspo: the verl convention reproduces the vanilla PPO loss"]
    (cut / "run_config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"loss_mode=gspo.*command backend"):
        run_replay(replay_request(What(cut), how=How(nproc=1)))


def test_fsdp_shard_norms_merge_over_the_ranks(tmp_path: Path) -> None:
    from axrl_spike_replay.testing.synthetic_snapshot import SyntheticSpec, write_synthetic_snapshot

    snapshot = write_synthetic_snapshot(tmp_path, SyntheticSpec(world_size=2, grad_norm=40.0))
    for rank, norm in ((0, 24.0), (1, 32.0)):  # each rank's shard of the reduced gradient: sqrt(24^2 + 32^2) = 40
        info = {"grad_norm": 40.0, "param_grad_norms": {"w": norm}, "param_grad_norms_kind": "reduced_shard"}
        torch.save(info, snapshot / f"grad_info_rank{rank}.pt")
    assert check_snapshot(snapshot).self_consistent
    for rank in (0, 1):  # read as local gradients before the DP mean, their mean's norm could be 28 at most
        info = torch.load(snapshot / f"grad_info_rank{rank}.pt", weights_only=True)
        del info["param_grad_norms_kind"]
        torch.save(info, snapshot / f"grad_info_rank{rank}.pt")
    assert [p.name for p in check_snapshot(snapshot).problems] == ["grad_norm_vs_param_norms"]


def test_the_trainer_s_global_step_reaches_the_engine_s_mini_batches(verl: dict[str, Any]) -> None:
    """The patched trainer sets `global_steps` on the batch it hands `update_actor`; the worker's
    `train_mini_batch` splits it with verl's own `make_iterator`, and every mini-batch the engine trains on
    carries it (a non-tensor entry, like the `global_batch_size` the loss reads)."""
    from tensordict import TensorDict

    tu = verl["losses"].tu
    batch = TensorDict({"input_ids": torch.arange(12).reshape(6, 2)}, batch_size=[6])
    tu.assign_non_tensor(batch, global_steps=41, global_batch_size=6, mini_batch_size=2, epochs=2)
    hook = _load_hook()
    steps = [hook.global_step(mini) for mini in tu.make_iterator(batch, mini_batch_size=2, epochs=2, seed=1)]
    assert steps == [41] * 6  # three mini-batches per epoch, two epochs: six optimizer updates in step 41
