"""`--export hf`: a pruned Llama loads in plain transformers with headlab's logits."""

from __future__ import annotations

import pytest
import torch
import transformers

import headlab
from headlab.models.export import export_hf, hf_expressible


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, bpe_tokenizer):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(bpe_tokenizer), hidden_size=48, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    bpe_tokenizer.save_pretrained(path)
    return path


def test_per_layer_pruned_llama_exports_and_loads_in_transformers(tiny_llama_dir, tmp_path):
    model = headlab.load(tiny_llama_dir)
    # whole groups (3 query heads per kv head), the same in every layer
    model.prune_heads({0: [3, 4, 5], 1: [0, 1, 2]})
    assert hf_expressible(model) is None
    export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_attention_heads == 3 and hf.config.num_key_value_heads == 1
    ids = torch.randint(0, 500, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=0, atol=1e-4)


def test_uneven_pruning_is_not_exported(tiny_llama_dir, tmp_path):
    model = headlab.load(tiny_llama_dir)
    model.prune_heads({0: [0], 1: [0, 1, 2]})
    reason = hf_expressible(model)
    assert reason is not None and "different numbers of heads" in reason
    with pytest.raises(ValueError, match="cannot export"):
        export_hf(model, tmp_path / "hf")


def test_gpt2_says_why_it_keeps_headlab_format(tiny_gpt2):
    tiny_gpt2.prune_heads({i: [0] for i in range(tiny_gpt2.n_layers)})
    assert "n_embd / n_head" in hf_expressible(tiny_gpt2)


def test_cli_export_hf_per_layer(tiny_llama_dir, tmp_path):
    from headlab.runs.config import RunConfig
    from headlab.runs.pipeline import run

    out, results = run(RunConfig(model=str(tiny_llama_dir), keep=0.5, per_layer=True,
                                 export="hf", max_tokens=2048, seq_len=32, step=0.5,
                                 out=str(tmp_path / "run")))
    # per-layer pruning of a GQA model at 0.5 keeps 3 of 6 heads per layer; groups, or the
    # layers' numbers of key/value heads, may still be uneven, in which case the run says
    # so and keeps the headlab format
    if results.export == "model-hf/":
        hf = transformers.AutoModelForCausalLM.from_pretrained(out / "model-hf").eval()
        ours = headlab.load(out / "model")
        ids = torch.randint(0, 500, (1, 9))
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=0, atol=1e-4)
    else:
        assert ("groups are uneven" in results.export or "layers keep different numbers "
                "of key/value heads" in results.export), results.export
        assert not (out / "model-hf").exists()
