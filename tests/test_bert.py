"""Tests for headlab.models.bert: the rebuilt BERT computes what transformers' BERT does.

References: random-weight BertModel / BertForMaskedLM / BertForSequenceClassification
checkpoints written here with ``save_pretrained`` and compared with transformers
(eager and SDPA), per-layer attention weights included; the real bundled MiniLM
against transformers and sentence-transformers. Equivalences: save -> load, pruned ==
gated. Errors: a missing tensor, unsupported configs, a cache.

Shape notation: B batch, S sequence length, H heads, E model dim, V vocabulary, C classes.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from headlab.models import load
from headlab.models.bert import Bert, BertConfig, from_hf
from headlab.models.loading import bundled_path

F32 = torch.float32
VOCAB = 97
# name -> (hidden, layers, heads, intermediate)
SIZES = {"small": (32, 2, 4, 64), "wide": (48, 3, 6, 96)}
HF_CLASSES = {
    "encoder": transformers.BertModel,
    "mlm": transformers.BertForMaskedLM,
    "classifier": transformers.BertForSequenceClassification,
}
KINDS = {"encoder": "embedding", "mlm": "masked-lm", "classifier": "classifier"}


def _hf_config(size: str) -> transformers.BertConfig:
    hidden, layers, heads, inter = SIZES[size]
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, intermediate_size=inter, max_position_embeddings=24,
        num_labels=3, hidden_act="gelu",
    )


def _write_checkpoint(tmp_path, head: str, size: str = "small", seed: int = 0):
    """Save a random HF model whose every parameter (biases, LayerNorms, MLM bias
    included) is drawn with std 0.3, so attention is far from uniform."""
    torch.manual_seed(seed)
    hf = HF_CLASSES[head](_hf_config(size))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    directory = tmp_path / f"{head}-{size}"
    hf.save_pretrained(directory)
    return directory


def _batch(seed: int = 1):
    """ids (B, S), attention mask with right padding, left padding and a full row,
    and random token types."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    mask[2, :4] = 0  # left padding: position 0 is a pad token
    mask[3, 1:] = 0  # a single real token
    types = torch.randint(0, 2, (4, 12), generator=g)
    return ids, mask, types


def _hf(directory, head: str, impl: str):
    return HF_CLASSES[head].from_pretrained(directory, attn_implementation=impl).eval()


def _hf_hidden(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.hidden_states[-1]


# ---------------------------------------------------------------------- references
@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("head", sorted(HF_CLASSES))
def test_matches_transformers(tmp_path, head, impl, size):
    directory = _write_checkpoint(tmp_path, head, size)
    model = load(directory, tokenizer=False)
    hf = _hf(directory, head, impl)
    assert model.kind == KINDS[head]
    ids, mask, types = _batch()
    valid = mask.bool()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types,
                 output_hidden_states=True)
        out = model(ids, mask, token_type_ids=types)

    assert_close(out.last_hidden_state[valid], _hf_hidden(ref)[valid], atol=1e-4, rtol=0)
    if head == "mlm":
        assert out.logits.shape == (4, 12, VOCAB)
        assert_close(out.logits[valid], ref.logits[valid], atol=1e-4, rtol=0)
    elif head == "classifier":
        assert out.logits.shape == (4, 3)
        assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)  # every row
    else:
        # mean of the reference hidden states over real tokens
        m = mask[..., None].to(F32)
        expected = (ref.last_hidden_state * m).sum(1) / m.sum(1)
        assert_close(out.embeddings, expected, atol=1e-4, rtol=0)
        assert out.logits is None


