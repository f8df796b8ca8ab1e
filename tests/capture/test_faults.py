"""The fault-injection hook: each built-in fault corrupts its part, on its ranks and samples, during the burst only;
a fault of the user's own runs in the reference trainer; a hidden run's snapshots do not name the fault."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
import yaml

from axrl_spike_replay.capture.fault_injection.faults import FAULT_KINDS, StepParts, apply_faults, make_fault
from axrl_spike_replay.capture.reference.presets import FAMILY_PRESETS, FAULT_FAMILIES, PRESETS, FaultSpec
from axrl_spike_replay.capture.reference.reference_trainer import HIDDEN_PRESET, capture_reference_run
from axrl_spike_replay.diagnosis.families import FAMILIES
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.snapshot.metadata import read_metadata
from axrl_spike_replay.snapshot.rank_data import load_rank_batch
from axrl_spike_replay.testing.fault_matrix import capture_command, family_id, matrix_cases

B, T, P = 4, 10, 4  # samples, sequence length, prompt length


def parts(stage: str, *, rank: int = 1, world_size: int = 2, in_burst: bool = True) -> StepParts:
    g = torch.Generator().manual_seed(0)
    batch = {
        "tokens": torch.randint(0, 16, (B, T), generator=g),
        "loss_mask": torch.cat([torch.zeros(B, P), torch.ones(B, T - P)], dim=1),
        "rollout_logprobs": -torch.rand(B, T, generator=g) * 5,
        "old_logprobs": -torch.rand(B, T, generator=g) * 5,
        "ref_logprobs": -torch.rand(B, T, generator=g) * 5,
        "rewards": torch.rand(B, generator=g),
        "advantages": torch.randn(B, generator=g),
    }
    routes = torch.randint(0, 4, (B, T, 2, 2), generator=g)
    return StepParts(stage, 20, rank, world_size, in_burst, P, batch, routes, previous=None, generator=g)


def test_the_fault_families_are_the_diagnosis_families_and_each_has_its_preset() -> None:
    assert FAULT_FAMILIES == FAMILIES
    assert set(FAMILY_PRESETS) == set(FAMILIES)
    for family, name in FAMILY_PRESETS.items():
        preset = PRESETS[name]
        assert preset.family == family and preset.injected is not None
        assert preset.injected.kind in FAULT_KINDS


def test_every_matrix_case_builds_and_held_out_faults_are_kinds_no_preset_uses() -> None:
    used_by_presets = {p.injected.kind for p in PRESETS.values() if p.injected is not None}
    for case in matrix_cases():
        assert case.family in FAMILIES
        for spec in case.specs():
            make_fault(spec)
        if case.provenance not in ("preset", "variant"):
            assert {s.kind for s in case.faults}.isdisjoint(used_by_presets), case.name


def test_a_shifted_old_logprob_fault_moves_only_the_last_rank_in_the_burst() -> None:
    fault = make_fault(FaultSpec("logprob_shift", ranks=(-1,), params={"signal": "old_logprobs"}))
    hit = parts("batch", rank=1)
    before = hit.batch["old_logprobs"].clone()
    apply_faults([fault], hit)
    assert torch.equal(hit.batch["old_logprobs"][:, 1:], before[:, :-1])
    assert torch.equal(hit.batch["ref_logprobs"], parts("batch").batch["ref_logprobs"])  # the other signal is left
    for spared in (parts("batch", rank=0), parts("batch", rank=1, in_burst=False), parts("rollout", rank=1)):
        before = spared.batch["old_logprobs"].clone()
        apply_faults([fault], spared)
        assert torch.equal(spared.batch["old_logprobs"], before)


def test_reward_faults_hit_only_their_samples() -> None:
    nan = parts("rewards")
    apply_faults([make_fault(FaultSpec("reward_nan", ranks=(1,), samples=(2,)))], nan)
    assert [math.isnan(float(x)) for x in nan.batch["rewards"]] == [False, False, True, False]
    scaled = parts("rewards")
    before = scaled.batch["rewards"].clone()
    apply_faults([make_fault(FaultSpec("reward_scale", samples=(0,), params={"factor": 100.0}))], scaled)
    assert torch.allclose(scaled.batch["rewards"][0], before[0] * 100) and torch.equal(
        scaled.batch["rewards"][1:], before[1:]
    )


def test_a_mask_fault_takes_prompt_positions_into_the_loss_where_the_stored_logprobs_are_padding() -> None:
    step = parts("batch")
    apply_faults([make_fault(FaultSpec("mask_shift", params={"shift": 2}))], step)
    mask = step.batch["loss_mask"]
    assert mask[:, P - 2 : P].eq(1).all()  # two prompt tokens now count
    assert step.batch["old_logprobs"][:, :P].eq(0).all() and step.batch["ref_logprobs"][:, :P].eq(0).all()


def routes(step: StepParts) -> torch.Tensor:
    assert step.routed_experts is not None
    return step.routed_experts


def test_route_faults_change_the_payload_of_their_rank() -> None:
    step = parts("rollout")
    before = routes(step).clone()
    apply_faults([make_fault(FaultSpec("routes_permuted", ranks=(1,)))], step)
    assert torch.equal(routes(step), torch.roll(before, 1, dims=0))
    step = parts("rollout", rank=0)
    apply_faults([make_fault(FaultSpec("routes_shift", ranks=(1,)))], step)
    assert torch.equal(routes(step), routes(parts("rollout", rank=0)))


def test_a_bad_fault_spec_is_refused_with_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match=r"fault kind 'nope' is not known \(known: .*logprob_shift"):
        make_fault(FaultSpec("nope"))
    with pytest.raises(ConfigError, match=r"--fault 1: `ranks` must be a list of integers"):
        FaultSpec.from_dict({"kind": "reward_nan", "ranks": "1"}, "--fault 1")
    with pytest.raises(ConfigError, match=r"unknown keys \['rank'\]"):
        FaultSpec.from_dict({"kind": "reward_nan", "rank": [1]})
    assert FaultSpec.from_dict({"kind": "reward_nan", "samples": [5]}) == FaultSpec("reward_nan", samples=(5,))


def test_earlier_cause_ids_read_as_their_family() -> None:
    assert family_id("logprob_mismatch") == "engine_mismatch" and family_id("one_rank") == "one_rank_data"
    assert family_id("stale_old_logprobs") == "stale_old_logprobs"


def test_the_matrix_case_command_line_plants_the_same_faults() -> None:
    case = next(c for c in matrix_cases(("held_out",)) if c.name == "held_out:old_logprobs_out_of_order")
    line = capture_command(case, "/tmp/m", model="olmoe", seed=3)
    assert "--preset peaked --model olmoe --hide-fault --fault" in line and "--seed 3" in line
    spec = json.loads(line.split("--fault ")[1].strip("'"))
    assert FaultSpec.from_dict(spec) == case.faults[0]


@dataclass(frozen=True)
class BrokenVerifier:
    """A fault of the user's own (as in the module doc): a verifier that returns -7 on rank 0 during the burst."""

    stage: str = "rewards"
    part: str = "rewards"

    def __call__(self, parts: StepParts) -> None:
        if parts.in_burst and parts.rank == 0:
            parts.batch["rewards"] = parts.batch["rewards"] * 0 - 7.0


