"""Direct logit attribution: the parts sum to the model's logit difference, and the
attention bias part is exactly W_O's bias read through the frozen norm."""

from __future__ import annotations

import math

import pytest
import torch

import headlab
from headlab.analysis.attribution import logit_attribution


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, bpe_tokenizer):
    """A random GQA Llama (2 layers, 4 query heads over 2 key/value heads, with biases)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(bpe_tokenizer), hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, attention_bias=True,
                                   bos_token_id=0, eos_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    bpe_tokenizer.save_pretrained(path)
    return headlab.load(path)


@pytest.mark.parametrize("which", ["tiny_gpt2", "tiny_llama"])
def test_parts_sum_to_the_logit_difference(which, request):
    model = request.getfixturevalue(which)
    model.prune_heads({1: [1]})  # a pruned head has no part and the sum still holds
    got = logit_attribution(model, "The cat sat on the mat and", target=" the", foil=" a")
    with torch.no_grad():
        ids = torch.tensor([model.tokenizer("The cat sat on the mat and")["input_ids"]])
        logits = model(ids).logits[0, -1].double()
    t, f = (model.tokenizer(s, add_special_tokens=False)["input_ids"][0] for s in (" the", " a"))
    want = float(logits[t] - logits[f])
    torch.testing.assert_close(got.logit_diff, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.total(), want, atol=1e-4, rtol=0)
    assert math.isnan(got.heads[1][1]) and not math.isnan(got.heads[1][0])
    assert abs(got.total() - sum(got.rest.values())) > 1e-3, "heads must carry some part"
    # W_O's bias through the frozen norm: read off the weights, not the captures
    norm = model.final_norm
    unembed = model.lm_head.weight.detach().double()
    for i, attn in enumerate(model.attentions):
        b = attn.o_proj.bias.detach().double()
        if isinstance(norm, torch.nn.LayerNorm):
            b = b - b.mean()
        read = norm.weight.detach().double() * b * got.norm_scale
        want_bias = float(read @ (unembed[t] - unembed[f]))
        torch.testing.assert_close(got.rest[f"attn_bias.{i}"], want_bias, atol=1e-5, rtol=0)
    assert "L0" in got._repr_html_() and len(got.top(3)) == 3


def test_multi_token_target_is_refused(tiny_gpt2):
    with pytest.raises(headlab.errors.UserError, match="one token each"):
        logit_attribution(tiny_gpt2, "a b", target=" extraordinarily", foil=" a")


def test_cli_inspect_prints_the_top_heads(tiny_gpt2_dir, tiny_gpt2):
    from typer.testing import CliRunner

    from headlab.cli import app

    text = "The cat sat on the mat and"
    result = CliRunner().invoke(app, ["inspect", str(tiny_gpt2_dir), text, "--target", " the",
                                      "--foil", " a", "--top", "3"])
    assert result.exit_code == 0, result.output
    best = logit_attribution(tiny_gpt2, text, target=" the", foil=" a").top(1)[0]
    assert f"L{best[0]}H{best[1]} {best[2]:+.4f}" in result.output
    half = CliRunner().invoke(app, ["inspect", str(tiny_gpt2_dir), text, "--target", " the"])
    assert half.exit_code == 2 and "together" in half.output


def test_masked_lm_parts_sum_to_the_logit_difference(tmp_path):
    """A random post-norm BERT MLM: the frozen norms and activation gate keep it exact."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=16, hidden_act="gelu")
    hf = transformers.BertForMaskedLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "mlm")
    model = headlab.load(tmp_path / "mlm")
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    got = logit_attribution(model, ids, target=5, foil=9, position=4)
    with torch.no_grad():
        ref = hf(ids).logits[0, 4].double()
    torch.testing.assert_close(got.logit_diff, float(ref[5] - ref[9]), atol=1e-4, rtol=0)
    torch.testing.assert_close(got.total(), got.logit_diff, atol=1e-4, rtol=0)
    assert abs(got.total() - sum(got.rest.values())) > 1e-3
    assert {"embeddings", "mlp.1", "attn_bias.0", "norm_bias", "unembed_bias"} <= set(got.rest)


