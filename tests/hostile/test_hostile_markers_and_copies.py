"""Preserved copies with markers someone edited: bad ones are refused by name, good ones proceed, and
nothing is ever deleted that this tool did not make."""

from __future__ import annotations

import json

from hostile_helpers import assert_clear_refusal_or_success, run_cli, scene
from hostile_strategies import hostile_values
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

MARKER = ".axrl_preserved.json"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["iteration", "files", "tool", "source", None]), value=hostile_values)
@example(field="iteration", value="twenty")
@example(field="iteration", value=-5)
@example(field="files", value=[[1]])
@example(field=None, value="not json {")
def test_one_bad_marker_does_not_block_the_other_releases(field, value):
    with scene() as world:
        outcome = run_cli("preserve", world.output_dir, "--json")
        assert outcome.code == 0, outcome.err
        active = world.output_dir / "checkpoints" / "spike_snapshots-active"
        copies = sorted(p for p in active.iterdir() if p.is_dir())
        assert len(copies) == 2
        bad, good = copies
        marker = bad / MARKER
        if field is None:
            marker.write_text(str(value))
        else:
            doc = json.loads(marker.read_text())
            doc[field] = value
            marker.write_text(json.dumps(doc))
        bad_files = sorted(p.name for p in bad.iterdir())

        outcome = run_cli("release", world.output_dir, "--json")
        assert_clear_refusal_or_success(outcome, bad.name, MARKER)
        assert not good.exists(), "the good copy was not released"
        if bad.exists():  # refused: every file it held is still there
            assert sorted(p.name for p in bad.iterdir()) == bad_files
        assert (world.snapshot / "axrl_metadata.json").is_file(), "the source snapshot was touched"


def test_a_symlinked_snapshot_entry_is_skipped_not_preserved():
    with scene() as world:
        (world.output_dir / "checkpoints" / "spike_snapshots" / "iter_0000099").symlink_to(world.outside)
        before = world.outside_digest()
        listing = run_cli("snapshots", world.output_dir, "--json")
        assert listing.code == 0, listing.err
        assert "iter_0000099" in listing.out  # reported as skipped, with the reason
        outcome = run_cli("preserve", world.output_dir, "--json")
        assert_clear_refusal_or_success(outcome, "iter_0000099")
        preserved = world.output_dir / "checkpoints" / "spike_snapshots-active"
        assert not (preserved / "iter_99").exists() and not (preserved / "iter_0000099").exists()
        run_cli("release", world.output_dir)
        assert world.outside_digest() == before
