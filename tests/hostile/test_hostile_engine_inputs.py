"""What the engine computes on, edited by a hostile hand: checkpoint chunk tables, `.distcp` entries, routing
payloads and safetensors headers. Every verb answers with a result or a clear refusal naming the file (never a
traceback, never a C++ error from a rank), within the address-space cap of tests/hostile/conftest.py, and a
checkpoint either loads every element of every tensor or is refused: nothing is computed on initial values."""

from __future__ import annotations

import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hostile_helpers import SNAPSHOT_NAME, assert_clear_refusal_or_success, run_cli, scene
from hostile_strategies import hostile_values
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from axrl_spike_replay.errors import AxrlError, SnapshotError
from axrl_spike_replay.snapshot.dcp.checkpoint import load_model_state, summarize_checkpoint
from hostile_snapshot import edit_routing_payload, edit_safetensors_header, set_checkpoint_chunks, write_distcp_bomb

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW_FUZZ = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])

spans = st.tuples(st.integers(-2, 20), st.integers(-2, 20))
chunks = st.lists(st.tuples(spans, spans), max_size=5)  # ((row offset, col offset), (rows, cols)) of a 16 x 16


def _filled(snapshot: Path) -> dict[str, torch.Tensor]:
    """Every model tensor, loaded over NaNs: a NaN left means an element no chunk covered."""
    shapes = summarize_checkpoint(snapshot).shapes
    state = {n.removeprefix("model."): torch.full(s, float("nan")) for n, (s, _) in shapes.items()}
    load_model_state(snapshot, state)
    return state


@FUZZ
@given(declared=chunks)
@example(declared=[])
@example(declared=[((0, 0), (8, 16))])
@example(declared=[((0, 0), (12, 16)), ((8, 0), (4, 16))])
@example(declared=[((0, 0), (16, 16)), ((16, 0), (1, 16))])
@example(declared=[((0, 0), (8, 16)), ((8, 0), (8, 16))])
def test_a_chunk_table_either_loads_every_element_or_is_refused(declared):
    with scene() as world:
        if any(o < 0 or s < 0 for offsets, sizes in declared for o, s in zip(offsets, sizes, strict=True)):
            return  # torch.Size cannot hold a negative number: the unpickler refuses such a table already
        set_checkpoint_chunks(world.snapshot, "model.embed.weight", declared)
        try:
            state = _filled(world.snapshot)
        except SnapshotError as exc:
            assert ".metadata" in str(exc) or ".distcp" in str(exc), str(exc)
        else:
            assert not any(t.isnan().any() for t in state.values()), "an element kept its initial value"
        assert_clear_refusal_or_success(run_cli("inspect", world.snapshot, "--json"), SNAPSHOT_NAME)


@SLOW_FUZZ
@given(where=st.floats(0.0, 1.0), noise=st.binary(min_size=1, max_size=32))
@example(where=0.79, noise=b"\x00@")  # a zip version zipfile does not implement
@example(where=0.23828125, noise=b"\x00\x00\x00\x00\x00\x00\x00\x00\x04")  # a record's local header
@example(where=1.0, noise=b"PK\x05\x06")
@example(where=0.0, noise=b"\x00" * 32)
def test_garbled_bytes_in_an_entry_are_refused_or_harmless(where, noise):
    with scene() as world:
        metadata = pickle.loads((world.snapshot / ".metadata").read_bytes())  # the test's own copy
        info = next(i for k, i in metadata.storage_data.items() if k.fqn == "model.head.weight")
        path = world.snapshot / info.relative_path
        data = bytearray(path.read_bytes())
        at = info.offset + min(int(where * info.length), info.length - len(noise))
        data[at : at + len(noise)] = noise[: info.length]
        path.write_bytes(bytes(data))
        try:
            _filled(world.snapshot)
        except SnapshotError as exc:
            assert info.relative_path in str(exc) or ".metadata" in str(exc), str(exc)
        assert_clear_refusal_or_success(run_cli("inspect", world.snapshot, "--json"), SNAPSHOT_NAME)


def test_a_distcp_bomb_is_refused_by_every_verb_within_the_memory_cap():
    with scene() as world:
        write_distcp_bomb(world.snapshot, 5 << 29, compresslevel=1)  # 2.5 GiB: beyond the cap's 2 GiB headroom
        outcome = run_cli("inspect", world.snapshot, "--json")
        assert outcome.code == 0 and "is compressed" in outcome.out
        for verb in ("replay", "attribute", "diagnose"):
            args = ("--workspace", world.workspace) if verb != "diagnose" else ("--model", "always")
            outcome = run_cli(verb, world.snapshot, *args)
            assert_clear_refusal_or_success(outcome, "__0_0.distcp")
            assert "is compressed" in outcome.err + outcome.out, verb


def _route_fill(value: int):
    def change(doc: dict) -> None:
        doc["routed_experts"] = doc["routed_experts"].masked_fill(doc["routed_experts"] == 1, value)

    return change


