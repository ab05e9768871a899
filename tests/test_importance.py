"""Tests for headlab.importance: head scores and their file formats.

References: Michel and Fisher scores recomputed example by example, with one (H,) gate
leaf per layer and autograd, and by central finite differences in float64; ablation
scores recomputed with `evaluate` on a masked copy. Equivalences: batch size does not
matter (gradients are zeroed per batch); a pruned head scores as its masked twin.
Invariants: layer-l2 rows have unit norm, global min-max lies in [0, 1], random is
a function of the seed, absent heads are NaN.

Shape notation: N examples, B batch, S sequence length, L layers, H heads per layer.
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math

import pytest
import torch
from _curvature import gauss_newton_by_hand
from _gates import gate_leaves
from torch.testing import assert_close

from headlab.data.blocks import Blocks
from headlab.data.texts import load_texts
from headlab.evaluate.quality import evaluate
from headlab.importance import (
    DEFAULT_METHOD,
    METHODS,
    TARGETED,
    UNTARGETED_METHOD,
    HeadScores,
    score,
)
from headlab.objectives import make_blocks

N, S = 6, 24
# float32 gradients of the same function, batched differently: ~1e-6 relative
GRAD = {"rtol": 1e-4, "atol": 1e-9}


@pytest.fixture()
def blocks(tiny_gpt2) -> Blocks:
    return make_blocks(load_texts(), tiny_gpt2.tokenizer, kind="causal-lm", seq_len=S,
                       max_tokens=N * S)


def _example_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL of one example (1, S), written out with torch."""
    logits = model(ids).logits  # (1, S, V)
    logp = logits[0, :-1].log_softmax(-1)  # (S-1, V)
    return -logp.gather(-1, ids[0, 1:, None]).mean()


def _per_example_gate_grads(model, blocks: Blocks) -> torch.Tensor:
    """dL(x)/d gate for each example x separately: (N, L, H), via autograd on (H,) leaves."""
    out = []
    for x in blocks.input_ids:
        with gate_leaves(model) as gates:  # (H,) each
            _example_loss(model, x[None]).backward()
        out.append(torch.stack([g.grad.double() for g in gates]))
    model.zero_grad(set_to_none=True)
    return torch.stack(out)


def _finite_difference_grads(model, blocks: Blocks, eps: float = 1e-4) -> torch.Tensor:
    """The same gradients by central differences of the float64 model: (N, L, H)."""
    model = copy.deepcopy(model).double()
    L, H = model.n_layers, model.n_original_heads
    out = torch.zeros(len(blocks), L, H, dtype=torch.float64)
    with torch.no_grad():
        for n, x in enumerate(blocks.input_ids):
            for layer, attn in enumerate(model.attentions):
                for h in range(H):
                    losses = []
                    for sign in (1, -1):
                        g = attn.head_gate.double().clone()
                        g[h] += sign * eps
                        attn.gate_override = g
                        losses.append(_example_loss(model, x[None]))
                    attn.gate_override = None
                    out[n, layer, h] = (losses[0] - losses[1]) / (2 * eps)
    return out


# ---------------------------------------------------------------------- references
def test_michel_and_fisher_equal_per_example_brute_force(tiny_gpt2, blocks):
    grads = _per_example_gate_grads(tiny_gpt2, blocks)  # (N, L, H)
    michel = score(tiny_gpt2, blocks, method="michel", batch_size=4, normalize=False)
    fisher = score(tiny_gpt2, blocks, method="fisher", batch_size=4, normalize=False)
    assert_close(michel.tensor(), grads.abs().mean(0), **GRAD)
    assert_close(fisher.tensor(), grads.pow(2).mean(0), rtol=2e-4, atol=1e-14)
    # the mean of |.| is not |mean|: one backward over the batch sum would be wrong
    assert (grads.abs().mean(0) - grads.mean(0).abs()).max() > 1e-3 * grads.abs().max()
    assert michel.method == "michel" and michel.normalisation is None
    assert michel.n_tokens == N * (S - 1)


def test_michel_equals_finite_differences_in_float64(tiny_gpt2, blocks):
    few = blocks.subset([0, 3])
    fd = _finite_difference_grads(tiny_gpt2, few)
    michel = score(tiny_gpt2, few, method="michel", batch_size=2, normalize=False)
    assert_close(michel.tensor(), fd.abs().mean(0), rtol=1e-4, atol=1e-8)


