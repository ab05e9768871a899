"""Tests for the report's benchmark section and the results.json keys behind it
(``tasks``, ``needle``): a round trip key for key, malformed parts dropped, and the
before/after table and the needle heatmaps rendered with the values given."""

from __future__ import annotations

import re

from _report_fixture import make_results

from headlab.report import render
from headlab.results import RunResult

TASKS = {"boolq": {"before": {"alias": "boolq", "acc,none": 0.625, "acc_stderr,none": 0.01},
                   "after": {"alias": "boolq", "acc,none": 0.5, "acc_stderr,none": 0.02}}}
NEEDLE = {"before": {"lengths": [256, 512], "depths": [0.0, 1.0],
                     "accuracy": [[1.0, 1.0], [0.5, 1.0]], "trials": 2, "filler": "bundled"},
          "after": {"lengths": [256, 512], "depths": [0.0, 1.0],
                    "accuracy": [[0.0, 0.5], [0.0, 0.0]], "trials": 2, "filler": "bundled"}}


def test_tasks_and_needle_round_trip_and_render():
    d = {**make_results(layers=2, heads=3, seq=6), "tasks": TASKS, "needle": NEEDLE}
    result = RunResult.from_json(d)
    assert result.to_json()["tasks"] == TASKS and result.to_json()["needle"] == NEEDLE
    assert result.needle.before.mean == 0.875 and result.needle.after.mean == 0.125
    html = render(result)
    row = re.search(r"<th scope=\"row\">boolq</th><td>acc,none</td><td>(.*?)</td><td>(.*?)</td>",
                    html)
    assert row.groups() == ("0.625", "0.5")
    assert html.count('class="figure needle"') == 2
    assert "512 tokens, fact at 0%: exact match 0.50" in html
    assert "mean exact match 0.875" in html and "mean exact match 0.125" in html


def test_malformed_tasks_and_needle_are_dropped_and_no_section_is_drawn():
    d = {**make_results(layers=2, heads=3, seq=6), "tasks": {"boolq": 3, "rte": {"before": 1}},
         "needle": {"before": {"lengths": "x"}}}
    result = RunResult.from_json(d)
    assert result.needle is None
    assert result.tasks["rte"].before is None and "boolq" not in result.tasks
    assert "Tasks and long-context retrieval" not in render(RunResult.from_json(
        make_results(layers=2, heads=3, seq=6)))
