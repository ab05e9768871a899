"""Tests for headlab.bench: structure of what the benchmarks write, not their speed.

Every benchmark runs once at the "tiny" preset (random tiny models, one thread) and its
JSON is checked: every figure has median and spread, every target has ratio, target and
a ``meets`` that follows from the ratio, and every figure's median and quartiles follow
from its samples, ratios from the paired times of the same rounds. The FLOP counter is
checked against counts done by hand; the switched-off hooks against the real forward;
the table against the targets.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _scripts import script

from headlab import bench
from headlab.bench import (
    PRESETS,
    BenchResult,
    Figure,
    Target,
    count_flops,
    markdown_table,
    run_benchmarks,
)
from headlab.bench._models import ModelCache, model_cache
from headlab.bench.hooks import peak_bytes
from headlab.errors import UserError
from headlab.models.gpt2 import GPT2, GPT2Config
from headlab.models.llama import Llama, LlamaConfig
from headlab.runs.config import DEFAULT_METHOD

NAMES = ["attention", "models", "hooks", "importance", "pruning", "generate"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """All benchmarks at the tiny preset, one thread (the machine may be shared)."""
    out = tmp_path_factory.mktemp("bench")
    results = run_benchmarks("all", quick=True, device="cpu", out=out, preset="tiny",
                             threads=1)
    return out, results


# ---------------------------------------------------------------------- figures, targets
def test_figure_median_and_interquartile_spread():
    f = Figure.of([5.0, 1.0, 3.0, 2.0, 4.0], "ms")
    assert (f.median, f.q1, f.q3, f.min, f.max, f.n) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    assert f.spread == 2.0
    one = Figure.of([7.0], "x")
    assert (one.median, one.spread) == (7.0, 0.0)
    with pytest.raises(ValueError):
        Figure.of([], "x")


def test_meets_follows_the_ratio_on_hand_made_figures():
    fig = Figure.of([0.90, 0.97, 1.05], "x")  # median 0.97
    assert Target.judge("f", fig, target=0.95, op=">=", what="w").meets is True
    assert Target.judge("f", fig, target=1.0, op=">=", what="w").meets is False
    assert Target.judge("f", fig, target=1.02, op="<=", what="w").meets is True
    assert Target.judge("f", fig, target=0.9, op="<=", what="w").meets is False
    exact = Figure.of([1.3], "x")
    assert Target.judge("f", exact, target=1.3, op="<=", what="w").meets is True
    nan = Figure.of([math.nan], "x")
    assert Target.judge("f", nan, target=0.0, op=">=", what="w").meets is False
    with pytest.raises(ValueError, match="op"):
        Target.judge("f", fig, target=1.0, op=">", what="w")


def test_target_json_holds_ratio_target_and_meets():
    r = BenchResult("demo")
    r.add("speed", [0.8, 0.9, 1.0], "x")
    t = r.add_target("speed", target=1.0, op=">=", what="demo speed")
    j = r.to_json({"date": "d"})["targets"][0]
    assert j["ratio"] == pytest.approx(0.9) and j["target"] == 1.0 and j["meets"] is False
    assert j["meets"] is t.meets
    assert j["spread"] == pytest.approx(0.1)


# ---------------------------------------------------------------------- the tiny run
@pytest.mark.parametrize("name", NAMES)
def test_each_benchmark_writes_complete_json(tiny_run, name):
    out, _ = tiny_run
    d = json.loads((out / f"{name}.json").read_text())
    assert d["benchmark"] == name and d["error"] is None
    assert d["preset"] == "tiny" and d["device"] == "cpu"
    assert {"headlab", "torch", "transformers"} <= set(d["versions"])
    assert {"cpu", "cores", "torch_threads"} <= set(d["machine"])
    assert d["machine"]["torch_threads"] == 1
    assert d["date"]
    sizes = PRESETS["tiny"][name]
    assert d["config"]["dtype"] == "float32"
    assert (d["config"]["repeats"], d["config"]["warmup"]) == (sizes.repeats, sizes.warmup)
    assert d["figures"] and d["targets"]
    for fname, fig in d["figures"].items():
        assert {"median", "spread", "q1", "q3", "n", "unit"} <= set(fig), fname
        samples = fig["samples"]
        assert len(samples) == fig["n"] and all(math.isfinite(x) for x in samples), fname
        assert fig["median"] == pytest.approx(statistics.median(samples)), fname
        assert (fig["min"], fig["max"]) == (min(samples), max(samples)), fname
        if len(samples) > 1:
            q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
            assert (fig["q1"], fig["q3"]) == (pytest.approx(q1), pytest.approx(q3)), fname
        if fig["unit"] in ("ms", "tokens/s", "GB/s", "ns", "MiB"):
            assert fig["median"] > 0, fname
        assert fig["q1"] <= fig["median"] <= fig["q3"], fname
        assert fig["spread"] == pytest.approx(fig["q3"] - fig["q1"])
    for t in d["targets"]:
        assert {"ratio", "target", "meets", "op", "figure"} <= set(t)
        assert t["ratio"] == d["figures"][t["figure"]]["median"]
        expected = t["ratio"] >= t["target"] if t["op"] == ">=" else t["ratio"] <= t["target"]
        assert t["meets"] is expected
    for i in d["info"]:
        assert i["figure"] in d["figures"]


def test_each_benchmark_has_its_targets(tiny_run):
    _, results = tiny_run
    figures = {r.name: {t.figure for t in r.targets} for r in results}
    assert figures["attention"] == {"speed_vs_sdpa_S16", "speed_vs_torch_mha_S16",
                                    "speed_vs_sdpa_S32", "speed_vs_torch_mha_S32",
                                    "decode_last_over_first"}
    assert figures["models"] == {f"{m.name}.speed_vs_transformers"
                                 for m in PRESETS["tiny"]["models"].models}
    assert figures["hooks"] == {"idle_over_switched_off"}
    assert figures["importance"] == {"scoring_over_forward_backward"}
    assert figures["pruning"] == {"B4_S16.drop_over_predicted",
                                  "S64.heads.drop_over_predicted"}
    long = {f for f in figures["generate"] if f.startswith("long_")}
    assert figures["generate"] - long == {"speed_vs_transformers", "kernel_over_torch_products"}
    # the long-context section: exact cache bytes at both contexts, the demotion speed-up
    assert {"long_pruned_cache_error_bytes_at_32", "long_demoted_cache_error_bytes_at_32",
            "long_pruned_cache_error_bytes_at_252", "long_demoted_cache_error_bytes_at_252",
            "long_demoted_speedup_over_predicted", "long_pruned_speedup_over_predicted"} <= long
    assert {f"long_{m}_headroom_over_budget_bytes" for m in ("before", "pruned", "demoted")
            } <= long
    # the gates-vs-best and default-vs-FLAP quality bars are judged on causal LMs only
    assert figures["quality"] == {"minilm-l6.michel_unnormalised_over_random",
                                  "minilm-l6.gates_seconds_over_michel",
                                  "minilm-l6.default_seconds_over_flap"}
    assert figures["recovery"] == {"minilm-l6.kept_over_none", "minilm-l6.recover_over_michel",
                                   "minilm-l6.keep_1_max_abs_diff",
                                   "minilm-l6.rescale_kept_over_none"}


def test_schedule_study_judges_each_variant_on_calibration_windows_it_did_not_score(
        monkeypatch):
    """scripts/schedule_study.py, behind the docs' tables of schedules and probes and of
    gate training: one row per variant, the iterative one re-scoring at each step (its
    probes drawn from the seed a last ``sN`` names), gates trained once toward the heads
    kept, every figure measured."""
    import headlab

    schedule, seeds = headlab.prune_to_target, []

    def spied(*args, **kwargs):
        seeds.append(kwargs["seed"])
        return schedule(*args, **kwargs)

    monkeypatch.setattr(headlab, "prune_to_target", spied)
    study = script("schedule_study").study(
        "minilm-l6", ["one-shot:0.2:1", "iterative:0.2:2", "gates:3:0.1:1.0",
                      "iterative:0.2:2:s1"], seq_len=32, score_tokens=256, judge_tokens=256)
    assert study["score_tokens"] > 0 and study["judge_tokens"] > 0
    one_shot, iterative, gates, seeded = study["rows"]
    assert seeds == [0, 0, 1]
    assert one_shot["scorings"] == 1 and iterative["scorings"] == 2  # 72 -> 58 -> 44 heads
    assert seeded["scorings"] == 2
    assert gates["scorings"] == 1 and 44 < gates["expected_open"] <= 72  # 3 steps: far off
    for row in study["rows"]:
        assert all(math.isfinite(row[k]) and row[k] > 0
                   for k in ("pruned", "lsq", "score_s", "lsq_s"))
        assert row["pruned"] != study["before"]  # fidelity: something was removed


def test_recovery_tradeoff_table(tiny_run):
    """One row per size, the unpruned model's first: heads and parameters fall with each
    size, each row's quality and latency are measured, and the page renders them."""
    out, results = tiny_run
    rows = {r.name: r for r in results}["recovery"].checks["tradeoff"]
    assert [r["keep"] for r in rows] == [1.0, 0.8, 0.6, 0.4]
    assert [r["heads"] for r in rows] == [72, 58, 44, 29]  # MiniLM: 6 layers x 12 heads
    assert all(a["params"] > b["params"] for a, b in zip(rows, rows[1:], strict=False))
    assert rows[0]["pruned"] == rows[0]["repaired"]  # nothing to repair
    assert all(r["latency_ms"] > 0 and r["kv_bytes_per_token"] is None for r in rows)
    assert rows[0]["latency_ms"] == rows[1]["latency_before_ms"]
    page = script("bench_tables").render(sorted(out.glob("*.json")))
    assert "| minilm-l6 | 0.6 | 44 | " in page and "no cache" in page
    recovery = {r.name: r for r in results}["recovery"]
    # the sizes are chosen as `headlab prune` chooses them by default, and it says so
    d = json.loads((out / "recovery.json").read_text())
    assert d["config"]["prune_method"] == DEFAULT_METHOD
    assert f"method='{DEFAULT_METHOD}'" in recovery.method["pruning"]
    # rescale, Kwon et al.'s, on the same pruned model, held to no worse than no repair
    (t,) = [t for t in recovery.targets if t.figure == "minilm-l6.rescale_kept_over_none"]
    assert (t.target, t.op) == (1.0, "<=")
    assert math.isfinite(recovery.figures[t.figure].median)