def test_michel_with_masked_heads_uses_the_current_gates(tiny_gpt2, blocks):
    tiny_gpt2.mask_heads({0: [1], 2: [0, 2]})
    grads = _per_example_gate_grads(tiny_gpt2, blocks)
    michel = score(tiny_gpt2, blocks, method="michel", batch_size=3, normalize=False).tensor()
    expected = grads.abs().mean(0)
    absent = torch.zeros(3, 4, dtype=torch.bool)
    absent[0, 1] = absent[2, 0] = absent[2, 2] = True
    assert torch.isnan(michel[absent]).all()
    assert_close(michel[~absent], expected[~absent], **GRAD)


def test_gradients_are_zeroed_per_batch(tiny_gpt2, blocks):
    one = score(tiny_gpt2, blocks, method="michel", batch_size=1, normalize=False).tensor()
    for batch_size in (4, 5, N):
        other = score(tiny_gpt2, blocks, method="michel", batch_size=batch_size,
                      normalize=False).tensor()
        assert_close(other, one, **GRAD)


def test_per_token_gates_bound_the_per_example_scores(tiny_gpt2, blocks):
    """sum_s |g_s| >= |sum_s g_s|: one gate per position scores at least as high."""
    per_example = score(tiny_gpt2, blocks, method="michel", normalize=False).tensor()
    per_token = score(tiny_gpt2, blocks, method="michel", normalize=False,
                      per_token=True).tensor()
    assert torch.all(per_token >= per_example * (1 - 1e-5))
    assert (per_token - per_example).min() > 0  # strict: the signs do vary over positions


def test_taylor_is_minus_the_gradient_plus_half_the_curvature(tiny_gpt2, blocks):
    """At a mask (as iterative pruning scores): E_x[-dL/dxi] exactly (per-example
    autograd) plus half the Gauss-Newton curvature by hand (finite differences), the
    latter estimated from 400 probes per batch (a few % of sampling error)."""
    tiny_gpt2.mask_heads({0: [1], 2: [0, 2]})
    few = blocks.subset([0, 1, 2])
    first = -_per_example_gate_grads(tiny_gpt2, few).mean(0)  # (L, H)
    curvature = gauss_newton_by_hand(tiny_gpt2, next(iter(few.batches(3)))).mean(0)
    taylor = score(tiny_gpt2, few, method="taylor", probes=400, batch_size=2)
    assert taylor.normalisation is None and taylor.extra["probes"] == 400
    t = taylor.tensor()
    present = ~t.isnan()
    assert present.sum() == 9
    assert_close(t[present], (first + curvature / 2)[present], rtol=0.1, atol=0)
    assert_close((t - first)[present].sum(), curvature[present].sum() / 2, rtol=0.05, atol=0)
    # the first-order term matters here: without it the estimate would be far off
    assert (first[present].abs() > 0.3 * curvature[present] / 2).any()


def test_taylor_is_seeded_and_its_arguments_checked(tiny_gpt2, blocks):
    few = blocks.subset([0, 1])
    a = score(tiny_gpt2, few, method="taylor", seed=3).tensor()
    assert torch.equal(a, score(tiny_gpt2, few, method="taylor", seed=3).tensor())
    assert not torch.equal(a, score(tiny_gpt2, few, method="taylor", seed=4).tensor())
    with pytest.raises(ValueError, match="at least one curvature probe"):
        score(tiny_gpt2, few, method="taylor", probes=0)
    with pytest.raises(ValueError, match="per-token gates apply to michel and fisher"):
        score(tiny_gpt2, few, method="taylor", per_token=True)


def test_ablation_equals_loss_change_by_hand(tiny_gpt2, blocks):
    scores = score(tiny_gpt2, blocks, method="ablation", normalize=False).tensor()
    base = evaluate(tiny_gpt2, blocks).loss
    expected = torch.zeros(3, 4, dtype=torch.float64)
    for layer in range(3):
        for head in range(4):
            masked = copy.deepcopy(tiny_gpt2)
            masked.mask_heads({layer: [head]})
            expected[layer, head] = evaluate(masked, blocks).loss - base
    assert_close(scores, expected, rtol=1e-5, atol=1e-8)
    assert expected.abs().min() > 0  # every head changes the loss
    # the model is left with every gate at 1
    assert all(torch.all(g == 1) for g in tiny_gpt2.gates())


