"""Tests for headlab.selection, headlab.pruning and headlab.schedule: plans, physical
pruning, trial masks, iterative and one-shot schedules.

Known answers come from hand-built HeadScores (a permutation of 0..11, so every rank is
written down). Equivalences: a physically pruned model == the same model with those
heads' gates at 0, before and after save -> load; a one-shot schedule's plans are
nested. References: each point of the curve recomputed with `evaluate` on a fresh
model masked as the schedule masked it.

Shape notation: L layers, H heads per layer, E model dim, D head dim, V vocabulary.
"""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch
from torch.testing import assert_close

import headlab
from headlab._util.checkpoint import Checkpoint
from headlab.data.blocks import split_blocks
from headlab.data.texts import load_texts
from headlab.errors import UserError
from headlab.evaluate.quality import evaluate
from headlab.importance import HeadScores, score
from headlab.objectives import make_blocks
from headlab.pruning import prune, trial
from headlab.schedule import CurvePoint, prune_to_target, versus_random
from headlab.selection import PrunePlan, heads_to_keep, select

# float32 logits of a 3-layer model computed along two paths: rounding only
SAME = {"rtol": 1e-5, "atol": 1e-5}
# 3 layers x 4 heads; rank 0 = least important. Layer 2 holds the weakest heads.
TABLE = [[11.0, 4.0, 9.0, 6.0],
         [10.0, 8.0, 5.0, 7.0],
         [3.0, 0.0, 2.0, 1.0]]


@pytest.fixture()
def table() -> HeadScores:
    return HeadScores([row[:] for row in TABLE], "hand")