@pytest.mark.slow
def test_a_users_own_fault_runs_in_the_trainer_and_a_hidden_run_does_not_name_it(tmp_path) -> None:
    run = capture_reference_run(
        tmp_path,
        preset="peaked",
        steps=22,
        faults=[BrokenVerifier()],
        hide_fault=True,
        overrides={"train": {"burst": [21], "advantage_estimator": "reinforce_baseline"}},
    )
    assert 21 in run.spike_iterations
    snapshot = next(p for p in run.snapshot_dirs if read_metadata(p)[0].iteration == 21)
    assert torch.equal(load_rank_batch(snapshot, 0)["rewards"], torch.full((8,), -7.0))
    recorded = yaml.safe_load((snapshot / "run_config.yaml").read_text())
    assert recorded["train"]["preset"] == HIDDEN_PRESET and recorded["train"]["fault"] == {}
    log = run.log_path.read_text()
    assert "peaked" not in log and "BrokenVerifier" not in log
    assert run.config["train"]["fault"]["planted"] == [
        {"type": "BrokenVerifier", "stage": "rewards", "part": "rewards"}
    ]


def test_capture_refuses_a_bad_fault_before_training(tmp_path, cli) -> None:
    run = cli("capture", "--out", tmp_path, "--preset", "peaked", "--fault", '{"kind": "nope"}')
    assert run.code != 0 and "fault kind 'nope' is not known" in run.err
    run = cli("capture", "--out", tmp_path, "--preset", "peaked", "--fault", "{kind")
    assert run.code == 2 and "--fault 1 is not valid JSON" in run.err
    run = cli("capture", "--out", tmp_path, "--fault", '{"kind": "reward_nan"}', "--preset", "none")
    assert run.code != 0 and "preset none has none" in run.err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (
            '{"kind": "logprob_shift", "params": {"signal": "../../etc/passwd"}}',
            "fault logprob_shift: `params.signal` must be one of old_logprobs, ref_logprobs, got '../../etc/passwd'",
        ),
        ('{"kind": "logprob_scale", "params": {"factor": 1e999}}', "`params.factor` must be a number from -1e+09"),
        ('{"kind": "mask_shift", "params": {"shift": 0}}', "`params.shift` must be a whole number from 1 to 65536"),
        ('{"kind": "routes_stale_layer", "params": {"fraction": 2}}', "`params.fraction` must be a number from 0 to 1"),
        (
            '{"kind": "reward_nan", "params": {"factor": 2}}',
            "fault reward_nan: unknown params ['factor'] (known: none)",
        ),
        ('{"kind": "loss_setting", "params": {"aux_loss_cof": 2}}', "['aux_loss_cof'] are no loss settings"),
        ('{"kind": "loss_setting", "params": {"aux_loss_coef": -1}}', "aux_loss_coef must be a finite number >= 0"),
        ('{"kind": "reward_nan", "ranks": [' + "1," * 5000 + "1]}", "`ranks` must be a list of integers (at most"),
        ('{"kind": "reward_nan", "params": {"x": ' + "[" * 3000 + "]" * 3000 + "}}", "nests deeper than 8 levels"),
        ('{"kind": "reward_nan", "ranks": [1' + "0" * 400 + "]}", "holds an integer of 401 digits"),
    ],
)
def test_a_hostile_fault_spec_is_an_exit_2_message_before_training(tmp_path, cli, spec: str, says: str) -> None:
    """Each spec is checked when it is parsed: once a bad `signal` ran the whole run up to the burst, then raised a
    KeyError, and 3,000 nested brackets raised a RecursionError."""
    run = cli("capture", "--out", tmp_path, "--preset", "peaked", "--steps", "2", "--fault", spec)
    assert run.code == 2 and says in run.err, run.err
    assert len(run.err) < 1000 and not any(tmp_path.iterdir())


