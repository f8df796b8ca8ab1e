"""The mitigation catalogue (the skill's reference) and docs/mitigations.md are generated from the declarations: the
committed files are what `scripts/render_mitigation_catalogue.py` writes, and a stale copy is caught by `--check`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from axrl_spike_replay.experiment.mitigation.mitigation_catalogue import CATALOGUE, DOCS, rendered_files
from axrl_spike_replay.experiment.mitigation.mitigations import MITIGATIONS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "render_mitigation_catalogue.py"


def test_the_committed_catalogue_and_docs_are_what_the_declarations_generate() -> None:
    for path, wanted in rendered_files(REPO).items():
        assert path.read_text(encoding="utf-8") == wanted, f"{path} is stale: run {SCRIPT.relative_to(REPO)}"
    catalogue = (REPO / CATALOGUE).read_text(encoding="utf-8")
    assert all(f"| `{name}` |" in catalogue for name in MITIGATIONS)
    docs = (REPO / DOCS).read_text(encoding="utf-8")
    assert all(f"| `{name}: " in docs for name in MITIGATIONS)  # each with its setting in every trainer
    assert "`actor_rollout_ref.actor.clip_ratio_c=3`" in docs and "`--moe-aux-loss-coeff 0.01`" in docs


def test_check_reports_a_stale_copy_and_a_render_fixes_it(tmp_path: Path) -> None:
    for relative in (CATALOGUE, DOCS):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / relative, tmp_path / relative)
    stale = (tmp_path / CATALOGUE).read_text(encoding="utf-8").replace("| `kl_coef` |", "| `kl_weight` |")
    (tmp_path / CATALOGUE).write_text(stale, encoding="utf-8")

    def render(*flags: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, str(SCRIPT), "--repo", str(tmp_path), *flags]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    checked = render("--check")
    assert checked.returncode == 1 and "out of date" in checked.stderr
    assert render().returncode == 0
    assert render("--check").returncode == 0
    assert "| `kl_coef` |" in (tmp_path / CATALOGUE).read_text(encoding="utf-8")