def test_defaults_match_transformers(tmp_path):
    """No attention mask and no token types: both sides fill in the same defaults."""
    directory = _write_checkpoint(tmp_path, "mlm")
    model = load(directory, tokenizer=False)
    hf = _hf(directory, "mlm", "sdpa")
    ids, _, _ = _batch()
    with torch.no_grad():
        assert_close(model(ids).logits, hf(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_pretraining_checkpoint_with_legacy_names_loads_as_masked_lm(tmp_path):
    """As original BERT releases ship: BertForPreTraining (pooler, NSP head), LayerNorm
    gamma/beta, a stored decoder copy; the MLM logits must equal transformers'."""
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(_hf_config("small"))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    state = load_file(str(file))
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
             "LayerNorm.beta"): v for k, v in state.items()}
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    save_file({k: v.clone() for k, v in state.items()}, str(file), metadata={"format": "pt"})

    model = load(tmp_path, tokenizer=False)
    assert model.kind == "masked-lm"
    ids, mask, types = _batch()
    valid = mask.bool()
    with torch.no_grad():
        ref = hf.eval()(input_ids=ids, attention_mask=mask, token_type_ids=types)
        out = model(ids, mask, token_type_ids=types)
    assert_close(out.logits[valid], ref.prediction_logits[valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("head", ["encoder", "classifier"])
def test_attention_weights_match_transformers(tmp_path, head):
    directory = _write_checkpoint(tmp_path, head, "wide")
    model = load(directory, tokenizer=False)
    hf = _hf(directory, head, "eager")
    ids, mask, types = _batch()
    valid = mask.bool()

    captured: dict[int, torch.Tensor] = {}
    handles = [
        block.attn.pattern.register_forward_hook(
            lambda _m, _i, out, i=i: captured.__setitem__(i, out.detach())
        )
        for i, block in enumerate(model.blocks)
    ]
    try:
        with torch.no_grad():
            model(ids, mask, token_type_ids=types)
            ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types,
                     output_attentions=True)
    finally:
        for h in handles:
            h.remove()

    assert sorted(captured) == list(range(model.n_layers))
    for i, weights in captured.items():
        assert weights.shape == (4, model.heads_per_layer[i], 12, 12)  # (B, H, S, T)
        # (B, H, S, T) -> (B, S, H, T): index the real query rows
        ours, theirs = weights.transpose(1, 2)[valid], ref.attentions[i].transpose(1, 2)[valid]
        assert_close(ours, theirs, atol=1e-5, rtol=0)
        assert_close(ours.sum(-1), torch.ones_like(ours[..., 0]), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- save, prune
@pytest.mark.parametrize("head", sorted(HF_CLASSES))
def test_save_load_prune(tmp_path, head):
    directory = _write_checkpoint(tmp_path, head)
    model = load(directory, tokenizer=False)
    ids, mask, types = _batch()

    def run(m):
        with torch.no_grad():
            out = m(ids, mask, token_type_ids=types)
        return out.logits if out.logits is not None else out.embeddings

    before = run(model)
    reloaded = load(model.save(tmp_path / "saved"), tokenizer=False)
    assert reloaded.kind == model.kind
    assert_close(run(reloaded), before, atol=0, rtol=0)

    n_heads = model.n_original_heads
    plan = {0: [1, 3], 1: list(range(n_heads))}  # layer 1 loses every head
    gated = copy.deepcopy(model)
    gated.mask_heads(plan)
    model.prune_heads(plan)
    assert model.heads_per_layer == [n_heads - 2, 0]
    assert model.head_ids()[0] == [h for h in range(n_heads) if h not in (1, 3)]
    pruned = run(model)
    assert_close(pruned, run(gated), atol=1e-5, rtol=0)
    assert not torch.allclose(pruned, before, atol=1e-4)

    reloaded = load(model.save(tmp_path / "pruned"), tokenizer=False)
    assert reloaded.heads_per_layer == model.heads_per_layer
    assert reloaded.head_ids() == model.head_ids()
    assert_close(run(reloaded), pruned, atol=0, rtol=0)


def test_mlm_decoder_is_tied_and_saved_once(tmp_path):
    directory = _write_checkpoint(tmp_path, "mlm")
    model = load(directory, tokenizer=False)
    saved = load_file(str(model.save(tmp_path / "saved") / "model.safetensors"))
    assert "mlm.bias" in saved and not any("decoder" in k for k in saved)
    ids, mask, _ = _batch()
    with torch.no_grad():
        before = model(ids, mask).logits
        model.wte.weight[5].add_(1.0)  # moves token 5's logit (and each input 5)
        after = model(ids, mask).logits
    changed = (after - before).abs().amax(dim=(0, 1)) > 1e-6  # (V,)
    assert changed[5]


# ---------------------------------------------------------------------- sentence-transformers
def test_sentence_transformers_dir_pools_and_normalises(tmp_path):
    """A BertModel directory with a Transformer -> Pooling -> Normalize pipeline."""
    directory = _write_checkpoint(tmp_path, "encoder")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True})
    )
    model = load(directory, tokenizer=False)
    assert (model.kind, model.pooling, model.normalize) == ("embedding", "mean", True)
    ids, mask, types = _batch()
    hf = _hf(directory, "encoder", "sdpa")
    with torch.no_grad():
        emb = model(ids, mask, token_type_ids=types).embeddings
        h = hf(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    m = mask[..., None].to(F32)
    expected = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    assert_close(emb, expected, atol=1e-4, rtol=0)
    assert_close(emb.norm(dim=-1), torch.ones(4), atol=1e-5, rtol=0)

    reloaded = load(model.save(tmp_path / "saved"), tokenizer=False)
    assert (reloaded.pooling, reloaded.normalize) == ("mean", True)
    with torch.no_grad():
        assert_close(reloaded(ids, mask, token_type_ids=types).embeddings, emb, atol=0, rtol=0)

    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    assert load(directory, tokenizer=False).pooling == "cls"
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode": "weightedmean"})
    )
    with pytest.raises(ValueError, match="weightedmean"):
        load(directory, tokenizer=False)


