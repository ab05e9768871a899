"""Michel importance beats the random floor on the real bundled models.

The issue's bar: at keep 0.6, the held-out perplexity increase with `michel` is at
most half the mean increase of `random` over 3 seeds (SmolLM2). For MiniLM's embedding
fidelity the same bar is not reached by any head scorer we tried (even exact
single-head ablation reaches ~0.58 of random at this size; see the benchmark), so the
test holds michel to the bar it does reach, with margin.
"""

from __future__ import annotations

import pytest

import headlab

pytestmark = [pytest.mark.real, pytest.mark.slow]


def _increase_ratio(name: str, *, seq_len: int, max_tokens: int, metric_delta) -> float:
    model = headlab.load(name)
    blocks = headlab.make_blocks(headlab.load_texts(), model.tokenizer, kind=model.kind,
                                 seq_len=seq_len, max_tokens=max_tokens)
    scoring, heldout = headlab.split_blocks(blocks, seed=0)
    scoring = headlab.prepare(model, scoring, seed=0)
    heldout = headlab.prepare(model, heldout, seed=1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = headlab.evaluate(model, heldout, batch_size=4)
    increases = {}
    for method, seed in (("michel", 0), ("random", 0), ("random", 1), ("random", 2)):
        res = headlab.prune_to_target(model, scoring, heldout, method=method, keep=0.6,
                                      seed=seed, step=0.2, batch_size=4)
        after = headlab.evaluate(model, heldout, batch_size=4)
        assert res.plan.n_kept == pytest.approx(0.6 * len(res.scores.scores) *
                                                len(res.scores.scores[0]), abs=1)
        increases[(method, seed)] = metric_delta(before, after)
        model.load_state_dict(state)  # gates back to 1
    random_mean = sum(v for (m, _), v in increases.items() if m == "random") / 3
    assert random_mean > 0
    return increases[("michel", 0)] / random_mean


def test_michel_halves_random_perplexity_increase_on_smollm2():
    ratio = _increase_ratio("smollm2-135m", seq_len=64, max_tokens=1024,
                            metric_delta=lambda b, a: a.value - b.value)
    assert ratio <= 0.5, f"michel/random perplexity increase = {ratio:.3f}"


def test_michel_beats_random_on_minilm_fidelity():
    ratio = _increase_ratio("minilm-l6", seq_len=128, max_tokens=2048,
                            metric_delta=lambda b, a: b.value - a.value)
    assert ratio <= 0.75, f"michel/random fidelity loss = {ratio:.3f}"
