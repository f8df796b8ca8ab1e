"""Our `trl` loss convention against TRL 1.16's own installed `GRPOTrainer._compute_loss`, on the same float64
micro-batches (trl_cases.py says how TRL's method runs without a model): every loss type, both importance-sampling
levels, the clip ranges, delta, beta with and without the bias correction, every rollout-correction mode with its
caps, the off-policy mask, the entropy bonus, 2 processes of 2 accumulation steps and one of one. Each must agree
within 1e-6 relative on each process's loss and on its gradient with respect to every log-prob, over 5 seeds.
The batches are checked to reach what each setting is there to test (each changes the loss), so an edit of them
cannot quietly turn a case into one that passes whatever we compute."""

from __future__ import annotations

import inspect
import math
import re

import pytest

pytest.importorskip("trl", reason="TRL is not installed (scripts/setup.sh installs the trl extra)")

from trl_cases import CASES, SEEDS, Case, compare

from axrl_spike_replay.errors import ConfigError
from axrl_spike_replay.training.trl_settings import TRL_LOSS_TYPES, TRL_VERSION

TOLERANCE = 1e-6


def test_the_installed_trl_is_the_release_the_convention_reproduces() -> None:
    """A newer TRL may compute another loss: this names what changed (the cross-check below then says where)."""
    import trl
    from trl import GRPOTrainer

    assert trl.__version__ == TRL_VERSION, f"installed TRL {trl.__version__}, the convention reproduces {TRL_VERSION}"
    source = inspect.getsource(GRPOTrainer._compute_loss)
    branches = [line for line in source.splitlines() if "self.loss_type" in line]
    named = set(re.findall(r'"([a-z_]+)"', "\n".join(branches)))
    assert named == set(TRL_LOSS_TYPES), f"TRL's _compute_loss branches on {sorted(named)}"


@pytest.mark.parametrize("name", list(CASES))
def test_our_trl_convention_matches_trls_compute_loss_on_loss_and_gradient(name: str) -> None:
    for seed in SEEDS:
        figures = compare(CASES[name], seed)
        assert math.isfinite(figures["ours"]) and math.isfinite(figures["trl"])
        assert figures["loss_rel"] <= TOLERANCE, (seed, figures)
        assert figures["grad_rel"] <= TOLERANCE, (seed, figures)


def _base(case: Case) -> Case:
    return Case({"loss_type": case.config["loss_type"]}, processes=case.processes, accumulation=case.accumulation)


# VESPO computes its own sequence-level weights: TRL's importance_sampling_level does not reach its loss (TRL warns).
NO_OP = {"vespo sequence-level (GSPO)"}


@pytest.mark.parametrize(
    "name", [n for n, c in CASES.items() if (set(c.config) != {"loss_type"} or c.use_vllm) and n not in NO_OP]
)
def test_each_setting_changes_the_loss_on_these_batches(name: str) -> None:
    case = CASES[name]
    changed = compare(case, 0)["trl"]
    base = compare(_base(case), 0)["trl"]
    assert abs(changed - base) > 1e-6 * abs(base), f"{name}: the setting does not reach these batches"


def test_a_grpo_config_setting_the_convention_does_not_cover_is_refused_naming_it() -> None:
    from trl import GRPOConfig, __version__

    from axrl_spike_replay.capture.trl_loss_section import trl_loss_config, trl_loss_section

    args = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], top_entropy_quantile=0.8)
    section = trl_loss_section(
        args, gradient_accumulation_steps=1, num_processes=1, aux_loss_coef=0.0, version=__version__
    )
    with pytest.raises(ConfigError, match=r"top_entropy_quantile=0\.8.*--backend command"):
        trl_loss_config(section)
    section.pop("unreproduced")
    section["trl"]["top_entropy_quantile"] = 0.8
    with pytest.raises(ConfigError, match=r"top_entropy_quantile.*--backend command"):
        trl_loss_config(section)


def test_a_snapshot_of_another_trl_release_gets_a_note_naming_both_releases() -> None:
    """The replay result carries it (`trainer_version_note`; end to end in tests/capture/test_trl_callback.py)."""
    from axrl_spike_replay.training.trl_settings import TrlSettings

    assert TrlSettings().version_note() is None
    note = TrlSettings(version="1.15.2").version_note()
    assert note is not None and "TRL 1.15.2" in note and f"TRL {TRL_VERSION}" in note
