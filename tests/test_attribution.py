"""Direct logit attribution: the parts sum to the model's logit difference, and the
attention bias part is exactly W_O's bias read through the frozen norm."""

from __future__ import annotations

import math

import pytest
import torch

import headlab
from headlab.attribution import logit_attribution


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
