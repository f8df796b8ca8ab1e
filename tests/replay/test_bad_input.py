"""Bad input gets a clear error that names the file or argument, and no result file that looks complete."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from axrl_spike_replay.errors import AxrlError, ConfigError, SnapshotError
from axrl_spike_replay.investigation.request import How, What, Where, replay_request
from axrl_spike_replay.investigation.runs import run_request
from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.snapshot.layout import AXRL_METADATA, RUN_CONFIG
from axrl_spike_replay.workspace.task_record.task_state import show_task
from hostile_snapshot import declare_checkpoint_tensor, edit_routing_payload


def nothing_written(workspace: Path) -> bool:
    return not (workspace / "tmp").exists()


def edit_yaml(path: Path, change: Callable[[dict], None]) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))


def test_rank_files_that_do_not_match_the_world_size(snapshot_copy: Callable[[], Path], workspace: Path) -> None:
    snap = snapshot_copy()
    (snap / "batch_rank1.pt").unlink()
    with pytest.raises(SnapshotError, match=r"saved world size is 2 but missing batch_rank<r>.pt for ranks \[1\]"):
        run_request(replay_request(What(snap), workspace=workspace))
    snap = snapshot_copy()
    for kind in ("batch", "grad_info"):
        (snap / f"{kind}_rank2.pt").write_bytes((snap / f"{kind}_rank1.pt").read_bytes())
    with pytest.raises(SnapshotError, match=r"unexpected batch files for ranks \[2\]"):
        run_request(replay_request(What(snap), workspace=workspace))
    assert nothing_written(workspace)


def test_missing_routing_payload_while_routing_replay_is_on(snapshot_copy: Callable[[], Path], workspace: Path) -> None:
    snap = snapshot_copy()
    (snap / "routing_payload_rank1.pt").unlink()
    with pytest.raises(SnapshotError, match=r"routing replay is 'all' \(the saved config\) but ranks \[1\] have no"):
        run_request(replay_request(What(snap), how=How(nproc=1), workspace=workspace))
    # a mitigation cannot stand in for the baseline, which replays the recorded routes
    with pytest.raises(SnapshotError, match=r"routing_payload_rank<r>\.pt"):
        run_request(
            replay_request(
                What(snap, mitigations={"routing_replay": "off"}),
                how=How(nproc=1),
                workspace=workspace,
            )
        )
    assert nothing_written(workspace)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["loss"].update(clip_ratio=0.2), r"loss: unknown keys \['clip_ratio'\]"),
        (lambda d: d["model"].update(rope_theta=1e4), r"model: unknown keys \['rope_theta'\]"),
        (lambda d: d["routing"].update(mode="all"), r"routing: unknown keys \['mode'\]"),
        (lambda d: d["parallel"].update(vpp=2), r"parallel: unknown keys \['vpp'\]"),
        (lambda d: d.update(optimizer={"lr": 1}), r"unknown sections \['optimizer'\]"),
        (lambda d: d["model"].update(kind="megatron_gpt"), r"'megatron_gpt' is not built in"),
        (lambda d: d.pop("loss"), r"section 'loss' is missing"),
    ],
)
def test_config_keys_the_engine_does_not_know(
    snapshot_copy: Callable[[], Path], workspace: Path, change: Callable[[dict], None], message: str
) -> None:
    snap = snapshot_copy()
    edit_yaml(snap / RUN_CONFIG, change)
    with pytest.raises(ConfigError, match=message):
        run_request(replay_request(What(snap), workspace=workspace))
    assert nothing_written(workspace)


def test_layouts_the_torch_backend_cannot_rebuild_point_to_the_command_backend(
    snapshot_copy: Callable[[], Path], workspace: Path
) -> None:
    snap = snapshot_copy()
    meta = json.loads((snap / AXRL_METADATA).read_text())
    meta["parallel"].update(tp=2, world_size=4)
    (snap / AXRL_METADATA).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"tp=2.*`backend` command"):
        run_request(replay_request(What(snap), workspace=workspace))
    assert nothing_written(workspace)


@pytest.mark.parametrize(
    ("what", "how", "message"),
    [
        ({}, How(nproc=3), "`nproc` 3 is larger than the saved world size 2"),
        ({"repeat": 0}, How(), "`repeat` must be an integer from 1 to 100, got 0"),
        ({}, How(device="tpu"), "`device` must be one of cpu, cuda"),  # type: ignore[arg-type]
        ({"mitigations": {"advantage_clamp": 1}}, How(), "valid mitigations:"),
        ({"mitigations": {"advantage_clip": "big"}}, How(), "advantage_clip: expected a number"),
        ({"mitigations": {"current_routing_layers": [5]}}, How(), r"\[5\] are not MoE layers"),
        ({"mitigations": {"initial_model": "/nonexistent/ckpt"}}, How(), "is not a directory"),
    ],
)
def test_bad_options(spike_snapshot: Path, workspace: Path, what: dict, how: How, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_request(replay_request(What(spike_snapshot, **what), how=how, workspace=workspace))
    assert nothing_written(workspace)


@pytest.mark.parametrize(
    ("what", "where", "how", "message"),
    [
        ({"verb": "sweep", "configs": [{"advantage_clip": 1}]}, {}, How(), "a sweep runs on the built-in `backend`"),
        ({"mitigations": {"advantage_clip": 1}}, {}, How(), "mitigations run on the built-in `backend` torch"),
        ({}, {"target": "gpu-node"}, How(), "megatron runs Megatron-core's GPTModel here, on CPU; a `target` runs"),
        ({}, {}, How(device="cuda"), "local spec on CPU here; use `device` cpu"),
        ({}, {}, How(), r"model kind megatron\); .* holds a model of kind tiny_moe: replay it with the built-in"),
    ],
)
def test_what_the_megatron_backend_does_not_do_is_refused_by_name(
    spike_snapshot: Path, workspace: Path, what: dict, where: dict, how: How, message: str
) -> None:
    """`backend` megatron (route 2 of a Megatron snapshot) replays a Megatron snapshot's baseline here, on CPU."""
    with pytest.raises(ConfigError, match=message):
        run_request(
            replay_request(What(spike_snapshot, **what), Where(backend="megatron", **where), how, workspace=workspace)
        )
    assert nothing_written(workspace)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_on_a_machine_without_it(spike_snapshot: Path, workspace: Path) -> None:
    with pytest.raises(ConfigError, match="CUDA is not available on this machine"):
        run_request(replay_request(What(spike_snapshot), how=How(device="cuda"), workspace=workspace))
    assert nothing_written(workspace)


