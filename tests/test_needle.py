"""Tests for headlab.evaluate.needle: the offline needle-in-a-haystack check.

Invariants: each prompt holds the fact once, at the asked depth of its filler, and is
about the asked length in tokens; the scorer takes the answer's first number; the grid
is seeded. Reference: the unpruned SmolLM2-135M finds the needle at short lengths
(slow). Errors name the model's limit.
"""

from __future__ import annotations

import pytest
import torch

import headlab
from headlab.data.texts import load_texts
from headlab.errors import UserError
from headlab.evaluate.needle import (
    NeedleResult,
    _correct,
    _fact,
    _prompt,
    default_lengths,
    needle_test,
)


def test_prompts_hold_the_fact_at_its_depth_and_about_the_length(bpe_tokenizer):
    stream = bpe_tokenizer(" ".join(load_texts().texts), add_special_tokens=False)["input_ids"]
    fact = _fact("blue door", "482913")
    for length in (128, 512):
        for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
            text = _prompt(stream, bpe_tokenizer, length=length, depth=depth, key="blue door",
                           value="482913", offset=100)
            assert text.count(fact) == 1 and text.count("482913") == 2
            n = len(bpe_tokenizer(text)["input_ids"])
            assert length - 16 <= n <= length + 4, (length, depth, n)
            haystack = text.split("\n\nWhat is the secret code")[0]
            where = haystack.index(fact) / max(1, len(haystack) - len(fact))
            assert abs(where - depth) < 0.12, (length, depth, where)


def test_the_answer_is_right_when_its_first_number_is_the_value():
    assert _correct(" 482913. The end", "482913")
    assert not _correct(" 48291", "482913")
    assert not _correct(" 100 or 482913", "482913")
    assert not _correct(" nothing", "482913")


def test_default_lengths_double_up_to_the_limit():
    assert default_lengths(8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert default_lengths(1000) == [256, 512, 1000]
    assert default_lengths(128) == [128]


def test_grid_shape_seed_and_limit_on_a_random_model(tiny_gpt2):
    a = needle_test(tiny_gpt2, lengths=[64, 80], depths=[0, 1], trials=2, seed=3)
    b = needle_test(tiny_gpt2, lengths=[64, 80], depths=[0, 1], trials=2, seed=3)
    assert a == b
    assert a.lengths == [64, 80] and a.depths == [0.0, 1.0] and a.trials == 2
    assert len(a.accuracy) == 2 and all(len(r) == 2 for r in a.accuracy)
    assert all(v in (0.0, 0.5, 1.0) for r in a.accuracy for v in r)
    assert NeedleResult.from_json(a.to_json()) == a
    with pytest.raises(UserError, match="within the model's limit of 128"):
        needle_test(tiny_gpt2, lengths=[256])


@pytest.mark.slow
@pytest.mark.real
def test_unpruned_smollm2_finds_the_needle_at_short_lengths():
    model = headlab.load("smollm2-135m")
    torch.manual_seed(0)
    result = needle_test(model, lengths=[256], depths=[0.0, 0.5, 1.0], trials=2)
    # measured: 1.0 in every cell (README, "Comparable numbers")
    assert result.mean >= 5 / 6, result.accuracy
