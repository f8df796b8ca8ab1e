"""A snapshot from someone else's run, edited by a careless or hostile hand: every reading verb answers
with a result or a clear refusal naming the file, never a traceback, a raw terminal escape or a write
outside the workspace."""

from __future__ import annotations

import json
import math

import yaml
from hostile_helpers import SNAPSHOT_NAME, assert_clear_refusal_or_success, run_cli, scene
from hostile_strategies import hostile_values
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

METADATA_KEYS = [
    ("format_version",),
    ("job_name",),
    ("role",),
    ("iteration",),
    ("grad_norm",),
    ("median_norm",),
    ("spike_ratio",),
    ("detector",),
    ("detector", "kind"),
    ("detector", "window"),
    ("detector", "threshold"),
    ("parallel",),
    ("parallel", "world_size"),
    ("parallel", "dp"),
    ("parallel", "tp"),
    ("created_at",),
]
READING_VERBS = ("inspect", "analyze", "grads")


def _set(doc: dict, path: tuple[str, ...], value: object) -> None:
    for key in path[:-1]:
        if not isinstance(doc.get(key), dict):
            doc[key] = {}
        doc = doc[key]
    doc[path[-1]] = value


def _read_everything(world) -> None:
    for verb in READING_VERBS:
        for as_json in (True, False):
            outcome = run_cli(verb, world.snapshot, *(["--json"] if as_json else []))
            assert_clear_refusal_or_success(outcome, SNAPSHOT_NAME)
    assert_clear_refusal_or_success(run_cli("snapshots", world.output_dir), SNAPSHOT_NAME, str(world.output_dir))


@FUZZ
@given(key=st.sampled_from(METADATA_KEYS), value=hostile_values)
@example(key=("parallel", "world_size"), value=10**9)
@example(key=("parallel",), value=[2, 1, 1])
@example(key=("job_name",), value="\x1b]0;owned\x07\x1b[2J")
@example(key=("grad_norm",), value=10**4000)
@example(key=("detector", "threshold"), value=math.inf)
def test_an_edited_metadata_field_is_read_or_refused_by_name(key, value):
    with scene() as world:
        path = world.snapshot / "axrl_metadata.json"
        doc = json.loads(path.read_text())
        _set(doc, key, value)
        path.write_text(json.dumps(doc))  # NaN and Infinity as Python's json writes them
        before = world.outside_digest()
        _read_everything(world)
        assert world.outside_digest() == before


@FUZZ
@given(
    name=st.sampled_from(
        [
            "axrl_metadata.json",
            "metadata.json",
            ".metadata",
            "batch_rank0.pt",
            "grad_info_rank1.pt",
            "routing_payload_rank0.pt",
            "run_config.yaml",
        ]
    ),
    cut=st.floats(min_value=0.0, max_value=1.0),
    noise=st.binary(max_size=64),
)
@example(name="axrl_metadata.json", cut=0.0, noise=b"[" * 100_000)
@example(name="axrl_metadata.json", cut=0.0, noise=b"\xff\xfe\x00{")
@example(name="run_config.yaml", cut=0.0, noise=b"a: &a [1,1,1,1,1,1,1,1,1]\nb: [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n")
def test_a_truncated_or_garbled_file_is_refused_by_name(name, cut, noise):
    with scene() as world:
        path = world.snapshot / name
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * cut)] + noise)
        for verb in READING_VERBS:
            assert_clear_refusal_or_success(run_cli(verb, world.snapshot, "--json"), name, SNAPSHOT_NAME)


MODEL_KEYS = ["vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "n_experts", "top_k", "max_seq_len", "moe_layers"]


@FUZZ
@given(key=st.sampled_from(MODEL_KEYS), value=hostile_values)
@example(key="n_layers", value=3_000_000)
@example(key="d_model", value="32")
@example(key="n_heads", value=0)
def test_an_edited_model_config_is_refused_before_anything_is_built(key, value):
    from axrl_spike_replay.errors import AxrlError
    from axrl_spike_replay.replay.reading.inputs import load_inputs

    with scene() as world:
        path = world.snapshot / "run_config.yaml"
        doc = yaml.safe_load(path.read_text())
        doc["model"][key] = value
        try:
            text = yaml.safe_dump(doc)
        except yaml.YAMLError:
            return  # not representable as YAML: nothing to write
        path.write_text(text)
        try:
            load_inputs(world.snapshot, world.snapshot, legacy=False)
        except AxrlError as exc:
            message = str(exc)
            assert "run_config.yaml" in message or SNAPSHOT_NAME in message, message
            assert len(message) < 2000