def test_a_mitigation_needing_a_field_the_batch_lacks(snapshot_copy: Callable[[], Path], workspace: Path) -> None:
    snap = snapshot_copy()
    for rank in (0, 1):
        batch = torch.load(snap / f"batch_rank{rank}.pt", weights_only=True)
        del batch["ref_logprobs"]
        torch.save(batch, snap / f"batch_rank{rank}.pt")
    with pytest.raises(ConfigError, match="the saved config: the rank batches have no 'ref_logprobs'"):
        run_request(replay_request(What(snap), workspace=workspace))  # the saved loss has kl_coef > 0
    assert nothing_written(workspace)


def _expert_past_the_model(doc: dict) -> None:
    doc["routed_experts"] = doc["routed_experts"].masked_fill(doc["routed_experts"] == 1, 4)  # 4 experts: 0-3


def test_zeroed_weights_of_the_right_size_are_refused_before_anything_is_written(
    snapshot_copy: Callable[[], Path], workspace: Path
) -> None:
    snap = snapshot_copy()
    for shard in snap.glob("*.distcp"):
        shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(SnapshotError, match=r"__0_0\.distcp \(entry of 'model\..*not a torch archive"):
        run_request(replay_request(What(snap), workspace=workspace))
    assert nothing_written(workspace)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_replay_that_fails_midway_records_a_failed_result(
    snapshot_copy: Callable[[], Path], workspace: Path, nproc: int
) -> None:
    snap = snapshot_copy()
    open_task(workspace, "fixture-moe", snap)

    def rewritten_under_the_replay(line: str) -> None:
        # the payload read sound when the replay checked its inputs; it is rewritten before the processes read it
        # (shared storage changing under a run): the process's own check finds it, after the output dir exists
        if line.startswith("replaying "):
            edit_routing_payload(snap, 1, _expert_past_the_model)

    with pytest.raises(AxrlError, match=r"replay failed: .*routing_payload_rank1\.pt: routed_experts holds") as err:
        run_request(
            replay_request(What(snap), how=How(nproc=nproc), workspace=workspace, progress=rewritten_under_the_replay)
        )
    assert "Traceback" not in str(err.value)
    [run_dir] = (workspace / "tmp" / "spike-replay" / "fixture-moe").iterdir()
    doc = json.loads((run_dir / "replay_result.json").read_text())
    assert doc["verdict"] == "failed" and doc["grad_norm"] is None and "routing_payload_rank1.pt" in doc["error"]
    assert "failed" in (run_dir / "replay.log").read_text()
    failed = show_task(workspace, "fixture-moe").failed
    assert len(failed) == 1 and "expert id" in failed[0]["reason"]
    assert failed[0]["result_path"] == str(run_dir / "replay_result.json")


