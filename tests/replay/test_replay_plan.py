"""The replay's plan before anything loads: parameter counts as the model's builders and its publishers give them,
the memory per process for N processes, whether it fits, the smallest full-fidelity N and its layout; a config-only
snapshot of a 671B model is planned without a weight; a replay that cannot fit is refused with the plan, nothing
loaded or written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from axrl_spike_replay.cli import main
from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.investigation.request import How, What, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.models.policy import build_policy, parse_model_config
from axrl_spike_replay.replay.compute.process_memory import model_facts, process_memory
from axrl_spike_replay.replay.plans.replay_plan import GIB, Capacity, PlanRefused, parameter_count, plan_replay
from axrl_spike_replay.replay.reading.inputs import read_run_config
from axrl_spike_replay.testing.config_only_snapshot import DEEPSEEK_V3, QWEN3_30B_A3B, write_config_only_snapshot
from axrl_spike_replay.vocabulary import Shard

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "outputs" / "fx~fixture-moe__actor"
SNAPSHOT = FIXTURE / "checkpoints" / "spike_snapshots" / "iter_0000021"  # tiny MoE, saved world size 2
H200_NODE = Capacity("8xH200", "cuda", 8, int(141 * (1 << 30) * 0.92), "test")


@pytest.mark.parametrize(
    ("count", "text"),
    [(512, "512"), (43_790, "43.8K"), (999_600, "1M"), (1_234_567, "1.23M"), (30.53e9, "30.5B"), (671e9, "671B")],
)
def test_parameter_counts_read_as_people_write_them(count: float, text: str) -> None:
    assert parameter_count(count) == text


def one_row(rows: list) -> object:
    """The plan's row of one process."""
    return next(r for r in rows if r.nproc == 1)


def test_the_fixture_plan_counts_the_built_model_and_fits_here() -> None:
    spec = parse_model_config(read_run_config(SNAPSHOT)["model"])
    built = sum(p.numel() for p in build_policy(spec).parameters())
    plan = plan_replay(SNAPSHOT, capacity=Capacity("here", "cpu", 1, 8 << 30, "test"))
    assert plan.parameters == built and plan.world_size == 2 and plan.param_dtype == "float32"
    assert [r.nproc for r in plan.rows] == [1, 2]
    one, two = plan.rows
    assert one.fidelity == "full" and one.ranks_per_process == 2 and two.fidelity == "full"  # every saved rank
    assert one.memory.gradients == 2 * two.memory.gradients  # a second copy while the next rank's is added
    assert plan.chosen is two and plan.smallest_full_fidelity is two and plan.fits
    assert two.memory.parameters == built * 4 and two.memory.activations > 0
    assert plan.layout == "2 processes on 1 node(s), each with the whole model"
    assert f"tiny_moe (2 layers, 4 experts): {built / 1e3:.3g}K parameters (" in plan.text()  # not 4.38e-05B
    assert not two.checkpointed  # it fits: the layers keep their activations
    # below two whole processes with checkpointed layers (the smallest whole layout), nothing whole fits
    checkpointed = process_memory(model_facts(spec), 2, 2, *plan.micro_batch, sharded=False, device="cpu",
                                  checkpointed=True)  # fmt: skip
    assert checkpointed.activations < two.memory.activations
    below = Capacity("here", "cpu", 1, 2 * checkpointed.peak - 1, "test")
    tight = plan_replay(SNAPSHOT, capacity=below, shard="off")
    assert tight.fits is False and tight.smallest_full_fidelity is one_row(tight.rows)
    said = "1 processes on 1 node(s), each with the whole model, each replaying its 2 saved ranks in turn"
    assert said in tight.layout
    auto = plan_replay(SNAPSHOT, capacity=below)
    assert auto.fits and auto.chosen is not None and auto.chosen.sharded  # auto shards what does not fit whole
    assert auto.whole is not None and auto.whole.fits is False and auto.whole.checkpointed