@pytest.fixture()
def ids(tiny_gpt2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    return torch.randint(0, tiny_gpt2.config.vocab_size, (2, 16), generator=gen)


@pytest.fixture()
def data(tiny_gpt2):
    blocks = make_blocks(load_texts(), tiny_gpt2.tokenizer, kind="causal-lm", seq_len=16,
                         max_tokens=16 * 8)
    return split_blocks(blocks, heldout=0.5, seed=0)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# ---------------------------------------------------------------------- select
def test_keep_half_takes_the_global_top_half(table):
    plan = select(table, heads_to_keep(12, keep=0.5))
    assert plan.kept == {0: [0, 2, 3], 1: [0, 1, 3], 2: []}
    assert plan.pruned == {0: [1], 1: [2], 2: [0, 1, 2, 3]}
    assert plan.n_kept == 6 and plan.n_pruned == 6
    assert select(table, heads_to_keep(12, prune=6)) == plan


@pytest.mark.parametrize(("keep", "n"), [(1 / 12, 1), (0.25, 3), (0.3, 4), (0.75, 9)])
def test_global_rank_keeps_the_highest_scores(table, keep, n):
    plan = select(table, heads_to_keep(12, keep=keep))
    kept = sorted(TABLE[layer][h] for layer, hs in plan.kept.items() for h in hs)
    assert kept == [float(v) for v in range(12 - n, 12)]


def test_per_layer_keeps_equal_counts(table):
    plan = select(table, heads_to_keep(12, keep=0.5), per_layer=True)
    assert plan.kept == {0: [0, 2], 1: [0, 1], 2: [0, 2]}
    # 7 heads: the remainder goes to the layer whose best head is best (layer 0)
    plan = select(table, heads_to_keep(12, keep=7 / 12), per_layer=True)
    assert plan.kept == {0: [0, 2, 3], 1: [0, 1], 2: [0, 2]}


def test_min_heads_per_layer_protects_each_layers_best(table):
    plan = select(table, heads_to_keep(12, keep=0.25), min_heads_per_layer=1)
    assert plan.kept == {0: [0], 1: [0], 2: [0]}
    plan = select(table, heads_to_keep(12, keep=5 / 12), min_heads_per_layer=1)
    assert plan.kept == {0: [0, 2], 1: [0, 1], 2: [0]}
    with pytest.raises(ValueError, match="min_heads_per_layer=2 x 3 layers exceeds the 3"):
        select(table, heads_to_keep(12, keep=0.25), min_heads_per_layer=2)


@pytest.mark.parametrize("keep", [0.0, -0.1, 1.01, 2.0, math.nan])
def test_keep_outside_the_range_raises(keep):
    with pytest.raises(UserError, match=r"keep must be in \(0, 1\]"):
        heads_to_keep(12, keep=keep)


@pytest.mark.parametrize("n", [12, 13, -1])
def test_prune_outside_the_range_raises(n):
    with pytest.raises(UserError, match="prune must be between 0 and 11 heads .*has 12"):
        heads_to_keep(12, prune=n)


def test_exactly_one_of_keep_and_prune():
    with pytest.raises(UserError, match="exactly one of keep"):
        heads_to_keep(12)
    with pytest.raises(UserError, match="exactly one of keep"):
        heads_to_keep(12, keep=0.5, prune=3)


def test_absent_heads_count_as_pruned(table):
    table.scores[0][0] = math.nan  # the best head is already gone
    table.scores[1][2] = math.nan
    plan = select(table, heads_to_keep(12, keep=0.5))
    assert plan.kept == {0: [1, 2, 3], 1: [0, 1, 3], 2: []}
    assert plan.pruned == {0: [0], 1: [2], 2: [0, 1, 2, 3]}
    assert plan.n_kept + plan.n_pruned == 12
    with pytest.raises(ValueError, match="cannot keep 11 heads: only 10 remain"):
        select(table, heads_to_keep(12, keep=11 / 12))


def test_plan_json_round_trip(table):
    plan = select(table, heads_to_keep(12, keep=0.5))
    assert PrunePlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(("total", "kw", "n"), [
    (12, {"keep": 0.5}, 6), (12, {"keep": 1.0}, 12), (12, {"keep": 0.3}, 4),
    (100, {"keep": 0.07}, 7),  # 0.07 * 100 = 7.000000000000001: still 7, not 8
    (12, {"prune": 0}, 12), (12, {"prune": 11}, 1)])
def test_heads_to_keep_counts(total, kw, n):
    assert heads_to_keep(total, **kw) == n


def test_heads_to_keep_errors_are_user_errors():
    """Each bad target is a UserError (one line at the CLI), still a ValueError."""
    with pytest.raises(UserError, match="keep=1e-09 leaves no head of 12: keep at least one"):
        heads_to_keep(12, keep=1e-9)
    for kw in ({}, {"keep": 0.0}, {"prune": 12}, {"keep": 0.5, "prune": 1}):
        with pytest.raises(UserError) as err:
            heads_to_keep(12, **kw)
        assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("n", [0, -1])
def test_select_needs_at_least_one_head(table, n):
    with pytest.raises(UserError, match=f"n_keep must be at least 1 head, got {n}"):
        select(table, n)


# ---------------------------------------------------------------------- prune
def test_keep_all_prunes_nothing(tiny_gpt2, table, ids):
    before = _logits(tiny_gpt2, ids)
    n_params = tiny_gpt2.num_parameters()
    plan = select(table, heads_to_keep(12, keep=1.0))
    assert plan.n_pruned == 0 and plan.n_kept == 12
    prune(tiny_gpt2, plan)
    assert tiny_gpt2.num_parameters() == n_params
    assert_close(_logits(tiny_gpt2, ids), before, rtol=0, atol=0)


def test_physical_pruning_equals_gating(tiny_gpt2, tiny_gpt2_dir, table, ids):
    plan = select(table, heads_to_keep(12, keep=0.5), per_layer=True)
    gated = headlab.load(tiny_gpt2_dir)
    gated.mask_heads(plan.pruned)
    n_params = tiny_gpt2.num_parameters()
    pruned = prune(tiny_gpt2, plan)
    assert pruned is tiny_gpt2
    assert pruned.heads_per_layer == [2, 2, 2]
    assert pruned.head_ids() == [plan.kept[layer] for layer in range(3)]
    E, D = 32, 8  # each head: D rows of W_Q, W_K, W_V (with biases), D columns of W_O
    assert n_params - pruned.num_parameters() == 6 * (4 * E * D + 3 * D)
    assert_close(_logits(pruned, ids), _logits(gated, ids), **SAME)
    assert (_logits(gated, ids) - _logits(headlab.load(tiny_gpt2_dir), ids)).abs().max() > 1e-4


def test_prune_a_copy_leaves_the_model(tiny_gpt2, table, ids):
    before = _logits(tiny_gpt2, ids)
    copy = prune(tiny_gpt2, select(table, heads_to_keep(12, keep=0.5)), inplace=False)
    assert copy is not tiny_gpt2 and copy.tokenizer is tiny_gpt2.tokenizer
    assert tiny_gpt2.heads_per_layer == [4, 4, 4]
    assert copy.heads_per_layer == [3, 3, 0]
    assert_close(_logits(tiny_gpt2, ids), before, rtol=0, atol=0)


def test_pruning_every_head_of_a_layer(tiny_gpt2, tiny_gpt2_dir, ids):
    plan = PrunePlan({0: [], 1: [0, 1, 2, 3], 2: [0, 1, 2, 3]},
                     {0: [0, 1, 2, 3], 1: [], 2: []})
    gated = headlab.load(tiny_gpt2_dir)
    gated.mask_heads(plan.pruned)
    with warnings.catch_warnings():  # torch's "initializing zero-element tensors" included
        warnings.simplefilter("error")
        prune(tiny_gpt2, plan)
    assert tiny_gpt2.heads_per_layer == [0, 4, 4]
    assert_close(_logits(tiny_gpt2, ids), _logits(gated, ids), **SAME)


def test_pruned_model_saves_and_loads_as_the_gated_model(tiny_gpt2, tiny_gpt2_dir, table,
                                                          ids, tmp_path):
    plan = select(table, heads_to_keep(12, keep=5 / 12))  # uneven: [2, 3, 0] heads
    gated = headlab.load(tiny_gpt2_dir)
    gated.mask_heads(plan.pruned)
    prune(tiny_gpt2, plan)
    saved = tiny_gpt2.save(tmp_path / "pruned")
    with warnings.catch_warnings():  # a layer of no heads is built quietly
        warnings.simplefilter("error")
        reloaded = headlab.load(saved)
    assert reloaded.heads_per_layer == [2, 3, 0]
    assert reloaded.head_ids() == tiny_gpt2.head_ids()
    assert reloaded.n_original_heads == 4
    assert reloaded.tokenizer is not None
    assert_close(_logits(reloaded, ids), _logits(tiny_gpt2, ids), rtol=0, atol=0)
    assert_close(_logits(reloaded, ids), _logits(gated, ids), **SAME)


def test_plan_from_a_masked_model_removes_the_masked_heads(tiny_gpt2, tiny_gpt2_dir, data,
                                                           ids):
    """Heads masked before scoring score NaN; the plan must still remove them."""
    scoring, _ = data
    tiny_gpt2.mask_heads({0: [1], 2: [3]})
    plan = select(score(tiny_gpt2, scoring, method="michel"), heads_to_keep(12, keep=0.5))
    assert 1 in plan.pruned[0] and 3 in plan.pruned[2]
    gated = headlab.load(tiny_gpt2_dir)
    gated.mask_heads(plan.pruned)
    prune(tiny_gpt2, plan)
    assert sum(tiny_gpt2.heads_per_layer) == 6
    assert_close(_logits(tiny_gpt2, ids), _logits(gated, ids), **SAME)


# ---------------------------------------------------------------------- trial masks
def _gates(model) -> list[torch.Tensor]:
    return [g.clone() for g in model.gates()]


def _odd_gates(model) -> list[torch.Tensor]:
    """Gates no schedule would set (a head masked, one halved), so restoring is visible."""
    model.attentions[0].set_gates(torch.tensor([1.0, 0.5, 0.0, 1.0]))
    return _gates(model)


def test_trial_masks_the_plan_and_restores_the_gates(tiny_gpt2, table, ids):
    before, logits = _odd_gates(tiny_gpt2), _logits(tiny_gpt2, ids)
    plan = select(table, heads_to_keep(12, keep=0.5))  # prunes 0.1, 1.2 and all of layer 2
    with trial(tiny_gpt2, plan):
        assert tiny_gpt2.gates()[0].tolist() == [1.0, 0.0, 0.0, 1.0]
        assert tiny_gpt2.gates()[1].tolist() == [1.0, 1.0, 0.0, 1.0]
        assert tiny_gpt2.gates()[2].tolist() == [0.0] * 4
    for g, b in zip(tiny_gpt2.gates(), before, strict=True):
        assert torch.equal(g, b)
    assert_close(_logits(tiny_gpt2, ids), logits, rtol=0, atol=0)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_trial_restores_the_gates_after_an_exception(tiny_gpt2, table, error):
    before = _odd_gates(tiny_gpt2)
    with pytest.raises(error), trial(tiny_gpt2, select(table, 3)):
        raise error("stop")
    with pytest.raises(error), trial(tiny_gpt2):  # no plan: whatever the block masks
        tiny_gpt2.mask_heads({1: [0, 1, 2, 3]})
        raise error("stop")
    for g, b in zip(tiny_gpt2.gates(), before, strict=True):
        assert torch.equal(g, b)


# ---------------------------------------------------------------------- schedules
def _masked_copy(model_dir, pruned: dict[int, list[int]]):
    model = headlab.load(model_dir)
    model.mask_heads(pruned)
    return model


def _pruned_set(plan: PrunePlan) -> set[tuple[int, int]]:
    return {(layer, h) for layer, hs in plan.pruned.items() for h in hs}


def test_iterative_schedule(tiny_gpt2, tiny_gpt2_dir, data):
    scoring, heldout = data
    seen = []
    res = prune_to_target(tiny_gpt2, scoring, heldout, method="michel",
                          n_keep=heads_to_keep(12, keep=0.5), step=0.25, schedule="iterative",
                          batch_size=4, on_step=seen.append)
    assert [p.fraction_pruned for p in res.curve] == [0.0, 0.25, 0.5]
    assert [p.heads_kept for p in res.curve] == [12, 9, 6]
    assert seen == res.curve
    assert res.plan.n_kept == 6 and res.plan.n_pruned == 6
    assert all(torch.equal(g, torch.ones(4)) for g in tiny_gpt2.gates())  # masks were trials
    assert len(res.step_scores) == 2 and res.scores is res.step_scores[0]

    # step 1 prunes the 3 lowest of the first scores; step 2 re-scores with that mask
    first = select(res.step_scores[0], heads_to_keep(12, prune=3))
    assert_close(res.step_scores[1].tensor(),
                 score(_masked_copy(tiny_gpt2_dir, first.pruned), scoring, method="michel",
                       seed=1).tensor(),
                 rtol=1e-6, atol=0, equal_nan=True)
    second = select(res.step_scores[1], heads_to_keep(12, prune=6))
    assert _pruned_set(first) <= _pruned_set(second) == _pruned_set(res.plan)

    # each point of the curve is evaluate() at that step's mask
    for point, pruned in zip(res.curve, ({}, first.pruned, second.pruned), strict=True):
        q = evaluate(_masked_copy(tiny_gpt2_dir, pruned), heldout, batch_size=4)
        assert_close(point.quality, q.value, rtol=1e-9, atol=0)
        assert_close(point.loss, q.loss, rtol=1e-9, atol=0)


def test_one_shot_schedule_gives_nested_plans(tiny_gpt2, tiny_gpt2_dir, data):
    scoring, heldout = data
    res = prune_to_target(tiny_gpt2, scoring, heldout, method="michel",
                          n_keep=heads_to_keep(12, keep=0.5), step=0.25, schedule="one-shot",
                          batch_size=4)
    assert [p.fraction_pruned for p in res.curve] == [0.0, 0.25, 0.5]
    assert [p.heads_kept for p in res.curve] == [12, 9, 6]
    assert len(res.step_scores) == 1  # scored once
    at_25 = select(res.scores, heads_to_keep(12, prune=3))
    at_50 = select(res.scores, heads_to_keep(12, prune=6))
    assert _pruned_set(at_25) < _pruned_set(at_50) == _pruned_set(res.plan)
    for point, pruned in zip(res.curve, ({}, at_25.pruned, at_50.pruned), strict=True):
        q = evaluate(_masked_copy(tiny_gpt2_dir, pruned), heldout, batch_size=4)
        assert_close(point.quality, q.value, rtol=1e-9, atol=0)
    # pruning by the plan keeps the last point's quality
    prune(tiny_gpt2, res.plan)
    assert_close(evaluate(tiny_gpt2, heldout, batch_size=4).value, res.curve[-1].quality,
                 rtol=1e-5, atol=0)


@pytest.mark.parametrize(("method", "scorings"), [("michel", 2), ("flap", 1), ("gates", 1)])
def test_a_schedule_left_unsaid_is_the_methods(tiny_gpt2, data, method, scorings):
    """Without ``schedule``, the scores of one head at a time re-score after each step
    (Michel et al.'s protocol) and the methods that choose jointly score once: the gates
    would otherwise be trained again at every step."""
    from headlab.schedule import default_schedule

    scoring, heldout = data
    kw = {"gate_steps": 2} if method == "gates" else {}
    res = prune_to_target(tiny_gpt2, scoring, heldout, method=method, step=0.25,
                          n_keep=heads_to_keep(12, keep=0.5), batch_size=4, score_kwargs=kw)
    assert len(res.step_scores) == scorings
    assert default_schedule(method) == ("iterative" if scorings > 1 else "one-shot")
    assert [p.heads_kept for p in res.curve] == [12, 9, 6]


@pytest.mark.parametrize("schedule", ["iterative", "one-shot"])
def test_plan_at_is_the_shorter_runs_plan(tiny_gpt2, data, schedule):
    """One run to 4 heads holds the plan a run stopped at 10, 9, 7 or 5 would choose
    (steps of 3: a stop between two steps and one on a step), and 12 keeps every head."""
    scoring, heldout = data
    long = prune_to_target(tiny_gpt2, scoring, heldout, method="michel", n_keep=4, step=0.25,
                           schedule=schedule, batch_size=4)
    assert _pruned_set(long.plan_at(4)) == _pruned_set(long.plan)
    for n in (10, 9, 7, 5):
        short = prune_to_target(tiny_gpt2, scoring, heldout, method="michel", n_keep=n, step=0.25,
                                schedule=schedule, batch_size=4)
        at = long.plan_at(n)
        assert at.n_kept == n and _pruned_set(at) == _pruned_set(short.plan), n
    assert long.plan_at(12).n_pruned == 0
    with pytest.raises(UserError, match="went down to 4 heads; it holds no plan for fewer"):
        long.plan_at(3)


def test_given_scores_choose_without_scoring(tiny_gpt2, data, table, monkeypatch):
    """Scores computed elsewhere (a detector's, DuoAttention's gates) choose the heads one
    shot, as `select` of them does, and nothing is scored; they are never re-scored, so
    one shot is their schedule unless told, and an iterative one is refused."""
    import headlab.schedule

    scoring, heldout = data
    monkeypatch.setattr(headlab.schedule, "score", lambda *a, **k: pytest.fail("scored"))
    res = prune_to_target(tiny_gpt2, scoring, heldout, n_keep=5, step=0.25,
                          schedule="one-shot", scores=table, method="sink", batch_size=4)
    assert _pruned_set(res.plan) == _pruned_set(select(table, 5))
    assert res.scores is table and len(res.curve) == 4  # 12, 9, 6, 5 heads measured
    unsaid = prune_to_target(tiny_gpt2, scoring, heldout, n_keep=5, step=0.25, scores=table,
                             method="sink", batch_size=4)
    assert unsaid.plan == res.plan and unsaid.curve == res.curve
    with pytest.raises(UserError, match="not re-scored: use schedule='one-shot'"):
        prune_to_target(tiny_gpt2, scoring, heldout, method="michel", n_keep=5, scores=table,
                        schedule="iterative")


def test_schedule_arguments_are_checked(tiny_gpt2, data):
    scoring, heldout = data
    with pytest.raises(UserError, match="schedule must be 'iterative' or 'one-shot'"):
        prune_to_target(tiny_gpt2, scoring, heldout, method="michel", n_keep=6, schedule="greedy")
    with pytest.raises(UserError, match=r"step must be in \(0, 1\]"):
        prune_to_target(tiny_gpt2, scoring, heldout, method="michel", n_keep=6, step=0)
    for n in (0, 13):
        with pytest.raises(UserError, match=f"n_keep must be between 1 and 12 heads .*got {n}"):
            prune_to_target(tiny_gpt2, scoring, heldout, method="michel", n_keep=n)


@pytest.mark.parametrize("schedule", ["iterative", "one-shot"])
def test_prune_to_target_leaves_the_gates_as_they_were(tiny_gpt2, data, schedule):
    """A head masked on entry is in the plan's pruned heads and masked again after; a
    halved gate is halved again; an exception mid-schedule restores them too."""
    scoring, heldout = data
    before = _odd_gates(tiny_gpt2)
    res = prune_to_target(tiny_gpt2, scoring, heldout, method="michel", n_keep=6, step=0.25,
                          schedule=schedule, batch_size=4)
    for g, b in zip(tiny_gpt2.gates(), before, strict=True):
        assert torch.equal(g, b)
    assert 2 in res.plan.pruned[0] and res.plan.n_kept == 6
    assert [p.heads_kept for p in res.curve] == [12, 9, 6]

    def stop(point: CurvePoint) -> None:
        if point.heads_kept == 9:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        prune_to_target(tiny_gpt2, scoring, heldout, method="michel", n_keep=6, step=0.25,
                        schedule=schedule, batch_size=4, on_step=stop)
    for g, b in zip(tiny_gpt2.gates(), before, strict=True):
        assert torch.equal(g, b)


def test_interrupted_schedule_resumes_to_the_same_result(tiny_gpt2_dir, data, tmp_path):
    """Stopped after its first step, a schedule resumed from the checkpoint on a fresh
    model ends with the plan, curve and scores of an uninterrupted one."""
    scoring, heldout = data
    kw = {"method": "michel", "n_keep": 6, "step": 0.25, "batch_size": 4}
    full = prune_to_target(_masked_copy(tiny_gpt2_dir, {}), scoring, heldout, **kw)

    def stop(point: CurvePoint) -> None:
        if point.heads_kept == 6:  # step 1 is saved, step 2 is not
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        prune_to_target(_masked_copy(tiny_gpt2_dir, {}), scoring, heldout, on_step=stop,
                        checkpoint=Checkpoint(tmp_path), **kw)
    saved = Checkpoint(tmp_path).get("prune/michel")
    assert saved["n_now"] == 9 and len(saved["curve"]) == 2
    assert set(saved["curve"][0]) == {"fraction_pruned", "quality", "loss", "heads_kept"}
    seen = []
    resumed = prune_to_target(_masked_copy(tiny_gpt2_dir, {}), scoring, heldout,
                              on_step=seen.append, checkpoint=Checkpoint(tmp_path), **kw)
    assert resumed.plan == full.plan
    assert resumed.curve == full.curve and seen == full.curve[2:]
    assert len(resumed.step_scores) == len(full.step_scores) == 2
    for a, b in zip(resumed.step_scores, full.step_scores, strict=True):
        assert_close(a.tensor(), b.tensor(), rtol=0, atol=0, equal_nan=True)


def test_curve_point_json_is_the_results_json_dict():
    point = CurvePoint(0.25, 31.5, 3.45, 9)
    assert point.to_json() == {"fraction_pruned": 0.25, "quality": 31.5, "loss": 3.45,
                               "heads_kept": 9}
    assert CurvePoint.from_json(point.to_json()) == point
    nulls = CurvePoint.from_json({"fraction_pruned": 0.5, "quality": None, "loss": None,
                                  "heads_kept": 6})  # non-finite figures, as written
    assert math.isnan(nulls.quality) and math.isnan(nulls.loss)


def test_versus_random_reports_each_run_and_restores_the_model(tiny_gpt2, tiny_gpt2_dir, data):
    scoring, heldout = data
    before = evaluate(tiny_gpt2, heldout, batch_size=4)
    result = versus_random(tiny_gpt2, scoring, heldout, method=("michel", "taylor"), keep=0.5,
                           seeds=(0, 1), step=0.5, batch_size=4)
    assert all(torch.equal(g, torch.ones(4)) for g in tiny_gpt2.gates())  # gates back to 1
    assert evaluate(tiny_gpt2, heldout, batch_size=4).value == before.value

    # each entry is the perplexity increase of that run, recomputed from its own plan
    for name, seed in (("michel", 0), ("taylor", 0), ("random", 0), ("random", 1)):
        res = prune_to_target(_masked_copy(tiny_gpt2_dir, {}), scoring, heldout, method=name,
                              n_keep=heads_to_keep(12, keep=0.5), seed=seed, step=0.5,
                              batch_size=4)
        key = f"random:{seed}" if name == "random" else name
        assert_close(result["lost"][key], res.curve[-1].quality - before.value,
                     rtol=1e-9, atol=0)
    mean = (result["lost"]["random:0"] + result["lost"]["random:1"]) / 2
    assert result["random_mean"] == pytest.approx(mean)
    assert set(result["ratios"]) == {"michel", "taylor"}
    assert result["ratio"] is result["ratios"]["michel"]  # the first method's
    for name in ("michel", "taylor"):
        if mean > 0:
            assert result["ratios"][name] == pytest.approx(result["lost"][name] / mean)
        else:  # random weights: random pruning may even help, and no ratio is defined
            assert math.isnan(result["ratios"][name])
    assert result["metric"] == "perplexity" and result["before"] == before.value


def test_versus_random_takes_named_variants_and_keeps_options_from_random(tiny_gpt2_dir,
                                                                        data):
    """Variants of one method race the same random runs; options shared by every
    variant (per-token gates) never reach random, which takes none."""
    def loud_first_layer():  # its heads outscore the rest unless layers are normalised
        model = _masked_copy(tiny_gpt2_dir, {})
        with torch.no_grad():
            model.attentions[0].o_proj.weight.mul_(30)
        return model

    scoring, heldout = data
    model = loud_first_layer()
    before = evaluate(model, heldout, batch_size=4)
    variants = {"paper": ("michel", {}), "raw": ("michel", {"normalize": False})}
    result = versus_random(model, scoring, heldout, method=variants, keep=0.5, seeds=(0,),
                           step=0.5, batch_size=4, score_kwargs={"per_token": True})
    assert set(result["lost"]) == {"paper", "raw", "random:0"}
    assert set(result["ratios"]) == {"paper", "raw"}
    assert result["ratio"] is result["ratios"]["paper"]
    assert result["lost"]["paper"] != result["lost"]["raw"]  # the options were applied
    for label, kw in (("paper", {}), ("raw", {"normalize": False})):
        res = prune_to_target(loud_first_layer(), scoring, heldout, method="michel",
                              n_keep=heads_to_keep(12, keep=0.5), step=0.5, batch_size=4,
                              score_kwargs={"per_token": True, **kw})
        assert_close(result["lost"][label], res.curve[-1].quality - before.value,
                     rtol=1e-9, atol=0)


# ---------------------------------------------------------------------- measured speed
def test_compare_latency_times_both_models_in_the_same_rounds(tiny_gpt2, tiny_gpt2_dir):
    """A model made 20 ms slower per forward is measured 20 ms slower, and each model is
    called once per round after one warm-up (alternating, so a slow spell hits both)."""
    from headlab.evaluate.latency import compare_latency

    slow = headlab.load(tiny_gpt2_dir)
    calls = []

    def slowly(*_) -> None:
        calls.append("slow")
        time.sleep(0.02)

    slow.register_forward_pre_hook(slowly)
    tiny_gpt2.register_forward_pre_hook(lambda *_: calls.append("fast"))
    before, after = compare_latency(slow, tiny_gpt2, batch=2, seq_len=16, rounds=4)
    assert before - after > 18
    assert calls == ["slow", "fast"] + ["slow", "fast", "fast", "slow"] * 2
