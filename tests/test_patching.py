"""Activation patching: all heads at once restore the clean metric, none leaves the
corrupted one; single-head effects under GQA; bootstrap intervals."""

from __future__ import annotations

import math

import pytest
import torch

import headlab
from headlab.analysis.patching import logit_diff, patch, patched_metric
from tests.test_attribution import tiny_llama  # noqa: F401  (a fixture)


def _pairs(model, n: int = 6, length: int = 10, seed: int = 0):
    """Clean and corrupted prompts that differ in one early token; the metric is read at
    the last position, whose own token is the same in both."""
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, 500, (n, length), generator=gen)
    corrupted = clean.clone()
    corrupted[:, 2] = torch.randint(1, 500, (n,), generator=gen)
    target = torch.randint(1, 500, (n,), generator=gen)
    foil = torch.randint(1, 500, (n,), generator=gen)
    return clean, corrupted, logit_diff(target, foil)


@pytest.mark.parametrize("which", ["tiny_gpt2", "tiny_llama"])
def test_all_heads_restore_clean_and_none_leaves_corrupted(which, request):
    model = request.getfixturevalue(which)
    clean, corrupted, metric = _pairs(model)
    every = {i: list(range(model.n_original_heads)) for i in range(model.n_layers)}
    with torch.no_grad():
        m_clean = metric(model(clean).logits, torch.arange(len(clean)))
        m_corr = metric(model(corrupted).logits, torch.arange(len(clean)))
    assert (m_clean - m_corr).abs().max() > 1e-3, "the corruption must matter"
    restored = patched_metric(model, corrupted, clean, metric=metric, heads=every, batch_size=4)
    torch.testing.assert_close(restored, m_clean, atol=1e-4, rtol=0)
    broken = patched_metric(model, clean, corrupted, metric=metric, heads=every, batch_size=4)
    torch.testing.assert_close(broken, m_corr, atol=1e-4, rtol=0)
    none = patched_metric(model, corrupted, clean, metric=metric, heads={}, batch_size=4)
    torch.testing.assert_close(none, m_corr, atol=1e-5, rtol=0)


def test_per_head_effects_under_gqa_with_intervals(tiny_llama):  # noqa: F811
    clean, corrupted, metric = _pairs(tiny_llama, n=8)
    got = patch(tiny_llama, clean, corrupted, metric=metric, batch_size=4, n_boot=200)
    # one query head of a GQA group patched alone equals patching it through the API
    for layer, head in [(0, 1), (1, 2)]:
        alone = patched_metric(tiny_llama, corrupted, clean, metric=metric,
                               heads={layer: [head]})
        want = (alone.mean() - got.corrupted) / (got.clean - got.corrupted)
        torch.testing.assert_close(got.denoise[layer][head], float(want), atol=1e-6, rtol=0)
    for layer in range(2):
        for head in range(4):
            lo, hi = got.denoise_ci[layer][head]
            assert lo <= got.denoise[layer][head] <= hi
            lo, hi = got.noise_ci[layer][head]
            assert lo <= got.noise[layer][head] <= hi
    assert "activation patching" in got._repr_html_()


def test_only_asked_heads_and_bad_inputs(tiny_gpt2):
    clean, corrupted, metric = _pairs(tiny_gpt2, n=3)
    got = patch(tiny_gpt2, clean, corrupted, metric=metric, heads={0: [1]}, n_boot=50)
    assert not math.isnan(got.denoise[0][1]) and math.isnan(got.denoise[0][0])
    assert got.to_json()["denoise"][0][0] is None
    with pytest.raises(headlab.errors.UserError, match="same shape"):
        patch(tiny_gpt2, clean, corrupted[:, :-1], metric=metric)
    with pytest.raises(headlab.errors.UserError, match="site"):
        patch(tiny_gpt2, clean, corrupted, metric=metric, site="mlp")


def test_a_layers_heads_are_patched_in_one_batch_each_as_if_alone(tiny_llama):  # noqa: F811
    """Every head's effect, both ways, equals patching it alone through the API, while
    the forwards are one per layer, direction and batch of pairs, not one per head."""
    clean, corrupted, metric = _pairs(tiny_llama, n=6)
    calls = []
    handle = tiny_llama.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        got = patch(tiny_llama, clean, corrupted, metric=metric, batch_size=4, n_boot=20)
    finally:
        handle.remove()
    batches = 2  # 6 pairs in batches of 4
    assert len(calls) == 2 * batches + tiny_llama.n_layers * 2 * batches
    for layer in range(tiny_llama.n_layers):
        for head in range(tiny_llama.n_original_heads):
            into_corrupted = patched_metric(tiny_llama, corrupted, clean, metric=metric,
                                            heads={layer: [head]})
            into_clean = patched_metric(tiny_llama, clean, corrupted, metric=metric,
                                        heads={layer: [head]})
            span = got.clean - got.corrupted
            torch.testing.assert_close(got.denoise[layer][head],
                                       float((into_corrupted.mean() - got.corrupted) / span),
                                       atol=1e-6, rtol=0)
            torch.testing.assert_close(got.noise[layer][head],
                                       float((got.clean - into_clean.mean()) / span),
                                       atol=1e-6, rtol=0)