COMPUTED_ON = {  # what is edited, the file the refusal names, what it says
    "chunks leaving half a tensor out": (
        lambda s: set_checkpoint_chunks(s, "model.embed.weight", [((0, 0), (8, 16))]),
        ".metadata",
        "has chunks covering 128 of its 256 elements: the rest is in no chunk",
    ),
    "an expert id past the model's": (
        lambda s: edit_routing_payload(s, 0, _route_fill(9)),
        "routing_payload_rank0.pt",
        "expert ids [9] in layer slots",
    ),
    "moe_layers naming a layer the model lacks": (
        lambda s: edit_routing_payload(s, 0, lambda d: d.__setitem__("moe_layers", [0, 5])),
        "routing_payload_rank0.pt",
        "moe_layers names layers [5] the model lacks",
    ),
}


@pytest.mark.parametrize("case", COMPUTED_ON, ids=list(COMPUTED_ON))
def test_every_verb_that_computes_refuses_what_does_not_fit_by_name(case):
    edit, name, message = COMPUTED_ON[case]
    with scene() as world:
        edit(world.snapshot)
        for verb in ("replay", "attribute", "diagnose"):
            args = ("--workspace", world.workspace) if verb != "diagnose" else ("--model", "always")
            outcome = run_cli(verb, world.snapshot, *args)
            assert_clear_refusal_or_success(outcome, name)
            said = outcome.err + outcome.out
            assert message in said and name in said, (verb, said[-1500:])
            if verb == "diagnose":  # the rest of the diagnosis stands; the model evidence is listed as not checked
                assert outcome.code == 0 and "model evidence (" in outcome.out
            else:  # refused (input_checks reads the expert ids before any process starts), exit status 2
                assert outcome.code == 2, verb
        if name == ".metadata":  # inspect reads no model: the routes are the model-reading verbs' to check
            assert message in run_cli("inspect", world.snapshot).out


routes = st.one_of(
    st.integers(-3, 9).map(lambda v: ("fill", v)),
    st.sampled_from([("width", 1), ("width", 3), ("seq", 1), ("batch", 1), ("slots", 1), ("dtype", 0)]),
)


@SLOW_FUZZ
@given(edit=routes, layers=st.one_of(st.just(None), hostile_values))
@example(edit=("fill", 4), layers=None)
@example(edit=("fill", -3), layers=None)
@example(edit=("width", 1), layers=None)
@example(edit=("fill", 0), layers=[0, 5])
def test_a_routing_payload_is_replayed_only_when_it_fits_the_model(edit, layers):
    kind, value = edit

    def change(doc: dict) -> None:
        r = doc["routed_experts"]
        if kind == "fill":  # every third token's first expert becomes `value`, its second none (no repeat)
            r = r.clone()
            tokens = (torch.arange(r.shape[0] * r.shape[1]).view(r.shape[:2]) % 3 == 1)[..., None]
            r[..., 0] = torch.where(tokens, torch.tensor(value, dtype=r.dtype), r[..., 0])
            r[..., 1] = torch.where(tokens, torch.tensor(-1, dtype=r.dtype), r[..., 1])
        elif kind == "width":
            r = r[..., :1].expand(*r.shape[:3], value).clone()
        elif kind == "seq":
            r = r[:, :value].clone()
        elif kind == "batch":
            r = r[:value].clone()
        elif kind == "slots":
            r = r[:, :, :value].clone()
            doc["moe_layers"] = doc["moe_layers"][:value]
        else:
            r = r.float()
        doc["routed_experts"] = r
        if layers is not None:
            doc["moe_layers"] = layers

    with scene() as world:
        edit_routing_payload(world.snapshot, 0, change)
        outcome = run_cli("replay", world.snapshot, "--nproc", "1", "--workspace", world.workspace)
        assert_clear_refusal_or_success(outcome, "routing_payload_rank0.pt", SNAPSHOT_NAME)
        assert "out of bounds" not in outcome.err and "IndexError" not in outcome.err
        fits = kind == "fill" and -1 <= value < 4 and layers in (None, [0, 1])
        assert (outcome.code == 0) == fits, (edit, layers, outcome.err[-500:])


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    from axrl_spike_replay.models.policy import build_policy, parse_model_config
    from axrl_spike_replay.testing.hf_snapshot import model_section

    model = build_policy(parse_model_config(model_section("qwen3_moe")))
    out = Path(tempfile.mkdtemp(prefix="axrl-hostile-hf-")) / "hf"
    model.causal_lm.save_pretrained(out, safe_serialization=True)
    yield out
    shutil.rmtree(out.parent, ignore_errors=True)


@FUZZ
@given(key=st.sampled_from(["shape", "dtype", "data_offsets", None]), value=hostile_values)
@example(key="shape", value=[-1, 64])
@example(key="shape", value=[2**40, 2**40])
@example(key="data_offsets", value=[0, 2**63])
@example(key=None, value={"shape": [1]})
def test_a_safetensors_header_entry_is_read_or_refused_by_name(hf_dir, key, value):
    from axrl_spike_replay.models.hf_weights import read_weights

    with tempfile.TemporaryDirectory(prefix="axrl-hostile-st-") as tmp:
        directory = shutil.copytree(hf_dir, Path(tmp) / "hf")
        [file] = directory.glob("*.safetensors")

        def change(header: dict) -> None:
            name = next(k for k in header if k != "__metadata__")
            if key is None:
                header[name] = value
            else:
                header[name][key] = value

        try:
            edit_safetensors_header(file, change)
        except (TypeError, ValueError):
            return  # not representable as JSON
        try:
            read_weights(directory)
        except AxrlError as exc:
            assert "model.safetensors" in str(exc) and len(str(exc)) < 2000, str(exc)
