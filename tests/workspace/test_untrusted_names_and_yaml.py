"""Names and YAML we did not write: a trailing newline is not a plain name, escape codes are shown and not
obeyed, and no YAML file (workspace config, skill, method front matter) may expand aliases."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.names import check_plain_name
from axrl_spike_replay.remote.workspace_config import load_workspace_config
from axrl_spike_replay.skill_pack import parse_skill
from axrl_spike_replay.snapshot.layout import parse_iteration, parse_output_dir_name
from axrl_spike_replay.workspace.method_files import front_matter

FIXTURE_SNAPSHOT = (
    Path(__file__).resolve().parents[1]
    / "fixtures"
    / "outputs"
    / "fx~fixture-moe__actor"
    / "checkpoints"
    / "spike_snapshots"
    / "iter_0000021"
)
ALIASES = "a: &a [x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b]\n"


@pytest.mark.parametrize("name", ["fx-job\n", "..", ".hidden", "a/b", "x" * 201, "tab\tname", "\x1b[2J"])
def test_names_that_are_not_plain_are_refused_and_shown_escaped(name: str) -> None:
    with pytest.raises(ConfigError, match=r"job name .* is not a plain file name") as refused:
        check_plain_name(name, "job name")
    assert "\x1b" not in str(refused.value) and "\n" not in str(refused.value) and len(str(refused.value)) < 400


def test_layout_names_with_a_trailing_newline_are_not_layout_names() -> None:
    assert parse_output_dir_name("run~job__actor") == ("run", "job", "actor")
    assert parse_output_dir_name("run~job__actor\n") is None
    assert parse_iteration("iter_0000005") == 5 and parse_iteration("iter_0000005\n") is None


def test_a_workspace_config_with_aliases_or_bad_bytes_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "spike-replay.yaml"
    config.write_text("targets:\n  gpu: &node {ssh: 'ssh root@10.0.0.5'}\n  gpu2: *node\n")
    with pytest.raises(ConfigError, match=re.escape(f"workspace config {config}: uses a YAML alias")):
        load_workspace_config(tmp_path)
    config.write_bytes(b"targets:\n  gpu: {ssh: '\xff'}\n")
    with pytest.raises(ConfigError, match=re.escape(f"workspace config {config}: not UTF-8 text")):
        load_workspace_config(tmp_path)
    config.write_text('targets:\n  "gpu\\n": {ssh: "ssh root@10.0.0.5"}\n')  # YAML's escape: a newline
    with pytest.raises(ConfigError, match=r"target name 'gpu\\n'"):
        load_workspace_config(tmp_path)


def test_a_skill_whose_frontmatter_uses_aliases_is_refused(tmp_path: Path) -> None:
    skill = tmp_path / "bomb" / "SKILL.md"
    skill.parent.mkdir()
    skill.write_text(f"---\nname: bomb\ndescription: x\n{ALIASES}---\nbody\n")
    with pytest.raises(ConfigError, match=re.escape(f"{skill} frontmatter: uses a YAML alias")):
        parse_skill(skill)
    skill.write_bytes(b"---\nname: \xff\n---\n")
    with pytest.raises(ConfigError, match=re.escape(f"{skill}: cannot read it as UTF-8 text")):
        parse_skill(skill)


def test_a_method_file_whose_front_matter_uses_aliases_is_not_ours(tmp_path: Path) -> None:
    method = tmp_path / "tis.md"
    method.write_text(f"---\naxrl_method: 1\n{ALIASES}---\n# tis\n")
    assert front_matter.load(method) is None
    method.write_text(front_matter.dump({"axrl_method": 1, "name": "tis"}) + "# tis\n")
    assert front_matter.load(method) == {"axrl_method": 1, "name": "tis"}


def test_escape_codes_in_a_snapshots_job_name_are_shown_not_obeyed(tmp_path: Path, cli) -> None:
    snapshot = tmp_path / "iter_0000021"
    shutil.copytree(FIXTURE_SNAPSHOT, snapshot)
    meta = snapshot / "axrl_metadata.json"
    doc = json.loads(meta.read_text())
    doc["job_name"] = "evil\x1b]0;pwned\x07\x1b[2J"
    meta.write_text(json.dumps(doc))

    run = cli("inspect", snapshot)

    assert run.code == 0, run.err
    assert "\x1b" not in run.out and "\x07" not in run.out
    assert "job evil\\x1b]0;pwned\\x07\\x1b[2J" in run.out
    assert json.loads(cli("inspect", snapshot, "--json").out)["job_name"] == doc["job_name"]  # JSON stays exact


def test_escape_codes_in_an_error_message_are_shown_not_obeyed(tmp_path: Path, cli) -> None:
    run = cli("logs", tmp_path / "no\x1b[2Jpe.log")
    assert run.code == 2
    assert "\x1b" not in run.err and "no\\x1b[2Jpe.log: log file or directory not found" in run.err