def test_published_sizes_from_config_only_snapshots_with_no_weights(tmp_path: Path) -> None:
    qwen = write_config_only_snapshot(tmp_path / "qwen", "qwen3_moe", QWEN3_30B_A3B, world_size=64, batch=1, seq=1024)
    deepseek = write_config_only_snapshot(tmp_path / "ds", "deepseek_v3", DEEPSEEK_V3, world_size=64, batch=1, seq=1024)
    assert not list(qwen.glob("*.distcp")) and not list(deepseek.glob("*.distcp"))
    q = plan_replay(qwen, device="cuda", capacity=H200_NODE)
    d = plan_replay(deepseek, device="cuda", capacity=H200_NODE)
    assert q.parameters == pytest.approx(30.5e9, rel=0.01)  # the model card: 30.5B in total
    assert d.parameters == pytest.approx(671e9, rel=0.01)  # DeepSeek-V3's paper: 671B (without the MTP module)
    assert q.param_dtype == d.param_dtype == "bfloat16" and q.tokens_per_rank == 1024
    whole = plan_replay(qwen, device="cuda", capacity=H200_NODE, shard="off").chosen
    assert whole is not None and not whole.fits and whole.processes_per_device == 8
    assert whole.memory.parameters == q.parameters * 2  # bfloat16, the whole model in each process
    sharded = q.chosen
    assert sharded is not None and sharded.sharded and sharded.memory.parameters < whole.memory.parameters / 16
    # with its decoder layers checkpointed (their activations recomputed in the backward), 8 sharded processes per GPU
    assert sharded.fits and sharded.checkpointed and sharded.nproc == 64 and sharded.processes_per_device == 8
    assert "64 processes (1 node(s) x 64), 8 per GPU, sharded over them (FSDP2)" in q.layout
    assert "decoder layers checkpointed" in q.text() and "attention eager; the head in chunks of 441 tokens" in q.text()
    assert d.chosen is not None and d.chosen.fits is False and d.smallest_full_fidelity is None
    # no layout holding the whole step fits the node; one decoder layer at a time does, so auto streams
    assert d.streams and d.fits and d.streamed is not None and "streamed" in d.layout
    held = plan_replay(deepseek, device="cuda", capacity=H200_NODE, shard="on")
    assert held.fits is False and "no layout holding the whole step fits; streamed" in held.layout
    assert "full fidelity needs 8 node(s) like 8xH200 (64 processes, 1 per GPU" in held.layout
    assert "671B parameters" in d.text() and "DOES NOT FIT" in d.text()


def test_a_replay_that_cannot_fit_is_refused_before_loading_with_the_plan(tmp_path: Path) -> None:
    big = write_config_only_snapshot(tmp_path / "snap", "qwen3_moe", QWEN3_30B_A3B, world_size=2, batch=1, seq=64)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    with pytest.raises(PlanRefused) as caught:  # whole or sharded: `auto` would stream it (one layer fits here)
        run_request(replay_request(What(big), how=How(shard=Shard.ON), workspace=workspace))
    message = str(caught.value)
    assert "does not fit where it would run, so nothing was loaded" in message
    assert "qwen3_moe (48 layers, 128 experts, top-8): 30.5B parameters" in message and "DOES NOT FIT" in message
    assert caught.value.plan.chosen is not None and caught.value.plan.chosen.nproc == 2
    assert list(workspace.iterdir()) == []  # no run dir, no task row


