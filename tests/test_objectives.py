"""Tests for headlab.objectives: one objective per kind of model.

The losses, masking and probes each objective computes are checked against plain torch
in test_evaluate.py and test_importance.py; here: the lookup, what each objective
declares (metric, direction, block length, layout), and how a metric value is made.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import headlab
from headlab.data.blocks import LAYOUTS
from headlab.data.texts import TextData, load_texts
from headlab.errors import UserError
from headlab.objectives import DEFAULT_BATCH_SIZE, OBJECTIVES, make_blocks, objective_for

# kind: (metric, higher is better, default block length, needs the unpruned model)
DECLARED = {
    "causal-lm": ("perplexity", False, 256, False),
    "masked-lm": ("mlm-perplexity", False, 256, False),
    "classifier": ("accuracy", True, 128, False),
    "embedding": ("fidelity", True, 128, True),
}


@pytest.mark.parametrize("kind", list(DECLARED))
def test_each_kind_declares_its_metric_direction_and_block_length(kind):
    o = objective_for(kind)
    assert o.kind == kind
    assert (o.metric, o.higher_is_better, o.default_seq_len, o.needs_reference) == DECLARED[kind]
    assert o.generates is (kind == "causal-lm")


def test_the_lookup_reads_the_models_kind(tiny_gpt2):
    assert tiny_gpt2.kind == "causal-lm"
    assert objective_for(tiny_gpt2) is objective_for("causal-lm") is OBJECTIVES["causal-lm"]
    assert objective_for(SimpleNamespace(kind="embedding")) is OBJECTIVES["embedding"]


@pytest.mark.parametrize("unknown", ["seq2seq", "", None, SimpleNamespace(kind="vision"),
                                     SimpleNamespace()])
def test_an_unknown_kind_is_a_user_error_naming_the_known_ones(unknown):
    with pytest.raises(UserError, match="no objective for model kind.*causal-lm, masked-lm, "
                                        "classifier, embedding"):
        objective_for(unknown)


def test_every_objective_has_a_text_layout_and_every_layout_an_objective():
    assert set(OBJECTIVES) == set(DECLARED)
    layouts = {kind: o.layout for kind, o in OBJECTIVES.items()}
    assert set(layouts.values()) == set(LAYOUTS)
    assert layouts == {"causal-lm": "stream", "masked-lm": "wrapped-stream",
                       "classifier": "rows", "embedding": "sentences"}


@pytest.mark.parametrize(("positions", "expected"), [(1024, 256), (256, 256), (100, 100)])
def test_the_default_block_length_is_capped_by_the_models_positions(positions, expected):
    model = SimpleNamespace(kind="causal-lm", max_positions=positions)
    assert objective_for(model).seq_len_for(model) == expected
    assert objective_for("classifier").seq_len_for(model) == min(128, positions)


def test_perplexity_is_exp_of_the_mean_loss_capped_and_the_rest_is_the_hit_rate():
    for kind in ("causal-lm", "masked-lm"):
        o = objective_for(kind)
        assert o.value(2.5, 0.9) == math.exp(2.5)
        assert o.value(1e4, 0.0) == math.exp(700.0)  # finite, not inf
    for kind in ("classifier", "embedding"):
        assert objective_for(kind).value(2.5, 0.75) == 0.75


def test_an_objectives_blocks_are_make_blocks_of_its_kind(bpe_tokenizer):
    data = TextData(load_texts().texts[:12])
    for kind in ("causal-lm", "classifier", "embedding"):
        mine = objective_for(kind).make_blocks(data, bpe_tokenizer, seq_len=32, max_tokens=500)
        theirs = make_blocks(data, bpe_tokenizer, kind=kind, seq_len=32, max_tokens=500)
        assert torch.equal(mine.input_ids, theirs.input_ids)
        assert torch.equal(mine.attention_mask, theirs.attention_mask)


def test_a_causal_lm_needs_no_preparation_and_its_losses_come_from_its_forward(tiny_gpt2):
    blocks = make_blocks(load_texts(), tiny_gpt2.tokenizer, kind="causal-lm", seq_len=16,
                         max_tokens=64)
    assert headlab.prepare(tiny_gpt2, blocks) is blocks
    o = objective_for(tiny_gpt2)
    batch = next(iter(blocks.batches(DEFAULT_BATCH_SIZE)))
    with torch.no_grad():
        direct = o.losses(tiny_gpt2, o.forward(tiny_gpt2, batch), batch)
        via = o.example_losses(tiny_gpt2, batch)
    for a, b in zip(direct, via, strict=True):
        assert torch.equal(a, b)
    assert via[1].tolist() == [15.0] * len(blocks)  # every next-token pair of a full block
