"""The server starts without torch: it names the mitigations, presets and result types from torch-free modules
(there are no copies of them to keep in step)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import with_client

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "mcp_server"

TORCH_FREE = [
    "axrl_spike_replay.server",
    "axrl_spike_replay.experiment.mitigation.mitigations",
    "axrl_spike_replay.experiment.mitigation.mitigation_catalogue",
    "axrl_spike_replay.experiment.mitigation.mitigation_sets",
    "axrl_spike_replay.experiment.result",
    "axrl_spike_replay.capture.reference.presets",
    "axrl_spike_replay.training.loss_config",
    "axrl_spike_replay.training.routing_config",
    "axrl_spike_replay.jsonable",
    "axrl_spike_replay.cli",
]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_importing_it_in_a_fresh_interpreter_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} imported torch"


def test_the_tools_schemas_describe_the_library_results_themselves(workspace: Path) -> None:
    from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS
    from axrl_spike_replay.server import create_server

    listed = with_client(create_server(workspace), lambda client: client.list_tools())
    tools = {tool.name: tool for tool in listed.tools}
    sweep = tools["sweep"].output_schema or {}
    assert {"baseline", "results", "threshold"} <= set(sweep["properties"])
    attribution = tools["attribute_spike"].output_schema or {}
    assert {"samples", "router_term", "sum_rel_error"} <= set(attribution["properties"])
    description = tools["replay"].input_schema["properties"]["mitigations"]["description"]
    assert "axrl://mitigations" in description  # the list points at the resource that names them all
    text = with_client(create_server(workspace), lambda client: client.read_resource("axrl://mitigations"))
    assert all(name in text.contents[0].text for name in MITIGATIONS)