def test_recovery_trains_a_targeted_method_toward_each_keep(monkeypatch):
    """Where the method that prunes trains toward its target (the gates), bench recovery
    prunes as `headlab prune --keep` would at each size: one training toward each keep,
    one-shot, not one schedule stopped on the way to the smallest."""
    import headlab.schedule
    from headlab.bench.recovery import RecoverySizes, bench_recovery

    schedule, asked = headlab.schedule.prune_to_target, []

    def spied(*args, **kwargs):
        result = schedule(*args, **kwargs)
        asked.append((kwargs["n_keep"], len(result.step_scores)))
        return result

    monkeypatch.setattr(headlab.schedule, "prune_to_target", spied)
    sizes = RecoverySizes(runs=(("minilm-l6", 32, 256, ()),), step=0.4, latency_length=32,
                          latency_rounds=1, prune_method="gates", also={})
    res = bench_recovery(sizes)
    assert asked == [(58, 1), (44, 1), (29, 1)]  # MiniLM: 72 heads, keeps 0.8, 0.6, 0.4
    assert [r["heads"] for r in res.checks["tradeoff"]] == [72, 58, 44, 29]
    assert "toward each of keeps" in res.method["pruning"]


def test_quality_grid_has_every_method_at_every_keep_and_the_docs_render_it(tiny_run):
    """bench quality's grid: each method pruned and after lsq (flap also after its bias
    compensation), the seeded ones (random, taylor, gates) over 3 seeds, at each keep; the
    docs table shows every row."""
    out, _ = tiny_run
    d = json.loads((out / "quality.json").read_text())
    sizes = PRESETS["tiny"]["quality"]
    # measured in parts, for --resume; the parts' checkpoint goes once the run completes
    assert list(d["checks"]["parts"])[:2] == ["minilm-l6:timing", "minilm-l6:michel_unnormalised"]
    assert not (out / "quality.parts").exists()
    g = d["checks"]["minilm-l6.grid"]
    assert g["keeps"] == list(sizes.keeps) and g["total_heads"] == 72
    assert g["heads_kept"] == [math.ceil(k * 72) for k in sizes.keeps]
    expected = [(m, r) for m in sizes.methods for r in ("none", "lsq")] + [
        ("flap", "bias"), ("random", "none"), ("random", "lsq")]
    assert sorted((r["method"], r["repair"]) for r in g["rows"]) == sorted(expected)
    for r in g["rows"]:
        assert len(r["quality"]) == len(r["lost"]) == len(sizes.keeps)
        for q, lost in zip(r["quality"], r["lost"], strict=True):  # fidelity: lost = 1 - q
            assert lost == pytest.approx(g["before"] - q, abs=1e-12)
        # the methods whose heads depend on a seed: the mean over the seeds, each kept
        assert ("samples" in r) is (r["method"] in ("random", "taylor", "gates", "gates_token"))
        if "samples" in r:
            assert [len(s) for s in r["samples"]] == [3] * len(sizes.keeps)
            assert r["lost"] == pytest.approx([statistics.mean(s) for s in r["samples"]])
    assert set(g["seconds"]) == {"michel", "gates", "gates+lsq", "flap", "flap+bias"}
    assert "minilm-l6.timing" not in d["checks"] and d["checks"]["minilm-l6.tokens"]["heldout"]
    # one gate training per seed and keep, drawn per block and per token, each toward
    # that keep's heads, and where it ended
    assert [t["target"] for t in g["gates_ended"]] == g["heads_kept"] * 3 * 2
    assert all(t["target_met"] == (abs(t["expected_open"] - t["target"])
                                   <= 0.02 * t["target"]) for t in g["gates_ended"])
    table = script("bench_tables").table(d)
    assert "| keep 0.8 (58 heads) | keep 0.6 (44 heads) |" in table
    assert "| flap | bias |" in table and "| random (mean of 3 seeds) | lsq |" in table
    assert "| gates (mean of 3 seeds) | none |" in table and "| michel | none |" in table
    assert sum(line.startswith("| ") and " | lsq | " in line for line in table.splitlines()) \
        == len(sizes.methods) + 1