def test_every_built_in_fault_spec_the_project_ships_passes_its_checks() -> None:
    shipped = [p.injected for p in PRESETS.values() if p.injected is not None]
    shipped += [spec for case in matrix_cases() for spec in case.faults]
    assert len(shipped) > 10
    for spec in shipped:
        make_fault(spec)


class Grads(torch.nn.Module):
    """A stand-in for a rank trainer: a policy whose parameters are named as our tiny_moe's, with gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.ModuleDict(
            {"blocks": torch.nn.ModuleList([torch.nn.ModuleDict({"qkv": torch.nn.Linear(2, 2)}) for _ in range(2)])}
        )
        for p in self.model.parameters():
            p.grad = torch.ones_like(p)


def grads_of(trainer: Grads) -> dict[str, float]:
    return {name: float(p.grad.abs().max()) for name, p in trainer.model.named_parameters() if p.grad is not None}


def test_unrecorded_gradient_faults_scale_their_rank_s_gradients_whole_or_by_layer() -> None:
    whole, layer = Grads(), Grads()
    step = parts("gradients", rank=1)
    step.trainer = whole
    apply_faults([make_fault(FaultSpec("grad_scale", ranks=(1,), params={"factor": 4.0}))], step)
    assert set(grads_of(whole).values()) == {4.0}
    step.trainer = layer
    apply_faults([make_fault(FaultSpec("layer_grad_scale", ranks=(1,), params={"layers": [1], "factor": 8.0}))], step)
    assert grads_of(layer) == {
        "blocks.0.qkv.weight": 1.0, "blocks.0.qkv.bias": 1.0, "blocks.1.qkv.weight": 8.0, "blocks.1.qkv.bias": 8.0
    }  # fmt: skip
    spared = Grads()
    other = parts("gradients", rank=0)
    other.trainer = spared
    apply_faults([make_fault(FaultSpec("grad_scale", ranks=(1,), params={"factor": 4.0}))], other)
    assert set(grads_of(spared).values()) == {1.0}


def test_a_stored_batch_fault_changes_what_is_stored_and_not_what_was_trained() -> None:
    fault = make_fault(FaultSpec("stored_advantages_before_scale", ranks=(1,), params={"factor": 10.0}))
    trained = parts("advantages")
    before = trained.batch["advantages"].clone()
    apply_faults([fault], trained)
    assert torch.allclose(trained.batch["advantages"], before * 10)
    stored = parts("stored")
    stored.batch["advantages"] = trained.batch["advantages"].clone()
    apply_faults([fault], stored)
    assert torch.allclose(stored.batch["advantages"], before)
    stale = parts("stored")
    stale.previous = {**parts("batch", rank=0).batch, "tokens": torch.zeros(B, T, dtype=torch.long)}
    apply_faults([make_fault(FaultSpec("stored_batch_previous", ranks=(1,)))], stale)
    assert stale.batch["tokens"].eq(0).all()


def test_an_unrecorded_fault_spec_is_checked_and_a_gradient_fault_is_refused_under_fsdp(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"fault grad_scale: `params.factor` must be a number"):
        make_fault(FaultSpec("grad_scale", params={"factor": -1.0}))
    with pytest.raises(ConfigError, match=r"family_grad_sum: `params.family` must be one of experts"):
        make_fault(FaultSpec("family_grad_sum", params={"family": "nope"}))
    with pytest.raises(ConfigError, match=r"FSDP never holds whole"):
        capture_reference_run(
            tmp_path,
            world_size=2,
            steps=2,
            preset="peaked",
            parallel="fsdp",
            faults=[make_fault(FaultSpec("grad_scale"))],
        )
