"""headlab.viz: bertviz takes headlab's attention as is, the offline view is self-contained
and escapes what it shows, inspect_text and rollout_for give sane numbers.

A tiny random BERT (2 layers x 4 heads) is saved by transformers with a WordPiece
tokenizer built from a vocab.txt in a temporary folder; its pre-tokenizer splits on
whitespace only, so a token can hold markup (the hostile token below).
"""

from __future__ import annotations

import html
import json
import math
import re

import pytest
import torch

import headlab
from headlab import viz
from headlab.report import decode_attention

HOSTILE = "</script><svg/onload=alert(1)>"
WORDS = ["the", "cat", "sat", "on", "mat", ".", "it", "was", "happy", ",", "a", "dog", HOSTILE]
TEXT = "the cat sat on the mat ."
TEXT_B = "it was happy ."


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    """A random BertModel (E=32, 2 layers x 4 heads) and its WordPiece tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    path = tmp_path_factory.mktemp("tiny-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tok = Tokenizer(models.WordPiece.from_file(str(path / "vocab.txt"), unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
        unk_token="[UNK]", mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    torch.manual_seed(0)
    # a wide initialisation makes the random attention far from uniform
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=64, initializer_range=0.5)
    transformers.BertModel(cfg).eval().save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture()
def tiny_bert(tiny_bert_dir):
    return headlab.load(tiny_bert_dir)


def _captured(model, text, text_b=None):
    """The patterns straight from headlab.capture, independent of headlab.viz."""
    enc = model.tokenizer(text, text_b, return_tensors="pt")
    kwargs = {"token_type_ids": enc["token_type_ids"]} if text_b is not None else {}
    with torch.no_grad(), headlab.capture(model, "pattern") as cap:
        model(enc["input_ids"], attention_mask=enc["attention_mask"], **kwargs)
    return [p.float() for p in cap.per_layer("pattern")], cap


def _bertviz_params(view) -> dict:
    """The params JSON bertviz substitutes for PYTHON_PARAMS in its script."""
    match = re.search(r"const params = (\{.*?\}); // HACK", view.data, flags=re.S)
    assert match, "bertviz's returned HTML no longer holds 'const params = {...}; // HACK'"
    return json.loads(match.group(1))


def test_head_view_holds_the_captured_numbers(tiny_bert):
    view = viz.head_view(tiny_bert, TEXT, html_action="return")
    params = _bertviz_params(view)
    expected, _ = _captured(tiny_bert, TEXT)
    (data,) = params["attention"]  # a single text: one filter
    got = torch.tensor(data["attn"])  # (L, H, S, S)
    # bertviz serialises float32 -> float -> JSON without rounding
    torch.testing.assert_close(got, torch.cat(expected), atol=1e-6, rtol=0)
    tokens = ["[CLS]", *TEXT.split(), "[SEP]"]
    assert data["left_text"] == tokens and data["right_text"] == tokens
    # the view loads its libraries in the browser, from the CDN, not in Python
    assert "cdnjs.cloudflare.com" in view.data


def test_model_view_holds_the_captured_numbers(tiny_bert):
    view = viz.model_view(tiny_bert, TEXT, html_action="return", display_mode="light")
    params = _bertviz_params(view)
    expected, _ = _captured(tiny_bert, TEXT)
    torch.testing.assert_close(torch.tensor(params["attention"][0]["attn"]),
                               torch.cat(expected), atol=1e-6, rtol=0)
    assert params["total_heads"] == 4 and params["include_layers"] == [0, 1]


def test_sentence_pair_start_and_segments(tiny_bert):
    attention, tokens, start = viz.attention_for_bertviz(tiny_bert, TEXT, TEXT_B)
    assert tokens == ["[CLS]", *TEXT.split(), "[SEP]", *TEXT_B.split(), "[SEP]"]
    assert start == len(TEXT.split()) + 2 and tokens[start] == "it"
    expected, _ = _captured(tiny_bert, TEXT, TEXT_B)
    torch.testing.assert_close(torch.cat(attention), torch.cat(expected), atol=0, rtol=0)
    # token_type_ids reached the model: without them (all segment 0) the numbers differ
    single, _ = _captured(tiny_bert, f"{TEXT} [SEP] {TEXT_B}")
    assert not torch.allclose(torch.cat(single), torch.cat(expected), atol=1e-4)

    params = _bertviz_params(viz.head_view(tiny_bert, TEXT, TEXT_B, html_action="return"))
    names = [d["name"] for d in params["attention"]]
    assert names == ["All", "Sentence A -> Sentence A", "Sentence B -> Sentence B",
                     "Sentence A -> Sentence B", "Sentence B -> Sentence A"]
    a_to_b = params["attention"][3]
    assert a_to_b["left_text"] == tokens[:start] and a_to_b["right_text"] == tokens[start:]
    torch.testing.assert_close(torch.tensor(a_to_b["attn"]),
                               torch.cat(expected)[:, :, :start, start:], atol=1e-6, rtol=0)


def test_sentence_pair_refused_for_gpt2(tiny_gpt2):
    with pytest.raises(ValueError, match="sentence pairs need"):
        viz.attention_for_bertviz(tiny_gpt2, "The cat sat.", "It was happy.")


def test_gpt2_single_text(tiny_gpt2):
    attention, tokens, start = viz.attention_for_bertviz(tiny_gpt2, "The cat sat on the mat.")
    assert start is None and len(attention) == 3
    assert all(a.shape == (1, 4, len(tokens), len(tokens)) for a in attention)
    # causal: nothing above the diagonal
    assert all(float(a.triu(diagonal=1).abs().max()) == 0.0 for a in attention)


def test_pruned_heads_are_zero_padded_at_their_original_index(tiny_bert):
    full, _ = _captured(tiny_bert, TEXT)
    tiny_bert.prune_heads({0: [1, 3], 1: [0]})
    attention, tokens, _ = viz.attention_for_bertviz(tiny_bert, TEXT)
    s = len(tokens)
    assert [a.shape for a in attention] == [(1, 4, s, s)] * 2
    captured, cap = _captured(tiny_bert, TEXT)
    for layer, gone in ((0, [1, 3]), (1, [0])):
        kept = [h for h in range(4) if h not in gone]
        assert cap.head_ids[f"blocks.{layer}.attn.pattern"] == kept
        assert float(attention[layer][:, gone].abs().max()) == 0.0
        torch.testing.assert_close(attention[layer][:, kept], captured[layer],
                                   atol=0, rtol=0)
    # layer 0 sees the same input as before pruning: its kept heads are unchanged
    torch.testing.assert_close(attention[0][:, [0, 2]], full[0][:, [0, 2]],
                               atol=1e-5, rtol=1e-5)
    params = _bertviz_params(viz.head_view(tiny_bert, TEXT, html_action="return"))
    assert torch.tensor(params["attention"][0]["attn"]).shape == (2, 4, s, s)


_REMOTE = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.I)


def test_attention_html_is_self_contained_and_escapes(tiny_bert):
    text = f"the cat {HOSTILE} sat"
    view = viz.attention_html(tiny_bert, text)
    page = view.page
    assert page.startswith("<!DOCTYPE html>")
    assert not _REMOTE.search(page), _REMOTE.search(page)
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page)
    assert policy and "default-src 'none'" in html.unescape(policy.group(1))
    # the hostile token is in the data, escaped, and nowhere as markup
    assert "<svg/onload" not in page and "alert(1)>" not in page
    assert page.count("</script>") == 2  # the data block and the report's script
    data = json.loads(re.search(r'<script type="application/json" id="report-data">(.*?)'
                                r"</script>", page, flags=re.S).group(1))
    assert HOSTILE in data["sample"]["tokens"]
    # the embedded attention is the captured one, to the 8-bit code's half step
    expected, _ = _captured(tiny_bert, text)
    got = decode_attention({"encoding": "uint8-base64", **data["sample"]["attention"]})
    torch.testing.assert_close(torch.from_numpy(got), torch.cat(expected),
                               atol=1 / 510 + 1e-6, rtol=0)

    frame = view._repr_html_()
    assert frame.startswith("<iframe ") and 'sandbox="allow-scripts"' in frame
    srcdoc = re.fullmatch(r'<iframe srcdoc="([^"]*)" .*', frame, flags=re.S).group(1)
    assert "<" not in srcdoc and html.unescape(srcdoc) == page


def test_attention_html_marks_pruned_heads(tiny_bert):
    tiny_bert.prune_heads({1: [2]})
    page = viz.attention_html(tiny_bert, TEXT).page
    data = json.loads(re.search(r'id="report-data">(.*?)</script>', page, flags=re.S).group(1))
    assert data["pruned"] == [[False] * 4, [False, False, True, False]]
    assert data["sample"]["attention"]["shape"][:2] == [2, 4]


def _check_records(records, model, n_tokens):
    heads = [(r["layer"], r["head"]) for r in records]
    assert heads == [(layer, h) for layer, ids in enumerate(model.head_ids()) for h in ids]
    for r in records:
        assert 0.0 <= r["entropy"] <= math.log(n_tokens) + 1e-4
        assert 1.0 / n_tokens - 1e-4 <= r["confidence"] <= 1.0
        for name in ("first", "cls", "sep", "punct", "self", "prev", "next"):
            assert 0.0 <= r[name] <= 1.0, (name, r)
        assert r["first"] == r["cls"]  # the first token is [CLS]
        assert all(v == round(v, 4) for k, v in r.items() if isinstance(v, float))


def test_inspect_text_by_name_writes_the_view(tiny_bert_dir, tmp_path):
    out = tmp_path / "views" / "cat.html"
    records, written = viz.inspect_text(str(tiny_bert_dir), TEXT, html=out, device="cpu")
    model = headlab.load(tiny_bert_dir)
    assert len(records) == 2 * 4
    _check_records(records, model, n_tokens=len(TEXT.split()) + 2)
    assert written == out and out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert not list(out.parent.glob(".*.tmp"))  # the atomic write left nothing behind


def test_inspect_text_on_a_pruned_model(tiny_bert):
    tiny_bert.prune_heads({0: [0, 2]})
    records, written = viz.inspect_text(tiny_bert, TEXT)
    assert written is None and len(records) == 6
    _check_records(records, tiny_bert, n_tokens=len(TEXT.split()) + 2)


def test_rollout_for(tiny_bert, tiny_gpt2):
    tokens, flow = viz.rollout_for(tiny_bert, TEXT)
    assert len(tokens) == flow.shape[0] == flow.shape[1] == len(TEXT.split()) + 2
    torch.testing.assert_close(flow.sum(-1), torch.ones(len(tokens)), atol=1e-5, rtol=0)
    _, causal = viz.rollout_for(tiny_gpt2, "The cat sat on the mat.", head_fusion="max")
    assert float(causal.triu(diagonal=1).abs().max()) == 0.0


def test_text_must_be_given(tiny_bert):
    with pytest.raises(ValueError, match="non-empty string"):
        viz.attention_for_bertviz(tiny_bert, "")


@pytest.mark.real
def test_minilm_sentence_pair():
    model = headlab.load("minilm-l6")
    attention, tokens, start = viz.attention_for_bertviz(
        model, "The cat sat on the mat.", "It was happy.")
    assert tokens[start - 1] == "[SEP]" and tokens[start] == "it" and tokens[-1] == "[SEP]"
    assert start == tokens.index("[SEP]") + 1
    assert [a.shape for a in attention] == [(1, 12, len(tokens), len(tokens))] * 6
    records, _ = viz.inspect_text(model, "The cat sat on the mat.")
    assert len(records) == 72 and all(0 <= r["sep"] <= 1 for r in records)


def test_bertviz_return_fetches_nothing(tiny_bert, monkeypatch):
    """html_action="return" only builds HTML: no socket opens while it runs."""
    import socket

    def refuse(*_args, **_kwargs):
        raise AssertionError("bertviz tried to reach the network")

    viz.attention_for_bertviz(tiny_bert, TEXT)  # warm: imports and first forward
    import bertviz  # noqa: F401

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    view = viz.head_view(tiny_bert, TEXT, html_action="return")
    assert "<script src=\"https://cdnjs.cloudflare.com" in view.data
    assert viz.model_view(tiny_bert, TEXT, html_action="return").data


def test_attention_html_is_a_one_text_view_not_a_run_report(tiny_bert):
    page = viz.attention_html(tiny_bert, TEXT).page
    assert "headlab attention view" in page
    for run_only in ('id="summary"', 'id="importance"', 'id="curve"', 'id="files"',
                     "not measured", "results.json", ">importance<"):
        assert run_only not in page, run_only
    assert 'id="gallery"' in page and 'id="stats-table"' in page