def test_references_compute_the_same_function(tiny_run):
    """The speed comparisons are only fair if both sides compute the same thing."""
    _, results = tiny_run
    by = {r.name: r for r in results}
    for key, value in by["attention"].checks.items():
        assert value < 1e-5, key
    for key, value in by["models"].checks.items():
        if key.endswith("max_abs_diff"):
            assert value < 1e-4, key
    hooks = by["hooks"].checks
    assert hooks["switched_off_output_identical"] is True
    assert hooks["switched_off_captures_nothing"] is True
    gen = by["generate"].checks
    assert gen["new_tokens"] == {"headlab": 8, "headlab_torch_products": 8, "transformers": 8}
    assert gen["kernel_and_torch_products_agree_before_first_difference"] == 8
    # the tiny random Llama has no tokenizer: no needle, and the run says so
    assert gen["long_needle"] == "not measured: the model has no tokenizer"
    assert gen["long_choosers"] == dict.fromkeys(("retrieval", "gates"),
                                                 "not measured: the model has no tokenizer")


def test_long_context_needle_runs_the_same_prompts_on_the_three_models(gqa_dir):
    """The needle half on a tiny Llama with a tokenizer: one grid per model (the groups
    demoted as michel, the retrieval detector and the gates choose them), past the
    demoted heads' 2 sinks + 18 window; a random model finds no needle, so removal loses
    nothing and the target is not judged rather than passed."""
    import headlab
    from headlab.bench.long_context import LongContextSizes, long_context_section

    sizes = LongContextSizes(contexts=(32,), steps=2, sinks=2, window=18, scoring_tokens=64,
                             scoring_seq=32, needle_lengths=(64, 128, 1024),
                             needle_depths=(0.0, 0.5, 1.0), needle_trials=2, gate_steps=3)
    res = BenchResult.of_sizes("generate", sizes)
    long_context_section(res, headlab.load(gqa_dir), sizes, "cpu")
    grids = res.checks["long_needle"]
    assert set(grids) == {"before", "pruned", "demoted", "demoted_by_retrieval",
                          "demoted_by_gates"}
    for grid in grids.values():  # 1024 is past the model's 256 positions: left out
        assert grid["lengths"] == [64, 128] and grid["depths"] == [0.0, 0.5, 1.0]
        assert grid["trials"] == 2 and grid["filler"].startswith("the held-out tokens")
        assert len(grid["accuracy"]) == 2 and all(len(row) == 3 for row in grid["accuracy"])
    for name in grids:
        fig = res.figures[f"long_{name}_needle_accuracy"]
        assert fig.median == pytest.approx(
            sum(map(sum, grids[name]["accuracy"])) / 6, abs=1e-12)
    assert res.figures["long_before_needle_accuracy"].median == 0.0
    assert "long_needle_lost_demoted_over_removed" not in res.figures
    assert res.checks["long_needle_target"].startswith("not judged: removing the groups "
                                                       "lost nothing")
    assert "long_context_needle" in res.method
    # each chooser demotes as many groups (3 of 6) as michel, the ones it scores lowest
    from headlab.detectors import detect
    from headlab.selection import kv_groups, select_groups

    model = headlab.load(gqa_dir)
    chosen = res.checks["long_choosers"]
    plan = select_groups(detect(model, "retrieval", seq_len=128, seed=0), kv_groups(model), 3)
    assert chosen["retrieval"]["demoted"] == {str(k): v for k, v in plan.pruned.items() if v}
    alphas = chosen["gates"]["alphas"]  # (L, H_kv): the 3 groups with the lowest demoted
    ranked = sorted((a, layer, g) for layer, row in enumerate(alphas) for g, a in enumerate(row))
    assert ranked[2][0] < ranked[3][0]
    lowest = {(layer, g) for _, layer, g in ranked[:3]}
    demoted = {(int(layer), h // 2) for layer, heads in chosen["gates"]["demoted"].items()
               for h in heads}
    assert demoted == lowest and chosen["gates"]["seconds"] > 0
    for name in ("demoted_by_retrieval", "demoted_by_gates"):
        assert res.checks["long_perplexity"][name] > 0


@pytest.mark.parametrize(("name", "prefix", "target"), [
    ("demoted_by_gates", "long_needle", 0.25), ("demoted_by_gates", "long_quality", 0.05),
    ("demoted_by_retrieval", "long_needle", None)])
def test_the_gates_demotion_targets_and_the_retrieval_ratio_reported(name, prefix, target):
    """DuoAttention's groups are held to issue 34's bars (needle 0.25, perplexity 0.05 of
    removal's loss); the retrieval detector's ratio is reported without a target."""
    from headlab.bench.long_context import _lost_ratio

    res = BenchResult("generate")
    _lost_ratio(res, prefix, removed=2.0, demoted=0.2, what="x", name=name)
    figure = f"{prefix}_lost_{name}_over_removed"
    assert res.figures[figure].median == pytest.approx(0.1, rel=1e-12)
    if target is None:
        assert res.targets == []
    else:
        (t,) = res.targets
        assert (t.figure, t.target, t.op, t.meets) == (figure, target, "<=",
                                                       target >= 0.1)


@pytest.mark.parametrize(("removed", "demoted", "ratio", "meets"), [
    (0.5, 0.2, 0.4, True),  # demotion loses 0.4 of what removal loses
    (0.5, 0.3, 0.6, False),
    (0.5, -0.1, -0.2, True),  # demotion gains
])
def test_the_lost_ratio_target_is_demotion_over_removal(removed, demoted, ratio, meets):
    from headlab.bench.long_context import QUALITY_TARGET, _lost_ratio

    res = BenchResult("generate")
    _lost_ratio(res, "long_needle", removed=removed, demoted=demoted, what="needle")
    (t,) = res.targets
    assert (t.figure, t.target, t.op) == ("long_needle_lost_demoted_over_removed",
                                          QUALITY_TARGET, "<=")
    assert t.ratio == pytest.approx(ratio, rel=1e-12) and t.meets is meets


@pytest.mark.parametrize("removed", [0.0, -0.25])
def test_the_lost_ratio_is_undefined_where_removal_loses_nothing(removed):
    from headlab.bench.long_context import _lost_ratio

    res = BenchResult("generate")
    _lost_ratio(res, "long_needle", removed=removed, demoted=0.5, what="needle")
    assert res.targets == [] and res.figures == {}
    assert "ratio is undefined" in res.checks["long_needle_target"]


def _paired(fig: Figure, num: Figure, den: Figure) -> None:
    """``fig`` holds, round by round, num / den."""
    assert fig.n == num.n == den.n
    expected = [a / b for a, b in zip(num.samples, den.samples, strict=True)]
    assert list(fig.samples) == pytest.approx(expected, rel=1e-12)


def test_ratio_figures_are_the_paired_ratios_of_their_rounds(tiny_run):
    """A speed ratio is headlab's rate over the reference's in the same round, not, say,
    its inverse or a ratio of medians."""
    _, results = tiny_run
    by = {r.name: r.figures for r in results}
    gen = by["generate"]
    _paired(gen["speed_vs_transformers"], gen["headlab_tokens_per_s"],
            gen["transformers_tokens_per_s"])
    _paired(gen["kernel_over_torch_products"], gen["headlab_tokens_per_s"],
            gen["headlab_torch_products_tokens_per_s"])
    for m in PRESETS["tiny"]["models"].models:
        _paired(by["models"][f"{m.name}.speed_vs_transformers"],
                by["models"][f"{m.name}.headlab_tokens_per_s"],
                by["models"][f"{m.name}.transformers_tokens_per_s"])
    hooks = by["hooks"]
    _paired(hooks["idle_over_switched_off"], hooks["idle_hooks_ms"],
            hooks["hooks_switched_off_ms"])


def test_pruning_records_flops_and_prediction(tiny_run):
    _, results = tiny_run
    r = next(r for r in results if r.name == "pruning")
    flops = r.checks["flops"]["B4_S16"]
    assert flops["after"]["total"] < flops["before"]["total"]
    assert flops["predicted_drop"] == pytest.approx(
        1 - flops["after"]["total"] / flops["before"]["total"])
    assert sum(r.checks["heads_per_layer_after"]) == 4  # half of 2 layers x 4 heads


def test_pruning_by_length_times_both_units_within_the_positions(tiny_run):
    """The length sweep on the tiny Llama (256 positions: 512 left out): query heads kept
    by 0.6 and key/value groups by 0.5, each timed and predicted at every length, the
    predicted drop growing with S as the S^2 attention terms take a larger share."""
    _, results = tiny_run
    r = next(r for r in results if r.name == "pruning")
    table = r.checks["by_length"]
    assert list(table) == ["16", "64"]
    heads = r.checks["by_length_heads"]
    assert sum(heads["heads"]) == 5  # 0.6 of 2 layers x 4 heads
    assert sum(heads["kv_groups"]) == 4  # 2 of 4 groups of 2 query heads
    for S, row in table.items():
        for unit in ("heads", "kv_groups"):
            predicted = 1 - row[unit]["flops"]["total"] / row["flops_before"]["total"]
            assert row[unit]["predicted_drop"] == pytest.approx(predicted, rel=1e-12)
            assert row[unit]["after_ms"] > 0
            assert r.figures[f"S{S}.{unit}.predicted_drop"].median == pytest.approx(predicted)
            assert r.figures[f"S{S}.{unit}.drop"].n == 2
    for unit in ("heads", "kv_groups"):
        assert 0 < table["16"][unit]["predicted_drop"] < table["64"][unit]["predicted_drop"]


def test_serving_headroom_fills_the_budget_and_decodes_within_it(tiny_run):
    """The tiny Llama's budget is its own cache at 2 rows x (64 + 3 + 1) positions: half
    its groups removed fit 4 rows, the same groups demoted (2 sinks + 8 slots) fit as
    many as their bytes allow; each decoded batch holds exactly the predicted cache,
    within the budget, and one more row would not fit."""
    _, results = tiny_run
    gen = next(r for r in results if r.name == "generate")
    head = gen.checks["long_headroom"]
    assert (head["before"]["rows"], head["pruned"]["rows"]) == (2, 4)
    # per row: one full group x 68 positions + one demoted x 10 slots, of 2 x 68
    assert head["demoted"]["rows"] == (2 * 2 * 68) // (68 + 10) == 3
    for name, h in head.items():
        assert h["held"] == h["predicted"] <= h["budget"], name
        assert h["predicted"] // h["rows"] * (h["rows"] + 1) > h["budget"], name
        assert gen.figures[f"long_{name}_headroom_tokens_per_s"].median > 0
        assert gen.figures[f"long_{name}_headroom_over_budget_bytes"].median == 0


def test_memory_figures_come_from_a_real_measurement(tiny_run):
    _, results = tiny_run
    r = next(r for r in results if r.name == "hooks")
    # the capture holds every pattern (B, H, S, S) float32 of both layers
    expected = 2 * 2 * 4 * 16 * 16 * 4 / 2**20
    assert r.figures["captured_mib"].median == pytest.approx(expected)
    assert r.figures["capture_peak_mib"].median >= expected
    assert r.figures["plain_forward_peak_mib"].median > 0


def test_table_lists_every_target(tiny_run):
    out, results = tiny_run
    summary = (out / "summary.md").read_text()
    for r in results:
        for t in r.targets:
            assert t.what in summary
    rows = [line for line in summary.splitlines() if line.startswith("| ") and "---" not in line]
    n_targets = sum(len(r.targets) for r in results)
    n_info = sum(len(r.info) for r in results)
    assert len(rows) == 1 + n_targets + n_info  # header + one row each


def test_table_marks_misses_and_errors():
    ok = BenchResult("a")
    ok.add("x", [2.0], "x")
    ok.add_target("x", target=1.0, op=">=", what="passes")
    ok.add_target("x", target=3.0, op=">=", what="misses")
    bad = BenchResult("b", error="RuntimeError: boom | bang")
    table = markdown_table([ok, bad])
    assert "| a | passes | 2 | 2–2 | >= 1 | yes |" in table
    assert "| a | misses | 2 | 2–2 | >= 3 | **no** |" in table
    assert "NOT MEASURED: RuntimeError: boom \\| bang" in table


def test_run_prints_the_table(tmp_path, capsys):
    run_benchmarks("attention", quick=True, device="cpu", out=tmp_path, preset="tiny",
                   threads=1)
    printed = capsys.readouterr().out
    assert printed.startswith("| benchmark | measure |")
    assert "decode: last 8 of 48 steps" in printed
    assert (tmp_path / "attention.json").is_file()


def test_the_footer_and_json_count_other_processes_cpu_not_the_load_average(tmp_path, capsys):
    """The load average counts the benchmarks' own threads; what other processes used
    comes from /proc: a process spinning beside the run is about a core's worth."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        run_benchmarks("attention", quick=True, device="cpu", out=tmp_path, preset="tiny",
                       threads=1)
    finally:
        spinner.kill()
        spinner.wait()
    footer = capsys.readouterr().out.splitlines()[-1]
    said = re.search(r"other processes used (\d+\.\d) of the \d+ cores on average", footer)
    assert said and float(said.group(1)) > 0.6, footer
    machine = json.loads((tmp_path / "attention.json").read_text())["machine"]
    assert machine["others_load"] > 0.6


def test_a_failing_benchmark_is_recorded_not_skipped(tmp_path, monkeypatch):
    def boom(sizes, *, device, models):
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(bench.BENCHMARKS, "attention", boom)
    with pytest.raises(UserError, match="attention"):
        run_benchmarks("attention", quick=True, device="cpu", out=tmp_path, preset="tiny")
    d = json.loads((tmp_path / "attention.json").read_text())
    assert d["error"] == "RuntimeError: no such kernel"
    assert "NOT MEASURED" in (tmp_path / "summary.md").read_text()


def test_an_interrupted_benchmark_resumes_from_the_parts_it_finished(tmp_path, monkeypatch):
    """A benchmark in parts (quality, recovery) that fails in its second part keeps the
    first for --resume, which measures only the second; the JSON holds both, in order, as
    an uninterrupted run would, and the parts are removed once it completes. Without
    --resume a run starts over; a resume with other sizes is refused."""
    measured: list[str] = []
    fail = {"b": True}

    def part(res, key: str, value: float) -> None:
        measured.append(key)
        if fail.get(key):
            raise RuntimeError("killed")
        res.add(f"{key}.ratio", [value, value + 1], "x")
        res.add_target(f"{key}.ratio", target=2.0, op="<=", what=f"{key} ratio")
        res.info.append((f"{key}.ratio", key))
        res.checks.setdefault("rows", []).append(key)
        res.method[key] = f"how {key} is measured"

    def two_parts(sizes, *, device, models, parts):
        res = BenchResult("quality")
        for key, value in (("a", 1.0), ("b", 3.0)):
            parts.run(res, key, lambda key=key, value=value: part(res, key, value))
        return res

    monkeypatch.setitem(bench.BENCHMARKS, "quality", two_parts)

    def run(resume: bool) -> dict:
        with contextlib.suppress(UserError):  # the failed part's run says so in its JSON
            run_benchmarks("quality", quick=True, device="cpu", out=tmp_path, preset="tiny",
                           resume=resume)
        return json.loads((tmp_path / "quality.json").read_text())

    assert run(resume=False)["error"] == "RuntimeError: killed"
    assert measured == ["a", "b"] and (tmp_path / "quality.parts").is_dir()
    fail["b"] = False
    d = run(resume=True)
    assert measured == ["a", "b", "b"]  # a kept, b measured
    assert d["error"] is None and not (tmp_path / "quality.parts").exists()
    assert d["figures"]["a.ratio"]["samples"] == [1.0, 2.0]
    assert d["figures"]["b.ratio"]["samples"] == [3.0, 4.0]
    assert [(t["figure"], t["meets"]) for t in d["targets"]] == [("a.ratio", True),
                                                                  ("b.ratio", False)]
    assert [i["figure"] for i in d["info"]] == ["a.ratio", "b.ratio"]
    assert d["checks"]["rows"] == ["a", "b"]  # a list both parts extend
    assert set(d["method"]) == {"a", "b"} and list(d["checks"]["parts"]) == ["a", "b"]
    assert all(p["date"] and p["seconds"] >= 0 for p in d["checks"]["parts"].values())
    assert run(resume=True)["error"] is None  # nothing left to resume: all measured
    assert measured == ["a", "b", "b", "a", "b"]

    fail["b"] = True
    run(resume=False)
    fail["b"] = False
    run(resume=False)  # starts over
    assert measured[-4:] == ["a", "b", "a", "b"]  # a measured again
    fail["b"] = True
    run(resume=False)
    other = replace(PRESETS["tiny"]["quality"], seeds=(7,))
    monkeypatch.setitem(PRESETS["tiny"], "quality", other)
    with pytest.raises(UserError, match="belongs to another run: sizes"):
        run_benchmarks("quality", quick=True, device="cpu", out=tmp_path, preset="tiny",
                       resume=True)


def test_an_interrupted_bench_command_says_how_to_resume(tmp_path, monkeypatch):
    """Ctrl-C after a part is kept: the command names where and the command that continues
    (exit 130); before any part, nothing is said to be kept."""
    from typer.testing import CliRunner

    from headlab.cli import app

    def interrupted(sizes, *, device, models, parts):
        res = BenchResult("quality")
        parts.run(res, "a", lambda: res.add("a.ratio", [1.0], "x"))
        raise KeyboardInterrupt

    monkeypatch.setitem(bench.BENCHMARKS, "quality", interrupted)
    monkeypatch.setitem(PRESETS["full"], "quality", PRESETS["tiny"]["quality"])
    r = CliRunner().invoke(app, ["bench", "quality", "--out", str(tmp_path)])
    assert r.exit_code == 130
    assert (f"the parts measured are kept in {tmp_path / 'quality.parts'}; continue with "
            f"headlab bench quality --resume --out {tmp_path}") in r.output

    def at_once(sizes, *, device, models, parts):
        raise KeyboardInterrupt

    monkeypatch.setitem(bench.BENCHMARKS, "quality", at_once)
    r = CliRunner().invoke(app, ["bench", "quality", "--out", str(tmp_path / "new")])
    assert r.exit_code == 130 and "kept in" not in r.output

    # another benchmark interrupted in the same OUT: quality's parts are not its to resume
    monkeypatch.setitem(bench.BENCHMARKS, "hooks", lambda *a, **k: at_once(None, device=None,
                                                                            models=None,
                                                                            parts=None))
    r = CliRunner().invoke(app, ["bench", "hooks", "--out", str(tmp_path)])
    assert r.exit_code == 130 and "kept in" not in r.output


def test_a_resumed_quality_benchmark_equals_the_run_it_continues(tmp_path, monkeypatch):
    """Everything a quality part adds comes back from its checkpoint: a resume that
    measures nothing writes what the run that measured it wrote."""
    from headlab.bench import quality
    from headlab.bench._parts import Parts

    sizes = replace(PRESETS["tiny"]["quality"], runs=(("minilm-l6", 16, 64),),
                    keeps=(0.6,), methods=("michel_unnormalised", "taylor"), seeds=(0,))
    identity = {"sizes": repr(sizes)}
    first = quality.bench_quality(sizes, parts=Parts(tmp_path, identity, resume=False))

    def not_again(*args):
        raise AssertionError("a finished part was measured again")

    monkeypatch.setattr(quality._Inputs, "__call__", not_again)  # loads nothing
    again = quality.bench_quality(sizes, parts=Parts(tmp_path, identity, resume=True))
    assert again.to_json() == first.to_json()
    # one part for the timings, then one per method (and seed, where seeded)
    assert list(first.checks["parts"]) == ["minilm-l6:timing", "minilm-l6:michel_unnormalised",
                                           "minilm-l6:taylor:0", "minilm-l6:random:0"]
    # a part keeps its measurements, not its verdicts: a kept part meets the bars of now
    monkeypatch.setattr(quality, "QUALITY_TARGETED", "taylor")
    judged = quality.bench_quality(sizes, parts=Parts(tmp_path, identity, resume=True))
    assert {t.figure for t in judged.targets} - {t.figure for t in first.targets} == {
        "minilm-l6.taylor_over_random"}
    assert "minilm-l6.michel_unnormalised_over_random" in {f for f, _ in judged.info}
    assert judged.checks == first.checks


def test_a_quality_benchmark_resumes_from_the_method_it_stopped_at(tmp_path, monkeypatch):
    """Interrupted in a model's third method, a resumed run measures that method and the
    ones after it, not the model's timings or the methods before, and its grid equals
    an uninterrupted run's."""
    from headlab.bench import quality
    from headlab.bench._parts import Parts

    sizes = replace(PRESETS["tiny"]["quality"], runs=(("minilm-l6", 16, 64),),
                    keeps=(0.6,), methods=("michel_unnormalised", "taylor"), seeds=(0, 1))
    identity = {"sizes": repr(sizes)}
    whole = quality.bench_quality(sizes, parts=Parts(tmp_path / "whole", identity,
                                                     resume=False))
    measured, run = [], quality._run

    def counted(inputs, sizes, r):
        measured.append(r.key)
        if r.key == "taylor:1" and measured.count("taylor:1") == 1:
            raise KeyboardInterrupt
        return run(inputs, sizes, r)

    monkeypatch.setattr(quality, "_run", counted)
    with pytest.raises(KeyboardInterrupt):
        quality.bench_quality(sizes, parts=Parts(tmp_path / "cut", identity, resume=False))
    assert measured == ["michel_unnormalised", "taylor:0", "taylor:1"]
    monkeypatch.setattr(quality, "_timing", lambda *a: pytest.fail("timed again"))
    resumed = quality.bench_quality(sizes, parts=Parts(tmp_path / "cut", identity,
                                                       resume=True))
    assert measured[3:] == ["taylor:1", "random:0", "random:1"]
    grid, again = whole.checks["minilm-l6.grid"], resumed.checks["minilm-l6.grid"]
    assert again["rows"] == grid["rows"] and again["before"] == grid["before"]
    taylor = next(r for r in again["rows"] if (r["method"], r["repair"]) == ("taylor", "none"))
    assert len(taylor["samples"][0]) == 2  # both seeds, the one measured after the resume too


def test_bad_arguments_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="unknown benchmark"):
        run_benchmarks("speed", quick=True, device="cpu", out=tmp_path)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA"):
            run_benchmarks("attention", quick=True, device="cuda", out=tmp_path)


