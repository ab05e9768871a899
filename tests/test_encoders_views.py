"""The encoder families beside BERT through headlab's views and hooks: every hook name
with the shapes `headlab.attention.hooks` documents, bertviz's input built from the family's own
special tokens (sentence pairs split at the separator), the offline view, and a
sentence-transformers directory pooled as its pipeline says.

References: the patterns captured directly from the model; torch's own normalise and
the first-token hidden state for the sentence-transformers pipeline.
"""

from __future__ import annotations

import json

import pytest
import torch
from _encoders import (
    batch,
    bpe_tokenizer,
    load_hf,
    write_checkpoint,
    write_mlm_with_tokenizer,
)
from torch.testing import assert_close

from headlab.attention.hooks import capture
from headlab.models import load
from headlab.objectives import objective_for
from headlab.viz import attention_for_bertviz, attention_html

_SPECIALS = {
    "roberta": dict(cls="<s>", sep="</s>", pad="<pad>", mask="<mask>", unk="<unk>",
                    specials=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], double_sep=True),
    "modernbert": dict(cls="[CLS]", sep="[SEP]", pad="[PAD]", mask="[MASK]", unk="[UNK]",
                       specials=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]),
}


@pytest.fixture(scope="module", params=sorted(_SPECIALS))
def with_tokenizer(request, tmp_path_factory):
    spec = _SPECIALS[request.param]
    tok = bpe_tokenizer(**spec)
    directory = write_mlm_with_tokenizer(tmp_path_factory.mktemp(request.param), request.param,
                                         tok, max_position_embeddings=64)
    return load(directory), spec


def test_every_hook_has_the_documented_shape(tmp_path):
    for family in ("roberta", "distilbert", "modernbert"):
        model = load(write_checkpoint(tmp_path, family, "mlm"), tokenizer=False)
        ids, mask = batch(family)
        B, S = ids.shape
        H, D, E = model.n_original_heads, model.head_dim, 32
        with capture(model, ["q", "k", "v", "scores", "pattern", "z", "out", "resid_pre",
                             "resid_mid", "resid_post"]) as cap:
            model(ids, mask)
        assert len(cap) == 10 * model.n_layers
        for i in range(model.n_layers):
            for name, shape in (("q", (B, S, H, D)), ("k", (B, S, H, D)), ("v", (B, S, H, D)),
                                ("scores", (B, H, S, S)), ("pattern", (B, H, S, S)),
                                ("z", (B, S, H, D)), ("out", (B, S, E))):
                assert cap[f"blocks.{i}.attn.{name}"].shape == shape, (family, i, name)
            assert cap[f"blocks.{i}.resid_post"].shape == (B, S, E)


def test_bertviz_input_uses_the_family_special_tokens(with_tokenizer):
    model, spec = with_tokenizer
    attention, tokens, b_start = attention_for_bertviz(model, "The cat sat.", "It was red.")
    assert (tokens[0], tokens[-1]) == (spec["cls"], spec["sep"])
    assert tokens[b_start - 1] == spec["sep"] and tokens[b_start] != spec["sep"]
    assert tokens[:b_start].count(spec["sep"]) == (2 if spec.get("double_sep") else 1)
    tok = model.tokenizer
    enc = tok("The cat sat.", "It was red.", return_tensors="pt")
    with capture(model, "pattern") as cap, torch.no_grad():
        model(enc["input_ids"], enc["attention_mask"])
    assert len(attention) == model.n_layers
    for layer, pattern in enumerate(cap.per_layer("pattern")):
        assert_close(attention[layer], pattern, atol=0, rtol=0)
    page = attention_html(model, "The cat sat on the mat.").page
    # the page's data holds the tokens as JSON with "<" and ">" escaped
    assert json.dumps(spec["sep"]).replace("<", "\\u003c").replace(">", "\\u003e") in page


def test_sentence_transformers_roberta_pools_as_its_pipeline(tmp_path):
    """A RobertaModel directory with Transformer -> Pooling (cls) -> Normalize."""
    directory = write_checkpoint(tmp_path, "roberta", "encoder")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    model = load(directory, tokenizer=False)
    assert (model.kind, model.pooling, model.normalize) == ("embedding", "cls", True)
    assert objective_for(model).kind == "embedding"
    ids, mask = batch("roberta", padded=False)
    with torch.no_grad():
        emb = model(ids, mask).embeddings
        h = load_hf(directory, "roberta", "encoder")(input_ids=ids, attention_mask=mask)
    expected = torch.nn.functional.normalize(h.last_hidden_state[:, 0], dim=-1)
    assert_close(emb, expected, atol=1e-4, rtol=0)