def test_the_plan_verb_describes_a_node_and_says_it_as_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    snap = write_config_only_snapshot(tmp_path / "q", "qwen3_moe", QWEN3_30B_A3B, world_size=16, batch=1, seq=256)
    assert main(["plan", str(snap), "--gpus", "8", "--gpu-memory", "141", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["capacity"]["devices"] == 8 and doc["capacity"]["device"] == "cuda" and doc["world_size"] == 16
    assert doc["chosen"]["nproc"] == 16 and doc["chosen"]["processes_per_device"] == 2
    assert doc["fits"] is True and doc["smallest_full_fidelity"]["nproc"] == 16
    assert "16 processes (1 node(s) x 16), 2 per GPU" in doc["layout"]
    assert main(["plan", str(snap), "--gpus", "8"]) == 2
    assert "give --gpus and --gpu-memory together" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("gpus", "memory", "says"),
    [
        ("1", "inf", "--gpu-memory must be a number of GiB above 0 and at most 65536, got inf"),
        ("1", "1e300", "--gpu-memory must be a number of GiB above 0 and at most 65536, got 1e+300"),
        ("1", "nan", "--gpu-memory must be a number of GiB above 0 and at most 65536, got nan"),
        ("1000000000000", "80", "--gpus must be a whole number from 1 to 4096, got 1000000000000"),
        ("9" * 400, "80", "--gpus must be a whole number from 1 to 4096, got an integer of 400 digits"),
        ("0", "80", "--gpus must be a whole number from 1 to 4096, got 0"),
    ],
)
def test_a_described_node_out_of_bounds_is_an_exit_2_message(
    gpus: str, memory: str, says: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["plan", str(SNAPSHOT), "--gpus", gpus, "--gpu-memory", memory]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_bad_plan_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="`nproc` 3: give 1 to the saved world size 2"):
        plan_replay(SNAPSHOT, nproc=3)
    with pytest.raises(ConfigError, match="`shard` must be on, off, auto or streamed"):
        plan_replay(SNAPSHOT, shard="maybe")
    assert model_facts(parse_model_config(read_run_config(SNAPSHOT)["model"])).top_k == 2


def test_plan_against_a_slurm_entry_from_its_gpus_per_node(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    snap = write_config_only_snapshot(tmp_path / "q", "qwen3_moe", QWEN3_30B_A3B, world_size=64, batch=1, seq=1024)
    ws = tmp_path / "ws"
    ws.mkdir()
    entry = {"login": "local", "partition": "gpu", "nodes": 2, "gpus_per_node": 8}
    (ws / "spike-replay.yaml").write_text(json.dumps({"slurm": {"hpc": entry}}))  # JSON is YAML
    argv = ["plan", str(snap), "--target", "hpc", "--workspace", str(ws), "--json"]
    assert main([*argv, "--gpu-memory", "141"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["capacity"]["devices"] == 8 and doc["fits"] is True and doc["chosen"]["processes_per_device"] == 4
    assert doc["layout"].startswith("64 processes (2 node(s) x 32), 4 per GPU, sharded over them (FSDP2)")
    assert "Slurm entry 'hpc': 2 node(s) of the GPUs described" in doc["notes"]
    assert main(argv) == 0  # without the GPUs' memory: nothing judged, and said why
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is None and "the GPUs' memory is known only once the job runs" in doc["notes"][0]


def test_a_sharded_process_counts_what_fsdp2_gathers(tmp_path: Path) -> None:
    """Qwen3-30B-A3B sharded over 64: its shards, the root's own parameters (the final norm: embeddings and head
    are units of their own), and in the backward three of its largest unit at once."""
    from axrl_spike_replay.replay.compute.process_memory import process_memory

    qwen = write_config_only_snapshot(tmp_path / "qwen", "qwen3_moe", QWEN3_30B_A3B, world_size=64, batch=1, seq=1024)
    facts = model_facts(parse_model_config(read_run_config(qwen)["model"]))
    hidden, vocab = QWEN3_30B_A3B["hidden_size"], QWEN3_30B_A3B["vocab_size"]
    assert facts.root == hidden  # model.norm.weight
    layer = facts.largest_unit
    assert layer > vocab * hidden  # a decoder layer of 128 experts outweighs the embedding
    m = process_memory(facts, 64, 64, 1, 1024, sharded=True, device="cuda")
    assert m.parameters == -(-facts.parameters * 2 // 64) + hidden * 2
    assert m.gathered == 3 * layer * 2 and m.held_gradients == 0
    whole = process_memory(facts, 64, 64, 1, 1024, sharded=False, device="cuda")
    assert whole.gathered == 0 and m.activations == whole.activations
    assert m.step == m.runtime + m.parameters + max(m.activations, m.gradients + m.gathered)


def test_a_recorded_mixed_precision_policy_plans_float32_master_shards_and_bf16_compute(tmp_path: Path) -> None:
    """verl's defaults (bf16 parameters, fp32 reduction) recorded in the snapshot: sharded, each process holds
    float32 master shards and float32 gradient sums, and computes in bf16; the same model with no policy recorded
    replays in its own bf16 throughout. The plan says which."""
    import yaml

    plain = write_config_only_snapshot(tmp_path / "plain", "qwen3_moe", QWEN3_30B_A3B, world_size=64, batch=1, seq=1024)
    mixed = write_config_only_snapshot(tmp_path / "mixed", "qwen3_moe", QWEN3_30B_A3B, world_size=64, batch=1, seq=1024)
    run_config = mixed / "run_config.yaml"
    doc = yaml.safe_load(run_config.read_text())
    doc["precision"] = {"param_dtype": "bf16", "reduce_dtype": "fp32"}
    run_config.write_text(yaml.safe_dump(doc))
    before, after = (plan_replay(s, capacity=None, shard="on") for s in (plain, mixed))  # nothing checkpointed
    assert before.param_dtype == "bfloat16" and before.grad_dtype == "bfloat16"
    assert after.param_dtype.startswith("bfloat16, float32 master") and after.grad_dtype == "float32"
    p = after.parameters
    one, other = after.chosen.memory, before.chosen.memory
    assert one.parameters - other.parameters == -(-p * 4 // 64) - -(-p * 2 // 64)  # master shards twice as wide
    assert one.gradients - other.gradients == -(-p * 4 // 64) - -(-p * 2 // 64)
    assert one.activations == other.activations  # bf16 compute both ways
    layer = model_facts(parse_model_config(read_run_config(mixed)["model"])).largest_unit
    assert one.gathered == layer * (2 * 2 + 4) and other.gathered == 3 * layer * 2  # the reduce-scatter in fp32
    whole_mixed = plan_replay(mixed, capacity=H200_NODE, shard="off").chosen.memory
    whole_plain = plan_replay(plain, capacity=H200_NODE, shard="off").chosen.memory
    assert whole_mixed.parameters == whole_plain.parameters  # held in bf16 once cast
    assert whole_mixed.gradients == 2 * whole_plain.gradients  # the sums in float32
    assert whole_mixed.loading == 2 * whole_plain.loading  # built and filled in float32, then cast
    bad = yaml.safe_load(run_config.read_text())
    bad["precision"] = {"param_dtype": "int4"}
    run_config.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match=r"precision\.param_dtype must be one of"):
        plan_replay(mixed, capacity=H200_NODE)


def test_a_math_rl_rank_of_qwen3_30b_replays_at_full_fidelity_on_one_8xh200_node(tmp_path: Path) -> None:
    """Qwen3-30B-A3B saved at world size 64, 8 x 8,192 tokens per rank in micro-batches of one sequence, sdpa: 8
    sharded processes, each replaying its 8 saved ranks in turn, is full fidelity (every saved rank, the same
    data-parallel mean over all 64) and fits one 8xH200 node under 128 GiB per GPU; so does one process per saved
    rank, which the plan suggests."""
    qwen = write_config_only_snapshot(
        tmp_path / "q", "qwen3_moe", QWEN3_30B_A3B, world_size=64, batch=8, seq=8192, attention="sdpa", micro_batches=8
    )
    plan = plan_replay(qwen, nproc=8, device="cuda", capacity=H200_NODE)
    row = plan.chosen
    assert row is not None and row.nproc == 8 and row.ranks_per_process == 8 and row.sharded
    assert row.fidelity == "full" and row.fits and row.per_device < 128 * GIB
    assert "requested: 8 process(es), full fidelity, sharded (FSDP2)" in plan.text()
    assert plan.micro_batch == (1, 8192) and plan.tokens_per_rank == 8 * 8192
    suggested = plan.smallest_full_fidelity
    assert suggested is not None and suggested.nproc == 64 and suggested.fits and suggested.fidelity == "full"