# ---------------------------------------------------------------------- errors
def test_missing_tensor_is_named(tmp_path):
    directory = _write_checkpoint(tmp_path, "classifier")
    file = directory / "model.safetensors"
    state = load_file(str(file))
    gone = "bert.encoder.layer.1.attention.self.key.weight"
    del state[gone]
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
        load(directory, tokenizer=False)


def test_unexpected_tensor_is_named(tmp_path):
    directory = _write_checkpoint(tmp_path, "encoder")
    file = directory / "model.safetensors"
    state = load_file(str(file))
    state["encoder.layer.0.attention.self.extra"] = torch.zeros(3)
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected.*attention\.self\.extra"):
        load(directory, tokenizer=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"position_embedding_type": "relative_key"}, "absolute"),
        ({"is_decoder": True}, "decoder"),
        ({"hidden_act": "mish"}, "mish"),
        ({"architectures": ["BertForQuestionAnswering"]}, "BertForQuestionAnswering"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    hf_config = {**_hf_config("small").to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        from_hf(hf_config, {})


def test_forward_refuses_cache_and_long_inputs():
    model = Bert(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=32,
                            max_position_embeddings=8)).eval()
    assert model.max_positions == 8
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="cache"):
        model(ids, cache=model.new_cache())
    with pytest.raises(ValueError, match="8 positions"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ---------------------------------------------------------------------- real model
SENTENCES = [
    "The cat sat on the mat.",
    "Attention heads can be pruned without losing much quality.",
    "Hi",
    "A considerably longer sentence, so that the batch needs padding for the shorter ones.",
]


@pytest.fixture(scope="module")
def minilm():
    return load("minilm-l6")


@pytest.mark.real
def test_minilm_matches_transformers(minilm):
    folder = bundled_path("minilm-l6")
    hf = transformers.AutoModel.from_pretrained(str(folder)).eval()
    batch = minilm.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    valid = batch["attention_mask"].bool()
    assert minilm.kind == "embedding" and minilm.normalize
    with torch.no_grad():
        out = minilm(batch["input_ids"], batch["attention_mask"],
                     token_type_ids=batch["token_type_ids"])
        ref = hf(**batch).last_hidden_state
    assert_close(out.last_hidden_state[valid], ref[valid], atol=1e-4, rtol=0)


@pytest.mark.real
def test_minilm_matches_sentence_transformers(minilm, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(bundled_path("minilm-l6")), device="cpu")
    expected = st.encode(SENTENCES, convert_to_tensor=True)
    batch = minilm.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        emb = minilm(batch["input_ids"], batch["attention_mask"],
                     token_type_ids=batch["token_type_ids"]).embeddings
    assert emb.shape == (len(SENTENCES), 384)
    assert_close(emb, expected.to(emb.dtype).cpu(), atol=1e-4, rtol=0)
