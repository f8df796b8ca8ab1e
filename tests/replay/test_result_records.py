"""A replay result's sub-records are typed, and a result file written by an earlier version still reads: a footprint
without the later fractions gets them from its counts, a consistency without the later fields takes their defaults,
a verdict basis of a shape no kind has stays the JSON object it was and is written back so, and a clean gradient of
any version is written back byte for byte, in the file and in a tool's reply; so is each of its `top_params`, a typed
record every reader takes by name (a key of another version kept in its place)."""

from __future__ import annotations

import json

import pydantic_core
from pydantic import TypeAdapter

from axrl_spike_replay.experiment.result import CleanGradient, Footprint, ParamNorm, ReplayResult
from axrl_spike_replay.experiment.verdict import BaselineBasis, HypothesisBasis, MitigatedBasis, basis_from_json
from axrl_spike_replay.jsonable import to_jsonable
from axrl_spike_replay.snapshot.consistency import Consistency, ConsistencyProblem
from axrl_spike_replay.training.precision import PrecisionPolicy

RESULT = {
    "snapshot": "/runs/iter_0000005",
    "backend": "torch",
    "target": "local",
    "fidelity": "full",
    "world_size_saved": 2,
    "world_size_used": 2,
    "mitigations": {"advantage_clip": 1.0},
    "grad_norm": 3.0,
    "recorded_grad_norm": 37.42,
    "rel_diff": 0.92,
    "median_norm": 2.91,
    "spike_ratio": 1.03,
    "verdict": "cleared",
    "threshold": 5.0,
}


def test_an_early_footprint_gets_its_later_fractions_from_its_counts() -> None:
    early = {"loss_tokens": 40, "masked_tokens": 4, "changed_tokens": 6, "samples": 8, "touched_samples": 2,
             "token_fraction": 0.25, "sample_fraction": 0.25}  # fmt: skip
    f = Footprint.from_json(early)
    assert f.masked_samples == 0 and f.masked_token_fraction == 0.1 and f.masked_sample_fraction == 0.0
    assert f.token_fraction == 0.25  # a fraction the file holds is kept as written
    assert ReplayResult(**{**RESULT, "footprint": early}).footprint == f
    assert ReplayResult(**{**RESULT, "footprint": {}}).footprint is None  # nothing recorded reads as nothing


def test_an_early_consistency_reads_with_the_later_fields_at_their_defaults() -> None:
    early = {"checked": ["ranks_vs_files"], "problems": [{"name": "grad_norm_vs_log", "message": "off by 2x"}],
             "self_consistent": True, "agrees_with_log": False}  # fmt: skip
    c = Consistency.from_json(early)
    assert c.problems == [ConsistencyProblem("grad_norm_vs_log", "off by 2x")] and c.skipped == {}
    assert c.summary().startswith("snapshot agrees with itself; contradicts the training log (1 check: ranks_vs_files")


def test_each_kind_of_verdict_basis_is_typed_and_a_shape_of_none_stays_as_read() -> None:
    mitigated = to_jsonable(MitigatedBasis(5.0, "detector", 5.0, 1.03, 12.9, -0.92, rule="r"))
    baseline = {"rel_diff": 1e-7, "tolerance": 1e-5, "tolerance_rule": "layout", "rule": "r", "threshold": 5.0,
                "threshold_source": "detector"}  # fmt: skip
    hypothesis = {"rel_diff": 0.0, "tolerance": 1e-5, "rank_losses": [{"rank": 0, "matches": None}], "rule": "r",
                  "threshold": 5.0, "threshold_source": "detector"}  # fmt: skip
    assert isinstance(basis_from_json(mitigated), MitigatedBasis)
    assert isinstance(basis_from_json(baseline), BaselineBasis)
    assert isinstance(basis_from_json(hypothesis), HypothesisBasis)
    early = {"rel_diff": 1e-7, "tolerance": 1e-5, "rule": "r"}  # before the threshold was recorded beside it
    assert basis_from_json(early) == early and type(basis_from_json(early)) is dict
    for basis in (mitigated, baseline, hypothesis, early):
        doc = {**RESULT, "verdict_basis": basis, "precision": PrecisionPolicy().describe()}
        again = to_jsonable(ReplayResult.from_json(json.loads(json.dumps(doc))))
        assert json.dumps(again["verdict_basis"]) == json.dumps(basis)
        assert again["precision"] == {"param_dtype": "float32", "reduce_dtype": "float32", "output_dtype": None,
                                      "source": "run_config"}  # fmt: skip


