"""What a node's speeds for a replay are measured on (`node_speeds`): the directory whose checkpoint the replay reads
and the dtype of its parameters, from the snapshot's run config (no weight read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def weights_read(spec: Any, snapshot: Path) -> Path:
    """The directory a replay of `snapshot` with the model `spec` reads its weights from (an HF model's own
    directory where the run config names one, else the snapshot's checkpoint)."""
    from axrl_spike_replay.models.hf_config import HFModelConfig
    from axrl_spike_replay.models.policy import hf_weights_dir

    return hf_weights_dir(spec, snapshot) if isinstance(spec, HFModelConfig) else snapshot


def speed_inputs(snapshot: str | Path) -> tuple[Path, str]:
    """(the weights dir a replay of `snapshot` reads, its parameters' dtype in the precision that runs)."""
    from axrl_spike_replay.models.policy import parse_model_config
    from axrl_spike_replay.replay.compute.process_memory import model_facts, step_dtypes
    from axrl_spike_replay.replay.reading.inputs import read_run_config
    from axrl_spike_replay.training.precision import PrecisionPolicy

    path = Path(snapshot).expanduser().resolve()
    run_config = read_run_config(path)
    spec = parse_model_config(run_config["model"])
    recorded = run_config.get("precision")
    precision = None if recorded is None else PrecisionPolicy.from_dict(recorded, f"{path}: precision")
    return weights_read(spec, path), step_dtypes(model_facts(spec).dtype, precision).params
