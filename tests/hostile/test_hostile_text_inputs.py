"""Text we did not write — mitigation values, mitigation-set files, log lines, names: a result or a clear,
bounded refusal naming the argument or file, in bounded time and memory, never a write outside."""

from __future__ import annotations

import json

from hostile_helpers import MAX_MESSAGE, assert_clear_refusal_or_success, run_cli, scene
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALIAS_BOMB = "&a [x,x,x,x,x,x,x,x,x]" + "".join(
    f", &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]" for p, c in zip("abcdefg", "bcdefgh", strict=True)
)
MITIGATION_NAMES = [
    "advantage_clip",
    "ratio_outlier_mask",
    "current_routing_layers",
    "loss_agg_mode",
    "mismatch_token_clip_max",
    "initial_model",
    "no_such_mitigation",
]
yaml_ish = st.text(alphabet=st.sampled_from(list("{}[]&*:,'\"!-|> \n\t#0123456789.eE+abx\x1b\x00")), max_size=60)


@FUZZ
@given(name=st.sampled_from(MITIGATION_NAMES), value=st.one_of(yaml_ish, st.text(max_size=40)))
@example(name="ratio_outlier_mask", value="{" + ALIAS_BOMB)
@example(name="ratio_outlier_mask", value="{level: token, upper: [1, 2")
@example(name="current_routing_layers", value="[" * 5000)
def test_a_mitigation_value_is_parsed_or_refused_briefly(name, value):
    from axrl_spike_replay.errors import ConfigError
    from axrl_spike_replay.experiment.mitigation.mitigations import parse_mitigation_args

    try:
        parse_mitigation_args([f"{name}={value}"])
    except ConfigError as exc:
        message = str(exc)
        assert len(message) <= MAX_MESSAGE, len(message)
        assert "\x1b" not in message and "\x00" not in message


@FUZZ
@given(text=st.one_of(yaml_ish, st.binary(max_size=80).map(lambda b: b.decode("latin-1"))))
@example(text="- {ratio_outlier_mask: " + ALIAS_BOMB.replace("&a", "&a", 1) + "}\n")
@example(text="- a: &a [1,1,1,1,1,1,1,1,1]\n- b: [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n")
def test_a_mitigation_set_file_is_loaded_or_refused_by_name(text):
    with scene() as world:
        mitigation_set = world.workspace / "set.yaml"
        mitigation_set.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        outcome = run_cli(
            "sweep",
            world.snapshot,
            "--mitigation-set",
            mitigation_set,
            "--workspace",
            world.workspace,
            "--nproc",
            "1",
            "--json",
        )
        if outcome.code == 0:
            return  # a valid set really ran
        assert_clear_refusal_or_success(outcome, "set.yaml", "mitigation")


line_parts = st.sampled_from(
    [
        "iteration 7/ 100 | grad norm: 3.5 | loss: 1.0 |",
        "step=3 grad_norm=2.5 loss=0.1",
        "Traceback (most recent call last)",
        "a=" * 50,
        "x" * 2000,
        "grad_norm: nan",
        "ValueError:",
        "ERROR",
        "=" * 300,
        " ",
        "\x1b[31m",
        ":" * 100,
        "1e" * 40,
    ]
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(st.one_of(line_parts, st.text(max_size=200)), max_size=30))
@example(lines=["a" * 40_000])
@example(lines=["k=" + "1" * 40_000])
def test_any_log_text_is_scanned_without_writing_outside(lines):
    with scene() as world:
        log = world.root / "job.log"
        log.write_text("\n".join(lines) + "\n", errors="surrogateescape")
        dest = world.workspace / "tmp" / "logs"
        dest.mkdir(parents=True)
        (dest / "job.log").symlink_to(world.outside / "precious.txt")  # a trap already in the destination
        before = world.outside_digest()
        outcome = run_cli("logs", log, "--dest", dest, "--json")
        assert_clear_refusal_or_success(outcome, "job.log")
        if outcome.code == 0:
            json.loads(outcome.out)
        assert world.outside_digest() == before


@FUZZ
@given(job=st.one_of(st.text(max_size=30), st.sampled_from(["..", ".", "a/b", "ok\n", "\x1b[2J", "a" * 300, "-x"])))
def test_a_job_name_becomes_a_file_name_or_is_refused(job):
    with scene() as world:
        before = world.outside_digest()
        outcome = run_cli("task", "open", "--workspace", world.workspace, "--", job)
        assert_clear_refusal_or_success(outcome, "job")
        tasks = world.workspace / "agent-task" / "spike-replay"
        if outcome.code == 0:
            created = [p for p in tasks.iterdir() if p.suffix == ".md"]
            assert len(created) == 1 and created[0].parent == tasks
        assert world.outside_digest() == before
        assert all(p.resolve().is_relative_to(world.workspace.resolve()) for p in world.workspace.rglob("*"))