# the clean gradient as the engine writes it today: found by a search, and the baseline already under the bar (no
# probes, no token counts); and as results written before the token definition kept it (samples only)
SEARCHED = {"left_out": ["0:1", "1:3"], "wholly_left_out": ["0:1"], "tokens_left_out": 5, "loss_tokens": 40,
            "token_share_left_out": 0.125, "share_left_out": 0.97, "reached": True, "reason": None, "bar": 14.55,
            "grad_norm": 3.1, "ratio_to_median": 1.07, "baseline_cosine": 0.12, "passes": 4,
            "probe_norms": {"2": 30.0, "4": 17.5, "5": 3.1}, "recomputed": ["old_logprobs", "rollout_logprobs"],
            "definition": "the baseline gradient without ..."}  # fmt: skip
UNDER_THE_BAR = {"left_out": [], "wholly_left_out": [], "tokens_left_out": 0, "share_left_out": 0.0, "reached": True,
                 "reason": None, "bar": 14.55, "grad_norm": 3.0, "ratio_to_median": 1.03, "baseline_cosine": 1.0,
                 "passes": 0, "definition": "d"}  # fmt: skip
EARLY = {"left_out": ["0:1"], "share_left_out": 0.93, "reached_share": 0.9, "grad_norm": 2.5, "baseline_cosine": 0.2}


def test_a_clean_gradient_of_every_version_is_typed_and_written_back_byte_for_byte() -> None:
    reply: TypeAdapter[ReplayResult] = TypeAdapter(ReplayResult)  # what an MCP tool's structured reply holds
    for clean in (SEARCHED, UNDER_THE_BAR, EARLY):
        text = json.dumps({**RESULT, "clean_gradient": clean})
        result = ReplayResult.from_json(json.loads(text))
        assert isinstance(result.clean_gradient, CleanGradient)
        written = json.dumps(to_jsonable(result))  # a whole result file, as the engine writes it
        assert json.dumps(json.loads(written)["clean_gradient"]) == json.dumps(clean)
        assert json.dumps(to_jsonable(ReplayResult.from_json(json.loads(written)))) == written
        assert json.dumps(reply.dump_python(result, mode="json")["clean_gradient"]) == json.dumps(clean)
        text_reply = json.loads(pydantic_core.to_json(result, fallback=str))  # a tool's text block
        assert json.dumps(text_reply["clean_gradient"]) == json.dumps(clean)
    searched = ReplayResult.from_json({**RESULT, "clean_gradient": SEARCHED}).clean_gradient
    assert searched is not None and searched.probe_norms == {"2": 30.0, "4": 17.5, "5": 3.1} and searched.reached
    assert searched.describe().startswith("the on-policy gradient (the stored old logprobs and rollout logprobs")
    early = CleanGradient.from_json(EARLY)
    assert early.tokens_left_out is None and early.extra == {"reached_share": 0.9}
    assert early.describe() == "the baseline without its top-attributed samples 0:1"
    built = CleanGradient(left_out=["0:1"], share_left_out=0.93)  # made in code: the fields it has, in their order
    assert built.to_json() == {"left_out": ["0:1"], "share_left_out": 0.93}


# `top_params` as the engine writes them today (a non-finite norm is null), and an entry of another version with a
# key before and after the two it has
TODAY = [{"name": "layers.1.experts.3.w2", "grad_norm": 41.5}, {"name": "lm_head.weight", "grad_norm": None}]
OTHER = [{"shape": [64, 32], "name": "layers.0.w1", "grad_norm": 2.5, "rank_norms": [1.0, 2.0]}]


def test_top_params_are_typed_and_written_back_byte_for_byte() -> None:
    reply: TypeAdapter[ReplayResult] = TypeAdapter(ReplayResult)
    for params in (TODAY, OTHER):
        text = json.dumps({**RESULT, "top_params": params})
        result = ReplayResult.from_json(json.loads(text))
        assert all(isinstance(p, ParamNorm) for p in result.top_params)
        written = json.dumps(to_jsonable(result))
        assert json.dumps(json.loads(written)["top_params"]) == json.dumps(params)
        assert json.dumps(to_jsonable(ReplayResult.from_json(json.loads(written)))) == written
        assert json.dumps(reply.dump_python(result, mode="json")["top_params"]) == json.dumps(params)
        assert json.dumps(json.loads(pydantic_core.to_json(result, fallback=str))["top_params"]) == json.dumps(params)
    (other,) = ReplayResult.from_json({**RESULT, "top_params": OTHER}).top_params
    assert (other.name, other.grad_norm) == ("layers.0.w1", 2.5)
    assert other.extra == {"shape": [64, 32], "rank_norms": [1.0, 2.0]}
    built = ParamNorm("w", 1.5)  # made in code: its two keys, in order
    assert built.to_json() == {"name": "w", "grad_norm": 1.5}
    assert reply.validate_python({**RESULT, "top_params": TODAY}).top_params[1] == ParamNorm.from_json(TODAY[1])
