"""Tests for headlab.evaluate and headlab.objectives: quality metrics per kind of model.

References: every metric recomputed here with plain torch from the model's own logits
(perplexity, masked-LM perplexity, accuracy, cross-entropy). Invariants: the masking
is a function of the seed alone and touches only real, non-special tokens; an
unpruned encoder has fidelity 1 with itself.

Shape notation: N blocks, B batch, S sequence length, V vocabulary, C classes.
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from _curvature import gauss_newton_by_hand
from _gates import gate_leaves
from torch.testing import assert_close

import headlab
from headlab.data.blocks import Blocks
from headlab.data.texts import TextData, load_texts
from headlab.evaluate.quality import evaluate
from headlab.objectives import make_blocks, mask_tokens, objective_for, prepare

# float64 sums of float32 log-probabilities: the metric is exp of a mean of ~1e3 terms
METRIC = {"rtol": 1e-6, "atol": 1e-6}
WORDS = ["the", "a", "cat", "dog", "bird", "sat", "ran", "flew", "on", "over", "under", "mat",
         "hill", "tree", "big", "small", "red", "blue", "and", "then", "it", "was", "very"]
HAS_BERT = importlib.util.find_spec("headlab.models.bert") is not None
needs_bert = pytest.mark.skipif(not HAS_BERT, reason="headlab.models.bert does not exist yet")


def _sentences(n: int, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(4, 12, (1,), generator=gen))
        idx = torch.randint(0, len(WORDS), (k,), generator=gen).tolist()
        out.append(" ".join(WORDS[i] for i in idx) + ".")
    return out


@pytest.fixture(scope="module")
def wordpiece_dir(tmp_path_factory):
    """A WordPiece tokenizer built from a small vocab.txt, saved with save_pretrained."""
    path = tmp_path_factory.mktemp("wordpiece")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s", "."]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizer(vocab=str(path / "vocab.txt"))
    assert len(tok) == len(vocab)
    tok.save_pretrained(path)
    return path


def _bert_dir(tmp_path_factory, wordpiece_dir, cls, name: str, **kw):
    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(wordpiece_dir)
    cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=64, **kw)
    path = tmp_path_factory.mktemp(name)
    cls(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory, wordpiece_dir):
    return _bert_dir(tmp_path_factory, wordpiece_dir, transformers.BertForMaskedLM, "mlm")


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, wordpiece_dir):
    return _bert_dir(tmp_path_factory, wordpiece_dir,
                     transformers.BertForSequenceClassification, "clf", num_labels=3)


def test_bert_family_exists():
    """The masked-LM and classifier tests below need headlab.models.bert."""
    assert HAS_BERT, "headlab.models.bert is missing: the masked-LM/classifier tests skip"


# ---------------------------------------------------------------------- causal LM
def _hand_nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum and count of next-token NLL over pairs of real tokens, in float64."""
    logp = logits[:, :-1].double().log_softmax(-1)  # (B, S-1, V)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]  # (B, S-1)
    valid = (mask[:, 1:] * mask[:, :-1]).bool()
    return nll[valid].sum(), valid.sum()


def test_perplexity_is_exp_of_the_mean_token_nll(tiny_gpt2):
    blocks = make_blocks(load_texts(), tiny_gpt2.tokenizer, kind="causal-lm", seq_len=32,
                         max_tokens=32 * 7)
    ids, mask = blocks.input_ids, blocks.attention_mask.clone()
    mask[3, 20:] = 0  # a padded row: its tail must not count
    blocks = Blocks(ids, mask)
    with torch.no_grad():
        total, count = _hand_nll(tiny_gpt2(ids, attention_mask=mask).logits, ids, mask)
    q = evaluate(tiny_gpt2, blocks, batch_size=3)  # batches of 3, 3, 1
    expected = total / count
    assert q.metric == "perplexity" and q.higher_is_better is False
    assert_close(torch.tensor(q.loss, dtype=torch.float64), expected, **METRIC)
    assert_close(torch.tensor(q.value, dtype=torch.float64), expected.exp(), **METRIC)
    assert q.n_tokens == int(mask.sum()) == 7 * 32 - 12
    # a random 512-token model is close to uniform: perplexity near the vocabulary size
    assert 200 < q.value < 1500


