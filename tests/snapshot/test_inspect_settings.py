"""`inspect` shows what a person checks first: the run config's loss, routing and parallel sections and the
detector, as the trainer recorded them (no defaults filled in), in the CLI's text and JSON alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from axrl_spike_replay.snapshot.inspect import inspect_snapshot


def test_inspect_shows_the_recorded_loss_routing_parallel_and_detector(golden_snapshot: Path, cli) -> None:
    recorded = yaml.safe_load((golden_snapshot / "run_config.yaml").read_text())
    settings = inspect_snapshot(golden_snapshot).settings
    assert settings == {name: recorded[name] for name in ("loss", "routing", "parallel", "detector")}

    shown = json.loads(cli("inspect", golden_snapshot, "--json").out)["settings"]
    assert shown["loss"]["is_base_logprobs"] == recorded["loss"]["is_base_logprobs"]
    text = cli("inspect", golden_snapshot).out
    loss_line = next(line for line in text.splitlines() if line.startswith("loss: "))
    assert f"kl_coef={recorded['loss']['kl_coef']}" in loss_line
    assert "routing: replay='all'" in text and "parallel: world_size=2" in text
    assert f"detector: kind='{recorded['detector']['kind']}'" in text


def test_only_what_the_trainer_wrote_is_shown_and_the_detector_falls_back_to_the_metadata(
    golden_snapshot: Path, tmp_path: Path, cli
) -> None:
    snap = shutil.copytree(golden_snapshot, tmp_path / golden_snapshot.name)
    doc = yaml.safe_load((snap / "run_config.yaml").read_text())
    doc["loss"] = {"kl_coef": 0.5}  # a trainer that recorded one loss knob: nothing else is invented
    del doc["detector"], doc["routing"]
    (snap / "run_config.yaml").write_text(yaml.safe_dump(doc))
    meta = json.loads((snap / "axrl_metadata.json").read_text())["detector"]

    settings = inspect_snapshot(snap).settings
    assert settings["loss"] == {"kl_coef": 0.5} and "routing" not in settings
    assert settings["detector"] == {k: meta[k] for k in ("kind", "window", "threshold")}
    assert "loss: kl_coef=0.5\n" in cli("inspect", snap).out
