"""A `.safetensors` header is untrusted input: every entry is checked before anything is built or mapped, and a
malformed one is refused naming the file and the tensor (never a raw error from torch or safetensors, never
weights read from another tensor's bytes)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from axrl_spike_replay.errors import SnapshotError
from axrl_spike_replay.models.hf_weights import load_hf_weights, safetensors_shapes
from axrl_spike_replay.models.policy import build_policy, check_policy_weights, parse_model_config
from axrl_spike_replay.testing.hf_snapshot import model_section
from axrl_spike_replay.untrusted.untrusted_yaml import read_untrusted_yaml
from hostile_snapshot import edit_safetensors_header


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF directory written by transformers' own `save_pretrained` (tiny qwen3_moe, one safetensors file)."""
    model = build_policy(parse_model_config(model_section("qwen3_moe")))
    out = tmp_path_factory.mktemp("hf") / "hf"
    model.causal_lm.save_pretrained(out, safe_serialization=True)
    return out


def _by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _first(change: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda h: change(h[_by_offset(h)[0]])


def _shape(value: list) -> Callable[[dict], None]:
    return _first(lambda entry: entry.__setitem__("shape", value))


def _onto_the_first(header: dict) -> None:
    """The last tensor's entry pointed at the first tensor's bytes (same size): it would load the wrong weights."""
    names = _by_offset(header)
    first, last = header[names[0]], header[names[-1]]
    size = first["data_offsets"][1] - first["data_offsets"][0]
    last["shape"], last["dtype"], last["data_offsets"] = first["shape"], first["dtype"], list(first["data_offsets"])
    assert size > 0


HEADERS = {
    "a dimension of -1": (_shape([-1, 64]), "has a bad shape [-1, 64]"),
    "a dimension of 2^40": (_shape([2**40, 64]), "declares shape (1099511627776, 64) of F32 (256.0 TiB) over"),
    "2^40 x 2^40": (_shape([2**40, 2**40]), "declares shape (1099511627776, 1099511627776) of F32"),
    "a fractional dimension": (_shape([1.5, 64]), "has a bad shape [1.5, 64]"),
    "a boolean dimension": (_shape([True, 64]), "has a bad shape [True, 64]"),
    "17 dimensions": (_shape([1] * 17), "has a bad shape"),
    "a shape beyond its bytes": (_shape([2048, 64]), "declares shape (2048, 64) of F32 (512.0 KiB) over 262144 bytes"),
    "an unknown dtype": (_first(lambda e: e.__setitem__("dtype", "F8_E9")), "has dtype 'F8_E9' (read: F32"),
    "offsets reversed": (_first(lambda e: e.__setitem__("data_offsets", e["data_offsets"][::-1])), "outside the file"),
    "offsets not numbers": (_first(lambda e: e.__setitem__("data_offsets", ["0", 8])), "has bad data_offsets"),
    "an entry that is a list": (lambda h: h.__setitem__(_by_offset(h)[0], [1, 2]), "has an unusable header entry"),
    "another tensor's bytes": (_onto_the_first, "overlaps the tensor before it"),
    "metadata not strings": (lambda h: h.__setitem__("__metadata__", {"format": 3}), "__metadata__ must map"),
}


@pytest.mark.parametrize("edit", HEADERS, ids=list(HEADERS))
def test_a_malformed_header_is_refused_by_name(edit: str, hf_dir: Path, tmp_path: Path) -> None:
    change, message = HEADERS[edit]
    directory = shutil.copytree(hf_dir, tmp_path / "hf")
    [file] = directory.glob("*.safetensors")
    edit_safetensors_header(file, change)
    spec = parse_model_config({"kind": "hf", "architecture": "qwen3_moe", "path": str(directory)})

    with pytest.raises(SnapshotError, match=r"model\.safetensors") as refused:
        check_policy_weights(directory, spec, "the HF directory")
    assert message in str(refused.value)
    with pytest.raises(SnapshotError, match=r"model\.safetensors"):
        load_hf_weights(build_policy(spec), directory)  # the loader checks the header itself too


def test_a_header_transformers_wrote_passes(hf_dir: Path) -> None:
    shapes = safetensors_shapes(hf_dir)
    assert shapes["lm_head.weight"] == ((1024, 64), "float32")


def test_replay_and_diagnose_name_a_malformed_header_of_the_weights_the_run_config_names(
    hf_snapshot: Path, hf_dir: Path, tmp_path: Path, cli
) -> None:
    """A snapshot without weights of its own replays from `model.path`: that directory's header is refused by the
    verbs that build the model, by name, before any process starts (never a raw error from safetensors)."""
    snap = shutil.copytree(hf_snapshot, tmp_path / "job" / hf_snapshot.name)
    for data in [snap / ".metadata", *snap.glob("*.distcp")]:
        data.unlink()
    directory = shutil.copytree(hf_dir, tmp_path / "hf")
    [file] = directory.glob("*.safetensors")
    edit_safetensors_header(file, _shape([-1, 64]))
    config = read_untrusted_yaml(snap / "run_config.yaml")
    config["model"] = {"kind": "hf", "architecture": "qwen3_moe", "path": str(directory)}
    (snap / "run_config.yaml").write_text(yaml.safe_dump(config))

    replay = cli("replay", snap, "--nproc", "1", "--workspace", tmp_path / "ws")
    assert replay.code == 2 and f"{file}: tensor" in replay.err and "has a bad shape [-1, 64]" in replay.err
    assert "Traceback" not in replay.err and not (tmp_path / "ws" / "tmp").exists()
    diagnose = cli("diagnose", snap, "--model", "always")
    assert diagnose.code == 0 and "Traceback" not in diagnose.err
    [line] = [n for n in diagnose.out.splitlines() if n.strip().startswith("model evidence (")]
    assert f"{file}: tensor" in line and "has a bad shape [-1, 64]" in line