def test_pruned_heads_score_as_their_masked_twins(tiny_gpt2, tiny_gpt2_dir, blocks):
    import headlab

    masked = headlab.load(tiny_gpt2_dir)
    masked.mask_heads({1: [0, 3]})
    tiny_gpt2.prune_heads({1: [0, 3]})
    for method in ("michel", "ablation"):
        a = score(tiny_gpt2, blocks, method=method, normalize=False).tensor()
        b = score(masked, blocks, method=method, normalize=False).tensor()
        assert_close(a, b, rtol=1e-4, atol=1e-8, equal_nan=True)
        assert torch.isnan(a[1, [0, 3]]).all() and not torch.isnan(a[1, [1, 2]]).any()


def test_a_method_left_unsaid_is_the_runs_default(tiny_gpt2, blocks):
    """As `headlab prune` and `headlab score` choose: the gates where a target is given,
    taylor where none is."""
    assert (DEFAULT_METHOD, UNTARGETED_METHOD) == ("gates", "taylor")
    assert score(tiny_gpt2, blocks).method == "taylor"
    assert score(tiny_gpt2, blocks, target=6, gate_steps=2).method == "gates"


# ---------------------------------------------------------------------- normalisation
def test_layer_l2_gives_unit_rows(tiny_gpt2, blocks):
    raw = score(tiny_gpt2, blocks, method="michel", normalize=False).tensor()
    norm = score(tiny_gpt2, blocks, method="michel", normalize=True)
    assert norm.normalisation == "layer-l2"
    t = norm.tensor()
    assert_close(t.norm(dim=1), torch.ones(3, dtype=torch.float64), rtol=1e-12, atol=0)
    assert_close(t, raw / raw.norm(dim=1, keepdim=True), rtol=1e-12, atol=0)


def test_layer_l2_ignores_absent_heads(tiny_gpt2, blocks):
    tiny_gpt2.mask_heads({0: [2]})
    t = score(tiny_gpt2, blocks, method="michel", normalize=True).tensor()
    assert math.isnan(t[0, 2])
    assert_close(t.nan_to_num(0.0).norm(dim=1), torch.ones(3, dtype=torch.float64),
                 rtol=1e-12, atol=0)


def test_global_minmax_spans_zero_to_one(tiny_gpt2, blocks):
    l2 = score(tiny_gpt2, blocks, method="michel").tensor()
    s = score(tiny_gpt2, blocks, method="michel", global_minmax=True)
    assert s.normalisation == "layer-l2+minmax"
    t = s.tensor()
    assert float(t.min()) == 0.0 and float(t.max()) == 1.0
    assert_close(t, (l2 - l2.min()) / (l2.max() - l2.min()), rtol=1e-12, atol=1e-15)
    # ranks are unchanged by either normalisation within a layer
    raw = score(tiny_gpt2, blocks, method="michel", normalize=False).tensor()
    assert torch.equal(t.argsort(dim=1), raw.argsort(dim=1))
    only = score(tiny_gpt2, blocks, method="michel", normalize=False, global_minmax=True)
    assert only.normalisation == "minmax"
    assert_close(only.tensor(), (raw - raw.min()) / (raw.max() - raw.min()),
                 rtol=1e-12, atol=1e-15)


def test_random_is_seeded(tiny_gpt2, blocks):
    a = score(tiny_gpt2, blocks, method="random", seed=7)
    b = score(tiny_gpt2, blocks, method="random", seed=7)
    c = score(tiny_gpt2, blocks, method="random", seed=8)
    assert a.scores == b.scores
    assert not torch.allclose(a.tensor(), c.tensor())
    t = a.tensor()
    assert torch.all((t >= 0) & (t < 1)) and a.normalisation is None
    assert a.extra["seed"] == 7


