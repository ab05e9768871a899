"""RunResult: the one type behind results.json, read back exactly, old files included."""

from __future__ import annotations

import json
import math

import pytest
from _report_fixture import make_results, score_only

from headlab.errors import UserError
from headlab.report import render
from headlab.results import SCHEMA_VERSION, LengthLatency, RunResult
from headlab.schedule import CurvePoint


def _with_losses(results: dict) -> dict:
    """The fixture as a run writes it: every curve point carries its loss."""
    r = json.loads(json.dumps(results))
    for curve in [r["curve"], *r["curves"].values()]:
        for i, p in enumerate(curve):
            p["loss"] = 2.5 + 0.1 * i
    return r


@pytest.mark.parametrize("kind", ["pruned", "score-only"])
def test_a_results_json_without_a_version_reads_back_key_for_key(kind):
    """A results.json written before the schema had a version (the fixture's layout is
    that of main before RunResult) reads into a RunResult whose to_json is the same
    dict, with the version added."""
    old = _with_losses(make_results(layers=3, heads=4, seq=8))
    if kind == "score-only":
        old = score_only(old)
        old["curve"], old["curves"] = [], {}
    old["data"].update(scoring_examples=16, heldout_examples=16)
    old["export"] = None
    result = RunResult.from_json(old)
    assert result.schema_version == 1
    written = result.to_json()
    assert written.pop("schema_version") == 1
    # what schema 2 added, absent from the old file: no recovery ran
    assert written.pop("recovery") is None
    assert written.pop("kv_cache") is None  # no kv-group or demotion run
    assert written["latency_ms"].pop("by_length") == []  # one length timed then
    assert written["latency_ms"].pop("others_load") is None  # not recorded then
    assert written["quality"].pop("pruned") is None
    assert written["quality"].pop("loss_pruned") is None
    # what the calibration / evaluation protocol added (headlab.data.protocol)
    for key in ("eval_spec", "eval_protocol", "eval_seq_len", "calib_samples",
                "calib_seq_len", "separation"):
        assert written["data"].pop(key) is None
    # and the benchmarks: no lm-eval task, no needle test
    assert written.pop("tasks") == {} and written.pop("needle") is None
    assert written == json.loads(json.dumps(old))


def test_a_run_result_round_trips_through_json():
    r = RunResult.from_json(_with_losses(make_results(layers=2, heads=3, seq=6)))
    r.schema_version = SCHEMA_VERSION
    r.latency_ms.by_length = [LengthLatency(40.1, 31.2, batch=16, seq_len=128,
                                            predicted_drop=0.2),
                              LengthLatency(90.5, 60.0, batch=1, seq_len=2048,
                                            predicted_drop=0.35)]
    again = RunResult.from_json(json.loads(json.dumps(r.to_json())))
    assert again == r
    assert isinstance(again.latency_ms.by_length[1], LengthLatency)
    assert isinstance(again.curve[0], CurvePoint) and again.kept_heads == r.kept_heads
    assert all(isinstance(k, int) for k in again.kept_heads)


def test_nan_importance_is_null_in_json_and_nan_in_python():
    r = RunResult(model="m", method="taylor", heads_total=2, importance=[[0.5, math.nan]])
    assert r.to_json()["importance"] == [[0.5, None]]
    back = RunResult.from_json(r.to_json())
    assert back.importance[0][0] == 0.5 and math.isnan(back.importance[0][1])


def test_malformed_parts_read_as_not_measured():
    r = RunResult.from_json({"model": "m", "method": "michel", "heads_total": 2,
                             "importance": [[0.1, 0.2]], "quality": "broken",
                             "latency_ms": [1, 2], "curve": [{"quality": 3}, "x"],
                             "kept_heads": {"0": [1], "x": [0]}, "params": {"before": True}})
    assert r.quality.before is None and r.latency_ms is None and r.curve == []
    assert r.kept_heads == {0: [1]} and r.params.before is None
    assert "not measured" in render(r)


@pytest.mark.parametrize("missing", ["model", "method", "importance", "heads_total"])
def test_a_required_key_missing_is_a_user_error_naming_it(missing):
    d = {"model": "m", "method": "michel", "heads_total": 2, "importance": [[0.1, 0.2]]}
    del d[missing]
    with pytest.raises(UserError, match=missing):
        RunResult.from_json(d)
