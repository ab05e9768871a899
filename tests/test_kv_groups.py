"""Pruning by whole GQA groups (`--unit kv-group`, `--kv-keep`).

Known answers from a hand-built score table (every group sum and max written down);
equivalences: a model pruned by whole groups == the same model with those groups' gates
at 0, and its key/value cache shrinks by exactly the groups removed; references: the
per-layer pruned model exported to Hugging Face format loads in plain transformers
with the same logits and fewer key/value heads.

Shape notation: L layers, H query heads, H_kv key/value heads, V vocabulary.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import transformers
from torch.testing import assert_close

import headlab
from headlab.data.blocks import split_blocks
from headlab.data.texts import load_texts
from headlab.errors import UserError
from headlab.importance import HeadScores
from headlab.models.export import export_hf, hf_expressible
from headlab.objectives import make_blocks
from headlab.pruning import prune
from headlab.runs.config import RunConfig
from headlab.schedule import prune_to_target
from headlab.selection import kv_groups, select_groups

# float32 logits of a 2-layer model along two paths: rounding only
SAME = {"rtol": 1e-5, "atol": 1e-5}
# 2 layers x 6 query heads in 3 groups of 2: group sums [5, 13, 3] and [20, 1, 9],
# group maxima [4, 7, 2] and [11, 1, 5]
TABLE = [[1.0, 4.0, 6.0, 7.0, 2.0, 1.0],
         [9.0, 11.0, 0.5, 0.5, 5.0, 4.0]]
GROUPS = [[[0, 1], [2, 3], [4, 5]]] * 2


@pytest.fixture()
def ids() -> torch.Tensor:
    return torch.randint(0, 500, (2, 19), generator=torch.Generator().manual_seed(1))


def test_kv_groups_lists_each_key_value_heads_query_heads(gqa_dir, tiny_gpt2):
    model = headlab.load(gqa_dir)
    assert kv_groups(model) == GROUPS
    model.prune_heads({0: [2, 3], 1: [5]})
    assert kv_groups(model) == [[[0, 1], [4, 5]], [[0, 1], [2, 3], [4]]]
    # without GQA a group is one head
    assert kv_groups(tiny_gpt2) == [[[h] for h in range(4)]] * 3


@pytest.mark.parametrize(("group_score", "n", "kept"), [
    # sums: 20, 13, 9, 5, 3, 1 -> the best 3 are layer 1 group 0, layer 0 group 1, layer 1 group 2
    ("sum", 3, {0: [2, 3], 1: [0, 1, 4, 5]}),
    # maxima: 11, 7, 5, 4, 2, 1 -> layer 1 group 0, layer 0 group 1, layer 1 group 2
    ("max", 3, {0: [2, 3], 1: [0, 1, 4, 5]}),
    # the 4th best differs: sum 5 (layer 0 group 0) vs max 4 (layer 0 group 0): same;
    # the 5th: sum 3 (layer 0 group 2) vs max 2 (layer 0 group 2)
    ("sum", 5, {0: [0, 1, 2, 3, 4, 5], 1: [0, 1, 4, 5]}),
])
def test_select_groups_keeps_the_best_groups_whole(group_score, n, kept):
    plan = select_groups(HeadScores(TABLE, "hand"), GROUPS, n, group_score=group_score)
    assert plan.kept == kept
    assert plan.pruned == {layer: [h for h in range(6) if h not in kept[layer]]
                           for layer in kept}


def test_sum_and_max_rank_differently():
    # group (1.0, 9.0) sums to 10 but peaks at 9; group (6.0, 6.0) sums 12, peaks at 6
    table = HeadScores([[1.0, 9.0, 6.0, 6.0]], "hand")
    groups = [[[0, 1], [2, 3]]]
    assert select_groups(table, groups, 1, group_score="sum").kept == {0: [2, 3]}
    assert select_groups(table, groups, 1, group_score="max").kept == {0: [0, 1]}
    with pytest.raises(UserError, match="group score"):
        select_groups(table, groups, 1, group_score="mean")


def test_per_layer_groups_and_masked_heads():
    plan = select_groups(HeadScores(TABLE, "hand"), GROUPS, 2, per_layer=True)
    # one group per layer: the best of each layer
    assert plan.kept == {0: [2, 3], 1: [0, 1]}
    # a head already masked (NaN) leaves its group scored by the rest, and stays pruned
    table = [row[:] for row in TABLE]
    table[1][0] = math.nan  # layer 1 group 0 now sums to 11
    plan = select_groups(HeadScores(table, "hand"), GROUPS, 2)
    assert plan.kept == {0: [2, 3], 1: [1]}
    assert 0 in plan.pruned[1]


def test_kv_group_pruning_equals_gating_the_group(gqa_dir, ids):
    model = headlab.load(gqa_dir)
    plan = select_groups(HeadScores(TABLE, "hand"), kv_groups(model), 3)
    gated = headlab.load(gqa_dir)
    gated.mask_heads(plan.pruned)
    bytes_before = model.kv_cache_bytes_per_token()
    prune(model, plan)
    with torch.no_grad():
        assert_close(model(ids).logits, gated(ids).logits, **SAME)
    assert model.kv_heads_per_layer == [1, 2]
    # every removal takes a key/value head: 3 of 6 go, the cache halves exactly
    per_kv_head = 2 * 8 * 4  # K and V, D = 8, float32
    assert model.kv_cache_bytes_per_token() == bytes_before - 3 * per_kv_head
    assert bytes_before == 6 * per_kv_head


def test_schedule_by_groups_removes_whole_groups(gqa_dir, bpe_tokenizer):
    model = headlab.load(gqa_dir)
    blocks = make_blocks(load_texts(), bpe_tokenizer, kind="causal-lm", seq_len=16,
                         max_tokens=16 * 6)
    scoring, heldout = split_blocks(blocks, heldout=0.5, seed=0)
    res = prune_to_target(model, scoring, heldout, method="michel", n_keep=2, step=0.34,
                          unit="kv-group")
    groups = {(layer, tuple(g)) for layer, lg in enumerate(GROUPS) for g in lg}
    kept = {(layer, tuple(heads[i:i + 2])) for layer, heads in res.plan.kept.items()
            for i in range(0, len(heads), 2)}
    assert kept <= groups and res.plan.n_kept == 4
    # the curve counts groups: 6 -> 4 -> 2 of 6 (2 per step), with the query heads left
    assert [p.heads_kept for p in res.curve] == [12, 8, 4]
    assert [p.fraction_pruned for p in res.curve] == pytest.approx([0, 1 / 3, 2 / 3],
                                                                   abs=1e-6)
    assert all(g == 1 for gate in model.gates() for g in gate.tolist())


def test_per_layer_groups_export_to_transformers_with_fewer_kv_heads(gqa_dir, ids, tmp_path):
    model = headlab.load(gqa_dir)
    plan = select_groups(HeadScores(TABLE, "hand"), kv_groups(model), 4, per_layer=True)
    prune(model, plan)
    assert hf_expressible(model) is None
    export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_key_value_heads == 2 and hf.config.num_attention_heads == 4
    with torch.no_grad():
        assert_close(hf(ids).logits, model(ids).logits, rtol=0, atol=1e-4)


def test_run_by_groups_exports_to_transformers(gqa_dir, tmp_path):
    from headlab.runs.pipeline import run

    out, result = run(RunConfig(model=str(gqa_dir), unit="kv-group", kv_keep=0.5,
                                per_layer=True, export="hf", recover="none", max_tokens=1024,
                                seq_len=32, step=0.5, out=str(tmp_path / "run")))
    # 0.5 of 3 groups per layer, rounded up: 2 of 3 groups in each layer, 2 x 2 of 6 heads
    assert result.kv_heads_per_layer.after == [2, 2]
    assert result.heads_per_layer.after == [4, 4]
    assert result.export == "model-hf/"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "model-hf").eval()
    assert hf.config.num_key_value_heads == 2
    ours = headlab.load(out / "model")
    ids = torch.randint(0, 500, (1, 9))
    with torch.no_grad():
        assert_close(hf(ids).logits, ours(ids).logits, rtol=0, atol=1e-4)


def test_kv_group_on_a_model_without_gqa_prunes_single_heads(tiny_gpt2_dir, caplog):
    from headlab.runs.inputs import load_model
    from headlab.runs.pipeline import _target

    cfg = RunConfig(model=str(tiny_gpt2_dir), unit="kv-group", kv_keep=0.5).validated()
    with caplog.at_level(logging.WARNING, logger="headlab"):
        n = _target(cfg, load_model(cfg))
    assert n == 6  # half of 3 x 4 single-head groups
    assert "a group is one head" in caplog.text


@pytest.mark.parametrize(("kw", "match"), [
    ({"unit": "kv-group", "kv_keep": 0.0}, "--kv-keep must be in"),
    ({"unit": "kv-group", "kv_keep": 1.5}, "--kv-keep must be in"),
    ({"unit": "kv-group", "kv_keep": -0.2}, "--kv-keep must be in"),
    ({"kv_keep": 0.5}, "add --unit kv-group"),
    ({"unit": "kv-group", "kv_keep": 0.5, "keep": 0.5}, "not both"),
    ({"unit": "kv-group", "prune": 3}, "not --prune"),
    ({"unit": "group", "keep": 0.5}, "--unit must be one of"),
    ({"unit": "kv-group", "keep": 0.5, "group_score": "mean"}, "--group-score"),
    ({"unit": "kv-group", "kv_keep": 0.5, "demote": True, "export": "hf"},
     "drop --export hf"),
    ({"unit": "kv-group", "kv_keep": 0.5, "demote": True, "window": 0},
     "--window must be >= 1"),
    ({"unit": "kv-group", "kv_keep": 0.5, "demote": True, "sinks": -1},
     "--sinks must be >= 0"),
    ({"keep": 0.5, "demote": True}, "add --unit kv-group"),
    ({"unit": "kv-group", "kv_keep": 0.5, "demote_by": "retrieval"}, "add --demote"),
    ({"unit": "kv-group", "kv_keep": 0.5, "demote": True, "demote_by": "cls"},
     "unknown detector 'cls'; choose from previous-token"),
])
def test_bad_kv_cache_options_say_what_to_do(kw, match):
    with pytest.raises(UserError, match=match):
        RunConfig(model="m", **kw).validated()


def test_demote_run_records_the_cache_and_keeps_the_demotion(gqa_dir, tmp_path):
    import json

    from headlab.pruning import demoted_heads
    from headlab.report import build_report
    from headlab.results import RunResult
    from headlab.runs.pipeline import run

    out, result = run(RunConfig(model=str(gqa_dir), unit="kv-group", kv_keep=0.5,
                                demote=True, sinks=2, window=8, max_tokens=1024, seq_len=32,
                                step=0.5, decode_steps=2, out=str(tmp_path / "run")))
    kv = result.kv_cache
    # half of 6 groups kept whole, the other 3 demoted: no head removed
    assert result.heads_per_layer.after == [6, 6]
    assert sum(len(v) for v in kv.demoted.values()) == 6
    model = headlab.load(out / "model")
    assert demoted_heads(model) == kv.demoted
    # per token at 32 tokens: 3 full kv heads x 32 + 3 demoted x (2 + 8), over 32
    per_head = 2 * 8 * 4
    assert kv.bytes_per_token_eval == (6 * per_head, per_head * (3 * 32 + 3 * 10) / 32)
    assert kv.bytes_per_token_max == (6 * per_head, per_head * (3 * 256 + 3 * 10) / 256)
    assert [d.context for d in kv.decode] == [32, 128]
    assert all(d.before > 0 and d.after > 0 for d in kv.decode)
    assert kv.quality_removed == result.curve[-1].quality
    back = RunResult.from_json(json.loads((out / "results.json").read_text()))
    assert back.kv_cache == kv
    build_report(back, tmp_path / "r.html")
    assert "demoted (streaming) heads" in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize("group_score", ["sum", "max"])
def test_demote_by_a_detector_demotes_its_lowest_scoring_groups(gqa_dir, tmp_path,
                                                                group_score):
    from headlab.detectors import detect
    from headlab.pruning import trial
    from headlab.runs.inputs import build_data, load_model
    from headlab.runs.pipeline import run
    from headlab.selection import kv_groups, select_groups

    cfg = RunConfig(model=str(gqa_dir), unit="kv-group", kv_keep=0.5, demote=True,
                    demote_by="sink", group_score=group_score, sinks=2, window=8,
                    max_tokens=1024, seq_len=32, step=0.5, decode_steps=2,
                    out=str(tmp_path / "run"))
    out, result = run(cfg)
    # the run's detector: sink scores at the model's 256 positions capped to 128 tokens
    scores = detect(headlab.load(gqa_dir), "sink", seq_len=128, seed=0).tensor()  # (L, H)
    reduce = torch.sum if group_score == "sum" else torch.amax
    ranked = sorted((float(reduce(scores[layer, g])), layer, g)
                    for layer, layer_groups in enumerate(GROUPS) for g in layer_groups)
    assert ranked[2][0] < ranked[3][0]  # no tie at the cut: the lowest 3 of 6 are known
    lowest: dict[int, list[int]] = {}
    for _, layer, g in ranked[:3]:
        lowest[layer] = sorted(lowest.get(layer, []) + g)
    kv = result.kv_cache
    assert kv.demoted == lowest
    assert kv.selection == "sink detector"
    assert result.kept_heads == {layer: [h for h in range(6) if h not in lowest.get(layer, [])]
                                 for layer in range(2)}
    # the detector chose alone: its scores are the run's, no --method schedule ran
    assert torch.allclose(torch.tensor(result.importance, dtype=torch.float64),
                          scores.double(), equal_nan=True)
    # "removed instead" is the held-out quality with the detector's groups masked
    model = load_model(cfg.validated())
    _, heldout, _ = build_data(cfg, model)
    detected = detect(model, "sink", seq_len=128, seed=0)
    with trial(model, select_groups(detected, kv_groups(model), 3, group_score=group_score)):
        expected = headlab.evaluate(model, heldout, batch_size=cfg.batch_size).value
    assert kv.quality_removed == pytest.approx(expected, rel=1e-6)
    assert "chosen by sink detector" in (out / "report.html").read_text()


def test_the_command_demotes_by_the_retrieval_detector(gqa_dir, tmp_path):
    import json
    import subprocess
    import sys

    base = [sys.executable, "-m", "headlab", "prune", "--unit", "kv-group", "--kv-keep",
            "0.5", "--demote-by", "retrieval"]
    # refused before any model loads: this one does not exist
    r = subprocess.run([*base, "--model", str(tmp_path / "nowhere"), "--out",
                        str(tmp_path / "refused")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: --demote-by chooses the groups --demote demotes: add --demote (or drop "
        "--demote-by)"]
    assert not (tmp_path / "refused").exists()
    r = subprocess.run([*base, "--demote", "--model", str(gqa_dir), "--sinks", "2",
                        "--window", "8", "--max-tokens", "1024", "--seq-len", "32",
                        "--step", "0.5", "--quiet", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    kv = json.loads((tmp_path / "run" / "results.json").read_text())["kv_cache"]
    assert kv["selection"] == "retrieval detector"
    assert sum(len(v) for v in kv["demoted"].values()) == 6  # 3 of 6 groups of 2
    assert "chosen by retrieval detector" in (tmp_path / "run" / "report.html").read_text()


def test_predicted_speedup_scales_the_attention_share_by_the_keys_read():
    from headlab.evaluate.cache import predicted_speedup

    # half of a step is attention; half the kv heads then read 10 keys instead of 1000
    got = predicted_speedup(0.5, kv_full=1, kv_demoted=1, slots=10, context=1000)
    assert got == pytest.approx(1 / (0.5 + 0.5 * (1 + 10 / 1000) / 2), rel=1e-12)
    # a window longer than the context saves nothing
    assert predicted_speedup(0.5, kv_full=1, kv_demoted=1, slots=2000,
                             context=1000) == pytest.approx(1.0, rel=1e-12)


def test_bandwidth_speedup_counts_the_weights_and_cache_a_step_reads(gqa_dir):
    from headlab.evaluate.cache import bandwidth_speedup, step_bytes
    from headlab.pruning import copy_model

    model = headlab.load(gqa_dir)
    pruned = prune(copy_model(model), select_groups(HeadScores(TABLE, "hand"),
                                                    kv_groups(model), 3))
    weights = 4 * transformers.AutoModelForCausalLM.from_pretrained(gqa_dir).num_parameters()
    cache = 2 * 3 * (2 * 8 * 4)  # layers x key/value heads x (K and V, D = 8, float32)
    # 3 groups go: their 6 query heads (rows of q, columns of o) and 3 key/value heads
    removed = 4 * (2 * 6 * 8 * 48 + 2 * 3 * 8 * 48)
    assert step_bytes(model, 1000) == weights + 1000 * cache
    assert step_bytes(pruned, 1000) == weights - removed + 1000 * cache // 2
    assert bandwidth_speedup(model, pruned, context=1000) == pytest.approx(
        (weights + 1000 * cache) / (weights - removed + 500 * cache), rel=1e-12)


def test_per_layer_rounding_that_moves_the_kept_fraction_is_one_warning(gqa_dir, caplog):
    from headlab.runs.inputs import load_model
    from headlab.runs.pipeline import _target

    model = None
    for kv_keep, warned in ((0.5, True), (0.66, False)):
        cfg = RunConfig(model=str(gqa_dir), unit="kv-group", kv_keep=kv_keep,
                        per_layer=True).validated()
        model = model or load_model(cfg)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="headlab"):
            assert _target(cfg, model) == 2 * 2  # 2 of 3 key/value heads in each layer
        lines = [r.getMessage() for r in caplog.records]
        assert lines == (["--per-layer keeps 2 of 3 key/value heads in each layer: 67% of "
                          "them, not the 50% asked (a layer keeps whole heads)"]
                         if warned else [])