def test_a_benchmark_closes_only_the_model_cache_it_built():
    shared = ModelCache("cpu")
    try:
        with model_cache(shared, "cpu") as cache:
            assert cache is shared
        assert Path(shared._tmp.name).is_dir()  # its owner closes it
    finally:
        shared.close()
    with pytest.raises(RuntimeError, match="inside"), model_cache(None, "cpu") as own:
        assert Path(own._tmp.name).is_dir()
        raise RuntimeError("inside")
    assert not Path(own._tmp.name).exists()  # closed on error too


# ---------------------------------------------------------------------- FLOPs
def test_flops_of_a_tiny_gpt2_by_hand():
    # E=8, H=2 (D=4), one layer, MLP 32, vocab 10; B=2, S=3 -> 6 tokens, 6 causal pairs
    model = GPT2(GPT2Config(vocab_size=10, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                            n_inner=32))
    f = count_flops(model, 2, 3)
    assert f["projections"] == 4 * (2 * 8 * 8) * 6  # W_Q, W_K, W_V, W_O
    assert f["attention"] == 2 * (2 * 2 * 2 * 4 * 6)  # QK^T and AV: 2 flops x B x H x D x pairs
    assert f["mlp"] == 2 * (2 * 8 * 32) * 6
    assert f["lm_head"] == 2 * 8 * 10 * 6
    assert f["other"] == 0
    assert f["total"] == 3072 + 384 + 6144 + 960

    model.prune_heads({0: [1]})  # one head of 4 dims left: every projection halves
    g = count_flops(model, 2, 3)
    assert g["projections"] == 4 * (2 * 8 * 4) * 6
    assert g["attention"] == 2 * (2 * 2 * 1 * 4 * 6)
    assert (g["mlp"], g["lm_head"]) == (f["mlp"], f["lm_head"])