# the shared decoder's families (tests/test_decoders.py's random checkpoints): parallel
# residual (neox), post-norms (gemma2, olmo2), final soft-capping (gemma2), partial rotary
DECODERS = ["qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "neox", "neox-sequential",
            "olmo2"]


@pytest.mark.parametrize("case", DECODERS)
def test_decoder_families_parts_sum_to_the_logit_difference(case, tmp_path):
    """Every head's part, carried through its block's post-norm where it has one, and
    the rest sum to the logit difference before final soft-capping; the model's own
    output difference, after the cap, is kept beside it."""
    from tests.test_decoders import _checkpoint

    model = headlab.load(_checkpoint(tmp_path, case), tokenizer=False)
    model.prune_heads({1: [1]})
    ids = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(2))
    got = logit_attribution(model, ids, target=5, foil=9)
    with torch.no_grad():
        out = model(ids)
        raw = model.lm_head(out.last_hidden_state)[0, -1].double()  # before any cap
        capped = out.logits[0, -1].double()
    torch.testing.assert_close(got.logit_diff, float(raw[5] - raw[9]), atol=1e-5, rtol=0)
    torch.testing.assert_close(got.total(), got.logit_diff, atol=1e-4, rtol=0)
    output = got.extra["output_logit_diff"]
    torch.testing.assert_close(output, float(capped[5] - capped[9]), atol=1e-5, rtol=0)
    if case == "gemma2":  # final_logit_softcapping=3: the capped difference is another
        assert abs(got.logit_diff - output) > 1e-3
    else:
        torch.testing.assert_close(output, got.logit_diff, atol=1e-6, rtol=0)
    assert math.isnan(got.heads[1][1]) and not math.isnan(got.heads[1][0])
    assert abs(got.total() - sum(got.rest.values())) > 1e-3, "heads must carry some part"
    assert {"embeddings", "mlp.0", "mlp.1", "attn_bias.0", "attn_bias.1"} <= set(got.rest)


@pytest.mark.parametrize("kind", ["classifier", "embedding"])
def test_models_without_token_logits_are_refused(kind, tmp_path):
    from tests._encoders import write_checkpoint

    head = {"classifier": "classifier", "embedding": "encoder"}[kind]
    model = headlab.load(write_checkpoint(tmp_path, "roberta", head), tokenizer=False)
    assert model.kind == kind
    with pytest.raises(headlab.errors.UserError, match="logits over a vocabulary"):
        logit_attribution(model, torch.tensor([[0, 5, 6, 2]]), target=5, foil=6)


def test_cli_inspect_puts_the_attribution_in_the_html_view(tiny_gpt2_dir, tiny_gpt2,
                                                            tmp_path):
    """--target/--foil with --html: the one-text view holds the attribution map, every
    head's value as the API computes it, and links to it."""
    import html as html_lib
    import re

    from typer.testing import CliRunner

    from headlab.cli import app

    text, out = "The cat sat on the mat and", tmp_path / "view.html"
    result = CliRunner().invoke(app, ["inspect", str(tiny_gpt2_dir), text, "--target", " the",
                                      "--foil", " a", "--html", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text(encoding="utf-8")
    assert 'href="#attribution"' in page
    section = page[page.index('<section id="attribution">'):]
    section = section[:section.index("</section>")]
    found = logit_attribution(tiny_gpt2, text, target=" the", foil=" a")
    titles = dict(re.findall(r'title="(L\d+ H\d+): ([^"]+)"', html_lib.unescape(section)))
    assert len(titles) == tiny_gpt2.n_layers * tiny_gpt2.n_original_heads
    for layer, row in enumerate(found.heads):
        for head, v in enumerate(row):
            assert titles[f"L{layer} H{head}"] == f"{v:+.4g}"