def test_batch_size_does_not_change_the_metric(tiny_gpt2):
    blocks = make_blocks(load_texts(), tiny_gpt2.tokenizer, kind="causal-lm", seq_len=16,
                         max_tokens=16 * 6)
    a, b = evaluate(tiny_gpt2, blocks, batch_size=1), evaluate(tiny_gpt2, blocks, batch_size=6)
    assert_close(a.value, b.value, rtol=1e-6, atol=0)


def test_per_example_losses_are_per_row_means(tiny_gpt2):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny_gpt2.config.vocab_size, (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    with torch.no_grad():
        batch = {"input_ids": ids, "attention_mask": mask}
        loss, count, _ = objective_for(tiny_gpt2).example_losses(tiny_gpt2, batch)
        logits = tiny_gpt2(ids, attention_mask=mask).logits
    for row in range(3):
        total, n = _hand_nll(logits[row : row + 1], ids[row : row + 1], mask[row : row + 1])
        assert_close(loss[row].double(), total / n, rtol=1e-6, atol=1e-6)
        assert int(count[row]) == int(n)
    assert count.tolist() == [9, 9, 5]


def test_broken_weights_raise_instead_of_a_nan_metric(tiny_gpt2):
    blocks = make_blocks(load_texts(), tiny_gpt2.tokenizer, kind="causal-lm", seq_len=16,
                         max_tokens=32)
    with torch.no_grad():
        tiny_gpt2.blocks[1].mlp.fc.weight[0, 0] = math.nan
    with pytest.raises(FloatingPointError, match="not finite.*--dtype float32"):
        evaluate(tiny_gpt2, blocks)


# ---------------------------------------------------------------------- masked LM
@needs_bert
def test_masking_is_fixed_by_the_seed(mlm_dir):
    model = headlab.load(mlm_dir)
    tok = model.tokenizer
    blocks = make_blocks(TextData(_sentences(60)), tok, kind="masked-lm", seq_len=24)
    assert torch.all(blocks.input_ids[:, 0] == tok.cls_token_id)
    assert torch.all(blocks.input_ids[:, -1] == tok.sep_token_id)

    torch.manual_seed(123)  # the global generator must not matter
    a = prepare(model, blocks, seed=5)
    torch.manual_seed(456)
    b = prepare(model, blocks, seed=5)
    c = prepare(model, blocks, seed=6)
    assert_close(a.labels, b.labels, rtol=0, atol=0)
    assert_close(a.input_ids, b.input_ids, rtol=0, atol=0)
    assert not torch.equal(a.labels, c.labels)

    chosen = a.labels != -100
    # labels hold the original ids, inputs hold [MASK] there and the original elsewhere
    assert_close(a.labels[chosen], blocks.input_ids[chosen], rtol=0, atol=0)
    assert torch.all(a.input_ids[chosen] == tok.mask_token_id)
    assert_close(a.input_ids[~chosen], blocks.input_ids[~chosen], rtol=0, atol=0)
    # never a special token; at least one per row; about 15 % of the candidates
    special = torch.isin(blocks.input_ids, torch.tensor([tok.cls_token_id, tok.sep_token_id]))
    assert not (chosen & special).any()
    assert chosen.any(1).all()
    rate = float(chosen.sum()) / float((~special).sum())
    assert 0.08 < rate < 0.25
    # prepared blocks are left as they are
    assert prepare(model, a) is a


@needs_bert
def test_masking_skips_padding(wordpiece_dir):
    tok = transformers.AutoTokenizer.from_pretrained(wordpiece_dir)
    ids = torch.tensor([[2, 5, 6, 7, 3, 0, 0], [2, 5, 3, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    out = mask_tokens(Blocks(ids, mask), tok, seed=0, rate=1.0)
    expected = torch.where(mask.bool() & (ids > 4), ids, torch.full_like(ids, -100))
    assert_close(out.labels, expected, rtol=0, atol=0)


@needs_bert
def test_mlm_perplexity_is_exp_of_the_masked_token_nll(mlm_dir):
    model = headlab.load(mlm_dir)
    blocks = make_blocks(TextData(_sentences(60)), model.tokenizer, kind="masked-lm",
                         seq_len=24)
    blocks = prepare(model, blocks, seed=0)
    with torch.no_grad():
        logits = model(blocks.input_ids, attention_mask=blocks.attention_mask).logits
    chosen = blocks.labels != -100
    logp = logits.double().log_softmax(-1)[chosen]  # (M, V)
    expected = -logp.gather(-1, blocks.labels[chosen][:, None]).mean()
    q = evaluate(model, blocks, batch_size=4)
    assert q.metric == "mlm-perplexity"
    assert_close(torch.tensor(q.loss, dtype=torch.float64), expected, **METRIC)
    assert_close(torch.tensor(q.value, dtype=torch.float64), expected.exp(), **METRIC)


# ---------------------------------------------------------------------- classifier
@needs_bert
def test_classifier_accuracy_on_a_hand_built_case(classifier_dir):
    model = headlab.load(classifier_dir)
    assert model.kind == "classifier"
    data = TextData(_sentences(10, seed=1))
    blocks = make_blocks(data, model.tokenizer, kind="classifier", seq_len=16)
    with torch.no_grad():
        logits = model(blocks.input_ids, attention_mask=blocks.attention_mask).logits
    predicted = logits.argmax(-1)  # (N,)
    # the first 7 labels agree with the model, the last 3 do not: accuracy is 0.7
    labels = predicted.clone()
    labels[7:] = (predicted[7:] + 1) % 3
    blocks = Blocks(blocks.input_ids, blocks.attention_mask, labels)
    q = evaluate(model, prepare(model, blocks), batch_size=4)
    assert q.metric == "accuracy" and q.higher_is_better is True
    assert q.value == pytest.approx(0.7, abs=1e-12)
    expected_loss = F.cross_entropy(logits.double(), labels)
    assert_close(torch.tensor(q.loss, dtype=torch.float64), expected_loss, **METRIC)


@needs_bert
def test_classifier_without_labels_is_refused(classifier_dir):
    model = headlab.load(classifier_dir)
    blocks = make_blocks(TextData(_sentences(4)), model.tokenizer, kind="classifier",
                         seq_len=16)
    with pytest.raises(ValueError, match="no label column.*--label-column"):
        prepare(model, blocks)


@needs_bert
def test_embedding_fidelity_is_one_for_the_unpruned_model(tmp_path_factory, wordpiece_dir):
    model = headlab.load(_bert_dir(tmp_path_factory, wordpiece_dir, transformers.BertModel,
                                   "encoder"))
    assert model.kind == "embedding"
    blocks = make_blocks(TextData(_sentences(6)), model.tokenizer, kind="embedding",
                         seq_len=16)
    with pytest.raises(ValueError, match="call prepare"):
        evaluate(model, blocks)
    blocks = prepare(model, blocks)
    # the scoring direction is a unit vector orthogonal to each reference
    ref, direction = blocks.extras["reference"], blocks.extras["direction"]
    assert_close(direction.norm(dim=-1), torch.ones(6), rtol=1e-6, atol=1e-6)
    assert_close((F.normalize(ref, dim=-1) * direction).sum(-1), torch.zeros(6),
                 rtol=0, atol=1e-6)
    q = evaluate(model, blocks)
    assert q.metric == "fidelity"
    assert_close(q.value, 1.0, rtol=0, atol=1e-6)
    model.mask_heads({0: [0, 1, 2], 1: [1, 3]})
    assert evaluate(model, blocks).value < 1 - 1e-4


# ---------------------------------------------------------------------- curvature probes
def _probe_curvature(model, batch: dict, n: int) -> torch.Tensor:
    """Mean over ``n`` probes of (d probe / d gate)^2 per example: (B, L, H)."""
    with gate_leaves(model, len(batch["input_ids"])) as gates:  # (B, H) each
        objective = objective_for(model)
        out = objective.forward(model, batch)
        total = torch.zeros(len(batch["input_ids"]), len(gates), gates[0].shape[1],
                            dtype=torch.float64)
        pairs = list(objective.curvature_probes(model, out, batch, n,
                                                torch.Generator().manual_seed(0)))
        assert len(pairs) == n
        for j, (output, cotangent) in enumerate(pairs):
            assert cotangent.shape == output.shape
            grads = torch.autograd.grad(output, gates, cotangent, retain_graph=j < n - 1)
            total += torch.stack(grads, 1).double().pow(2)
    return total / n


def _kind_model(kind: str, tiny_gpt2, tmp_path_factory, wordpiece_dir, mlm_dir,
                classifier_dir):
    if kind == "causal-lm":
        return tiny_gpt2, make_blocks(load_texts(), tiny_gpt2.tokenizer, kind=kind,
                                      seq_len=12, max_tokens=36)
    if kind == "embedding":
        path = _bert_dir(tmp_path_factory, wordpiece_dir, transformers.BertModel, "enc")
    else:
        path = mlm_dir if kind == "masked-lm" else classifier_dir
    model = headlab.load(path)
    blocks = make_blocks(TextData(_sentences(3, seed=2)), model.tokenizer, kind=kind,
                         seq_len=16)
    if kind == "classifier":
        blocks = Blocks(blocks.input_ids, blocks.attention_mask, torch.tensor([0, 1, 2]))
    return model, prepare(model, blocks)


@needs_bert
@pytest.mark.parametrize("kind", ["causal-lm", "masked-lm", "classifier", "embedding"])
def test_curvature_probes_estimate_the_gauss_newton_curvature(
        kind, tiny_gpt2, tmp_path_factory, wordpiece_dir, mlm_dir, classifier_dir):
    """Squared probe gradients average to the curvature computed by hand (the sampling
    error of 800 probes is about 5%; a missing 1/sqrt(T) would be off by T, a probe
    that ignored the model's own distribution by far more)."""
    model, blocks = _kind_model(kind, tiny_gpt2, tmp_path_factory, wordpiece_dir,
                                mlm_dir, classifier_dir)
    assert model.kind == kind
    batch = next(iter(blocks.batches(len(blocks))))
    exact = gauss_newton_by_hand(model, batch)
    estimate = _probe_curvature(model, batch, n=800)
    assert exact.min() > 0
    assert_close(estimate.mean(0), exact.mean(0), rtol=0.2, atol=0)
    assert_close(estimate.sum(), exact.sum(), rtol=0.06, atol=0)


@needs_bert
def test_fidelity_curvature_is_the_second_derivative_of_one_minus_cos(
        tmp_path_factory, wordpiece_dir):
    """At the unpruned encoder (u = ref) the Gauss-Newton term is exact: it equals the
    second difference of the real 1 - cos loss, and the first derivative is zero."""
    model = headlab.load(_bert_dir(tmp_path_factory, wordpiece_dir, transformers.BertModel,
                                   "enc2"))
    blocks = make_blocks(TextData(_sentences(3, seed=3)), model.tokenizer, kind="embedding",
                         seq_len=16)
    batch = next(iter(blocks.batches(3)))
    exact = gauss_newton_by_hand(model, batch)  # (B, L, H)
    double = copy.deepcopy(model).double()
    with torch.no_grad():
        def loss() -> torch.Tensor:  # (B,) 1 - cos to the float64 reference
            emb = double(batch["input_ids"], attention_mask=batch["attention_mask"]).embeddings
            return 1 - F.cosine_similarity(emb, ref, dim=-1)

        ref = double(batch["input_ids"], attention_mask=batch["attention_mask"]).embeddings
        eps = 1e-3
        for layer, attn in enumerate(double.attentions):
            for h in range(attn.n_heads):
                moved = []
                for sign in (1, -1):
                    g = torch.ones(attn.n_heads, dtype=torch.float64)
                    g[h] += sign * eps
                    attn.gate_override = g
                    moved.append(loss())
                attn.gate_override = None
                assert_close((moved[0] - moved[1]) / (2 * eps), torch.zeros(3, dtype=torch.float64),
                             rtol=0, atol=1e-9)
                second = (moved[0] + moved[1] - 2 * loss()) / eps**2
                assert_close(second, exact[:, layer, h], rtol=1e-4, atol=1e-10)