# ---------------------------------------------------------------------- absent heads
@pytest.mark.parametrize("method", METHODS)
def test_masked_and_pruned_heads_are_nan(tiny_gpt2, blocks, method):
    tiny_gpt2.mask_heads({2: [3]})
    tiny_gpt2.prune_heads({0: [0, 1, 2, 3], 1: [1]})  # layer 0 loses every head
    target = {"target": 3} if method in TARGETED else {}
    t = score(tiny_gpt2, blocks.subset([0, 1]), method=method, normalize=False,
              gate_steps=5, **target).tensor()
    assert t.shape == (3, 4)
    absent = torch.zeros(3, 4, dtype=torch.bool)
    absent[0] = True
    absent[1, 1] = absent[2, 3] = True
    assert torch.isnan(t[absent]).all()
    assert torch.isfinite(t[~absent]).all()


def test_scoring_leaves_the_model_as_it_was(tiny_gpt2, blocks):
    tiny_gpt2.train()
    tiny_gpt2.blocks[0].mlp.fc.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in tiny_gpt2.state_dict().items()}
    for method in ("michel", "ablation"):
        score(tiny_gpt2, blocks.subset([0]), method=method)
    assert tiny_gpt2.training
    assert not tiny_gpt2.blocks[0].mlp.fc.weight.requires_grad
    assert tiny_gpt2.blocks[1].mlp.fc.weight.requires_grad
    assert all(a.gate_override is None for a in tiny_gpt2.attentions)
    assert all(p.grad is None for p in tiny_gpt2.parameters())
    for k, v in tiny_gpt2.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_bad_arguments_are_refused(tiny_gpt2, blocks):
    with pytest.raises(ValueError, match="unknown importance method 'gradient'.*michel"):
        score(tiny_gpt2, blocks, method="gradient")
    with pytest.raises(ValueError, match="score: .* holds no blocks"):
        score(tiny_gpt2, blocks.subset([]), method="michel")


# ---------------------------------------------------------------------- HeadScores
def _scores_with_nan() -> HeadScores:
    return HeadScores([[0.5, math.nan, 1.25e-7], [3.0, 2.0, -0.125]], "michel", "bundled",
                      123, "layer-l2", {"per_token": False, "seed": 0})


def test_json_round_trip(tmp_path):
    s = _scores_with_nan()
    text = json.dumps(s.to_json(), allow_nan=False)  # NaN is written as null
    back = HeadScores.from_json(text)
    assert_close(back.tensor(), s.tensor(), rtol=0, atol=0, equal_nan=True)
    assert (back.method, back.data, back.n_tokens, back.normalisation, back.extra) == (
        "michel", "bundled", 123, "layer-l2", {"per_token": False, "seed": 0})
    s.save(tmp_path / "scores.json")
    again = HeadScores.from_json(json.loads((tmp_path / "scores.json").read_text()))
    assert_close(again.tensor(), s.tensor(), rtol=0, atol=0, equal_nan=True)


def test_csv_round_trip(tmp_path):
    s = _scores_with_nan()
    s.save_csv(tmp_path / "scores.csv")
    rows = list(csv.DictReader(io.StringIO((tmp_path / "scores.csv").read_text())))
    assert [(int(r["layer"]), int(r["head"])) for r in rows] == [
        (layer, head) for layer in range(2) for head in range(3)]
    values = torch.tensor([math.nan if r["importance"] == "" else float(r["importance"])
                           for r in rows], dtype=torch.float64).view(2, 3)
    assert_close(values, s.tensor(), rtol=1e-8, atol=0, equal_nan=True)


def test_real_scores_round_trip(tiny_gpt2, blocks):
    tiny_gpt2.mask_heads({1: [2]})
    s = score(tiny_gpt2, blocks.subset([0, 1]), method="michel")
    back = HeadScores.from_json(json.dumps(s.to_json()))
    assert_close(back.tensor(), s.tensor(), rtol=0, atol=0, equal_nan=True)
    assert back.extra == s.extra and back.data == s.data


def test_html_view():
    html = _scores_with_nan()._repr_html_()
    assert html.startswith("<div>") and "michel" in html
    assert html.count("<tr>") == 3  # header and two layers
    assert "L1 H2" in html and 'title="removed"' in html
    assert ">1.2e-07</td>" in html and ">-0.12</td>" in html  # small and signed scores show
    empty = HeadScores([[math.nan, math.nan]], "random")._repr_html_()
    assert empty.count('title="removed"') == 2
