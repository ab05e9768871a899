"""The notebook API a TransformerLens user reaches for: no function hides its module,
a loss in one call, top heads from every result, tokens as text, one stacked tensor."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _encoders import write_checkpoint

import headlab
from headlab.errors import UserError


def _ids(model, n: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(1, 500, (n, length), generator=torch.Generator().manual_seed(0))


def test_hooks_and_evaluate_are_callable_modules(tiny_gpt2):
    import headlab.evaluate.needle

    assert callable(headlab.hooks.ablate_heads) and callable(headlab.hooks.mean_z)
    assert headlab.evaluate.needle.needle_test is not None
    assert headlab.evaluate.quality.evaluate is not None
    ids = _ids(tiny_gpt2)
    with torch.no_grad():
        plain = tiny_gpt2(ids).logits
        with headlab.hooks(tiny_gpt2, headlab.hooks.ablate_heads(tiny_gpt2, {0: [1]})):
            ablated = tiny_gpt2(ids).logits
    assert (plain - ablated).abs().max() > 1e-4


def test_loss_is_the_mean_next_token_loss_and_reads_hooks(tiny_gpt2):
    ids = _ids(tiny_gpt2)
    with torch.no_grad():
        logits = tiny_gpt2(ids).logits
        expected = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   ids[:, 1:].reshape(-1))
        got = headlab.loss(tiny_gpt2, ids)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        with headlab.hooks(tiny_gpt2, headlab.hooks.ablate_heads(tiny_gpt2, {0: [0, 1, 2, 3]})):
            ablated = headlab.loss(tiny_gpt2, ids)
    assert abs(float(ablated - got)) > 1e-5
    text = headlab.loss(tiny_gpt2, "The cat sat on the mat, and the dog sat too.")
    assert text.dim() == 0 and math.isfinite(text.item())


def test_loss_refuses_a_model_without_next_token_loss(tmp_path):
    model = headlab.load(write_checkpoint(tmp_path, "roberta", "encoder"), tokenizer=False)
    with pytest.raises(UserError, match="headlab.evaluate"):
        headlab.loss(model, torch.tensor([[1, 2, 3]]))


def test_head_scores_top_like_the_other_results():
    scores = headlab.HeadScores([[0.1, math.nan, 0.7], [0.9, 0.2, -0.5]], "michel")
    assert scores.top(2) == [(1, 0, 0.9), (0, 2, 0.7)]
    assert len(scores.top()) == 5


def test_logit_diff_takes_token_strings(tiny_gpt2):
    tok = tiny_gpt2.tokenizer
    target, foil = " the", " and"
    t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (target, foil))
    clean, corrupted = _ids(tiny_gpt2, n=3), _ids(tiny_gpt2, n=3).flip(1)
    by_id = headlab.patch(tiny_gpt2, clean, corrupted, n_boot=20, heads={0: [1]},
                          metric=headlab.logit_diff(torch.tensor([t] * 3), torch.tensor([f] * 3)))
    by_text = headlab.patch(tiny_gpt2, clean, corrupted, n_boot=20, heads={0: [1]},
                            metric=headlab.logit_diff(target, foil))
    assert by_text.denoise[0][1] == by_id.denoise[0][1] and by_text.clean == by_id.clean
    with pytest.raises(UserError, match="one token each"):
        headlab.patch(tiny_gpt2, clean, corrupted, metric=headlab.logit_diff(" the cat", foil))


def test_patch_takes_prompts_as_text(tiny_gpt2):
    tok = tiny_gpt2.tokenizer
    clean, corrupted = "the cat sat on the mat", "the dog sat on the mat"
    assert len(tok(clean)["input_ids"]) == len(tok(corrupted)["input_ids"])
    ids = torch.tensor([tok(clean)["input_ids"]]), torch.tensor([tok(corrupted)["input_ids"]])
    metric = headlab.logit_diff(" the", " and")
    got = headlab.patch(tiny_gpt2, [clean], [corrupted], metric=metric, heads={1: [2]}, n_boot=5)
    want = headlab.patch(tiny_gpt2, *ids, metric=metric, heads={1: [2]}, n_boot=5)
    assert got.denoise[1][2] == want.denoise[1][2]
    with pytest.raises(UserError, match="same number of tokens"):
        headlab.patch(tiny_gpt2, [clean], ["a much longer corrupted prompt than the clean one"],
                      metric=metric)


def test_capture_stack_is_one_tensor_layers_first(tiny_gpt2):
    ids = _ids(tiny_gpt2)
    with torch.no_grad(), headlab.capture(tiny_gpt2, ["pattern", "z"]) as cap:
        tiny_gpt2(ids)
    patterns = cap.stack("pattern")
    assert isinstance(patterns, torch.Tensor) and patterns.shape == (3, 2, 4, 12, 12)
    torch.testing.assert_close(patterns[1], cap["blocks.1.attn.pattern"], rtol=0, atol=0)
    assert cap.stack("z").shape[:2] == (3, 2)


def test_capture_stack_of_a_pruned_model_marks_missing_heads_nan(tiny_gpt2):
    tiny_gpt2.prune_heads({0: [0, 1], 2: [3]})
    ids = _ids(tiny_gpt2)
    with torch.no_grad(), headlab.capture(tiny_gpt2, "pattern") as cap:
        tiny_gpt2(ids)
    patterns = cap.stack("pattern")  # (L, B, H, S, T), every original head
    assert patterns.shape == (3, 2, 4, 12, 12)
    assert patterns[0, :, :2].isnan().all() and not patterns[0, :, 2:].isnan().any()
    assert patterns[2, :, 3].isnan().all() and not patterns[1].isnan().any()
    torch.testing.assert_close(patterns[2, :, :3], cap["blocks.2.attn.pattern"], rtol=0, atol=0)
    with pytest.raises(KeyError, match="no 'z' tensors"):
        cap.stack("z")
