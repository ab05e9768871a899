"""The report's head-types section and importance caption, from results.json alone."""

from __future__ import annotations

import math

from headlab.report import render
from headlab.results import RunResult
from tests._report_fixture import make_results, score_only


def _with_types(d: dict) -> dict:
    layers, heads = len(d["importance"]), len(d["importance"][0])
    induction = [[0.1] * heads for _ in range(layers)]
    kept = {int(k): v for k, v in d["kept_heads"].items()}
    pruned = next((layer, h) for layer in range(layers) for h in range(heads)
                  if h not in kept[layer])
    induction[pruned[0]][pruned[1]] = 0.9
    induction[0][0] = math.nan
    sink = [[0.2] * heads for _ in range(layers)]
    return {**d, "head_types": {"induction": induction, "sink": sink}}, pruned


def test_head_types_round_trip_and_render():
    d, (layer, head) = _with_types(make_results(layers=4, heads=6))
    result = RunResult.from_json(d)
    back = RunResult.from_json(result.to_json())
    assert back.to_json()["head_types"]["induction"][0][0] is None
    assert back.head_types["induction"][layer][head] == 0.9
    page = render(result)
    assert '<section id="head-types">' in page
    assert f"Pruned heads of this type: L{layer}H{head} 0.90." in page
    assert "Pruned heads of this type: none." in page  # no sink head reaches 0.5
    assert "The iterative schedule re-scored the heads left after each step" in page


def test_without_head_types_there_is_no_section_and_score_runs_say_no_pruning():
    page = render(RunResult.from_json(make_results(layers=4, heads=6)))
    assert 'id="head-types"' not in page
    d, _ = _with_types(make_results(layers=4, heads=6))
    page = render(RunResult.from_json(score_only(d)))
    assert '<section id="head-types">' in page and "Pruned heads of this type" not in page
    assert "re-scored" not in page