def test_flops_of_a_tiny_llama_with_gqa_by_hand():
    # E=8, H=4, H_kv=2, D=2, SwiGLU 16, vocab 10; B=1, S=4 -> 4 tokens, 10 causal pairs
    model = Llama(LlamaConfig.from_hf(dict(vocab_size=10, hidden_size=8, intermediate_size=16,
                                           num_hidden_layers=1, num_attention_heads=4,
                                           num_key_value_heads=2, max_position_embeddings=16)))
    f = count_flops(model, 1, 4)
    assert f["projections"] == (2 * 8 * 8 + 2 * 8 * 4 + 2 * 8 * 4 + 2 * 8 * 8) * 4
    assert f["attention"] == 2 * (2 * 1 * 4 * 2 * 10)
    assert f["mlp"] == 3 * (2 * 8 * 16) * 4
    assert f["lm_head"] == 2 * 8 * 10 * 4
    assert f["total"] == 1536 + 320 + 3072 + 640


@pytest.mark.parametrize("seq", [16, 96])
def test_flops_equal_torch_flop_counter_on_a_pruned_gqa_llama(seq):
    """torch.utils.flop_counter over one forward: its matmuls (aten.mm) are the model's
    projections, MLP and LM head; its SDPA count charges every query-key pair of the
    S x S square (torch's sdpa_flop_count, here applied to the CPU kernel too), of
    which a causal model computes S(S+1)/2."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    aten = torch.ops.aten

    def cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        B, H, _, D = query_shape  # GQA keys (B, H_kv, T, D): count them per query head
        return sdpa_flop_count(query_shape, (B, H, key_shape[2], D),
                               (B, H, value_shape[2], value_shape[3]))

    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_hf(dict(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))).eval()
    model.prune_heads({0: [1], 1: [0, 2]})  # 3 and 2 query heads left, uneven layers
    B = 2
    counter = FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa})
    with torch.no_grad(), counter:
        model(torch.randint(0, 50, (B, seq)))
    counted = counter.get_flop_counts()["Global"]
    ours = count_flops(model, B, seq)
    assert set(counted) == {aten.mm, aten._scaled_dot_product_flash_attention_for_cpu}
    assert counted[aten.mm] == ours["projections"] + ours["mlp"] + ours["lm_head"]
    pairs = seq * (seq + 1) // 2
    sdpa = counted[aten._scaled_dot_product_flash_attention_for_cpu]
    assert sdpa * pairs == ours["attention"] * seq * seq
    assert ours["total"] == counted[aten.mm] + ours["attention"]


# ---------------------------------------------------------------------- memory
def test_peak_bytes_sees_a_temporary_allocation():
    def make():
        big = torch.ones(2**20)  # 4 MiB, freed before returning
        return float(big.sum())

    assert peak_bytes(make, "cpu") >= 4 * 2**20


@pytest.mark.parametrize("value, target, shown", [
    (1.0047, 1.0, "1.005"), (0.3015, 0.25, "0.301"), (1.0, 1.0, "1"), (2.0004, 2.0, "2.0004"),
    (0.9996, 1.0, "0.9996")])
def test_a_figure_beside_its_target_never_reads_as_the_target_when_it_is_not(value, target,
                                                                             shown):
    from headlab.bench._common import against

    assert against(value, target) == shown