def test_a_failed_sweep_records_one_failed_result_for_the_run(
    snapshot_copy: Callable[[], Path], workspace: Path
) -> None:
    snap = snapshot_copy()

    def rewritten_under_the_sweep(line: str) -> None:  # as above: sound when checked, broken when read
        if line.startswith("replaying "):
            edit_routing_payload(snap, 0, _expert_past_the_model)

    with pytest.raises(AxrlError, match="sweep failed"):
        run_request(
            replay_request(
                What(snap, verb="sweep", configs=[{"advantage_clip": 1}, {"kl_coef": 0}]),
                how=How(nproc=1),
                workspace=workspace,
                progress=rewritten_under_the_sweep,
            )
        )
    [run_dir] = (workspace / "tmp" / "spike-replay" / "fixture-moe").iterdir()
    doc = json.loads((run_dir / "replay_result.json").read_text())
    assert (doc["config_id"], doc["verdict"], doc["grad_norm"], doc["mitigations"]) == ("sweep", "failed", None, {})
    assert not (run_dir / "sweep_result.json").exists()
    assert "--mitigation advantage_clip=1.0 --mitigation kl_coef=0.0" in (run_dir / "command.txt").read_text()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_initial_model_weights_that_do_not_fit_the_model(spike_snapshot: Path, workspace: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from axrl_spike_replay.models.tiny_moe import TinyMoEConfig, TinyMoEPolicy

    other = TinyMoEPolicy(TinyMoEConfig(d_model=8, n_heads=2, d_ff=16))
    dcp.save({f"model.{k}": v for k, v in other.state_dict().items()}, checkpoint_id=str(tmp_path / "w"), no_dist=True)
    with pytest.raises(SnapshotError, match=r"initial_model does not fit the run config's model: .*model needs"):
        run_request(
            replay_request(
                What(spike_snapshot, mitigations={"initial_model": str(tmp_path / "w")}),
                workspace=workspace,
            )
        )
    assert nothing_written(workspace)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["model"].update(d_model="32"), r"model\.d_model must be an integer, got str '32'"),
        (lambda d: d["model"].update(n_heads=0), r"model\.n_heads must be in \[1, 1024\], got 0"),
        (lambda d: d["model"].update(n_layers=3_000_000), r"model\.n_layers must be in \[1, 1024\], got 3000000"),
        (lambda d: d["model"].update(moe_layers="ab"), r"model\.moe_layers must be a list of layer ids"),
        (lambda d: d["parallel"].update(world_size="2"), r"parallel\.world_size must be an integer"),
        (lambda d: d["loss"].update(clip_eps_low=[1]), r"clip_eps_low must be a finite number"),
    ],
)
def test_run_config_values_of_the_wrong_type_or_size(
    snapshot_copy: Callable[[], Path], workspace: Path, cli, change: Callable[[dict], None], message: str
) -> None:
    snap = snapshot_copy()
    edit_yaml(snap / RUN_CONFIG, change)
    with pytest.raises(ConfigError, match=message):
        run_request(replay_request(What(snap), workspace=workspace))
    run = cli("replay", snap, "--workspace", workspace)
    assert run.code == 2 and str(snap / RUN_CONFIG) in run.err and "Traceback" not in run.err
    assert nothing_written(workspace)


def test_a_run_config_with_yaml_aliases_is_refused(snapshot_copy: Callable[[], Path], workspace: Path, cli) -> None:
    snap = snapshot_copy()
    text = (snap / RUN_CONFIG).read_text()
    (snap / RUN_CONFIG).write_text(text.replace("model:", "model: &m", 1) + "extra: *m\n")
    run = cli("replay", snap, "--workspace", workspace)
    assert run.code == 2 and "aliases are refused" in run.err and str(snap / RUN_CONFIG) in run.err
    assert nothing_written(workspace)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda s: (s / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}})), "it holds a dict"),
        (lambda s: declare_checkpoint_tensor(s, (10**6, 10**6)), "does not fit the run config's model"),
        (lambda s: declare_checkpoint_tensor(s, (16, 16 * 10**6)), "does not fit the run config's model"),
        (lambda s: (s / "__0_0.distcp").write_bytes(b"x" * 100), r"__0_0\.distcp, which holds 100"),
        (lambda s: (s / AXRL_METADATA).write_text('{"iteration": Infinity, "grad_norm": 1}'), "must be an integer"),
    ],
)
def test_checkpoint_and_metadata_declaring_what_is_not_on_disk(
    snapshot_copy: Callable[[], Path], workspace: Path, cli, damage: Callable[[Path], object], message: str
) -> None:
    snap = snapshot_copy()
    damage(snap)
    with pytest.raises(SnapshotError, match=message):
        run_request(replay_request(What(snap), workspace=workspace))
    run = cli("replay", snap, "--workspace", workspace)
    assert run.code == 2 and str(snap) in run.err and "Traceback" not in run.err
    assert nothing_written(workspace)


def test_a_checkpoint_whose_data_files_do_not_back_the_model_s_shapes(
    snapshot_copy: Callable[[], Path], workspace: Path
) -> None:
    """Shapes that fit the model but data files too small for them: refused before DCP allocates anything."""
    snap = snapshot_copy()
    for shard in snap.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(SnapshotError, match=r"is declared at bytes .*\.distcp, which holds"):
        run_request(replay_request(What(snap), workspace=workspace))
    assert nothing_written(workspace)


def test_a_malformed_routing_payload_is_refused_before_any_rank_process(
    snapshot_copy: Callable[[], Path], workspace: Path
) -> None:
    snap = snapshot_copy()
    payload = torch.load(snap / "routing_payload_rank1.pt", weights_only=True)
    payload["moe_layers"] = "ab"
    torch.save(payload, snap / "routing_payload_rank1.pt")
    with pytest.raises(SnapshotError, match=r"routing_payload_rank1\.pt: 'moe_layers' must be a list"):
        run_request(replay_request(What(snap), workspace=workspace))
    assert nothing_written(workspace)
