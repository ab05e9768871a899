"""Tests for FLAP's fluctuation metric (`headlab.importance.flap`, An et al. 2024).

Reference: the metric computed in float64 numpy from the per-head outputs captured
through hooks and the model's W_O, on a model with a head removed and one gated off.
Shape notation: N tokens, H heads, D head dim, L layers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from headlab.attention.hooks import capture
from headlab.data.texts import load_texts
from headlab.importance import score
from headlab.objectives import make_blocks, prepare

S = 24


def _numpy_flap(z: np.ndarray, w_o: np.ndarray, present: np.ndarray) -> np.ndarray:
    """z (N, H, D) one layer's W_O inputs over real tokens, w_o (E, H*D), present (H,)
    bool: per head, the mean over its channels of ((var_c * ||w_c||^2)^2 standardised
    over the layer's present channels), NaN where not present."""
    n, h, d = z.shape
    m = (z.reshape(n, h * d).var(0, ddof=1) * (w_o ** 2).sum(0)) ** 2  # (H*D,)
    m = m.reshape(h, d)
    kept = m[present]
    head = ((m - kept.mean()) / kept.std(ddof=1)).mean(1)
    return np.where(present, head, np.nan)


def test_flap_scores_equal_the_metric_in_numpy(tiny_gpt2):
    model = tiny_gpt2
    blocks = prepare(model, make_blocks(load_texts(), model.tokenizer, kind="causal-lm",
                                        seq_len=S, max_tokens=8 * S))
    model.prune_heads({0: [1]})
    gates = model.attentions[2].head_gate.clone()
    gates[3] = 0
    model.attentions[2].set_gates(gates)
    s = score(model, blocks, method="flap", batch_size=3)
    assert s.normalisation is None  # standardised per layer: compared across layers as is
    real = blocks.attention_mask.bool()
    with capture(model, "blocks.*.attn.z") as cap, torch.no_grad():
        model(blocks.input_ids, attention_mask=blocks.attention_mask)
    ours = s.tensor().numpy()  # (L, H_original)
    for i, a in enumerate(model.attentions):
        z = cap[f"blocks.{i}.attn.z"][real].double().numpy()
        w = a.o_proj.weight.detach().double().numpy()
        present = (a.head_gate != 0).numpy()
        expected = _numpy_flap(z, w, present)
        row = ours[i, a.head_ids.numpy()]
        assert np.array_equal(np.isnan(row), np.isnan(expected))
        assert np.nanmax(np.abs(row - expected)) < 1e-9
        assert np.nanstd(expected) > 1e-3  # the heads differ
    assert math.isnan(ours[0, 1]) and math.isnan(ours[2, 3])


@pytest.mark.parametrize("batch_size", [1, 8])
def test_flap_scores_do_not_depend_on_the_batching(tiny_gpt2, batch_size):
    blocks = prepare(tiny_gpt2, make_blocks(load_texts(), tiny_gpt2.tokenizer,
                                            kind="causal-lm", seq_len=S, max_tokens=8 * S))
    one = score(tiny_gpt2, blocks, method="flap", batch_size=4).tensor()
    torch.testing.assert_close(score(tiny_gpt2, blocks, method="flap",
                                     batch_size=batch_size).tensor(), one,
                               rtol=1e-9, atol=1e-12)
