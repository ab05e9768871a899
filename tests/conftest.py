"""Shared fixtures: a small BPE tokenizer trained on the bundled text, and tiny random
checkpoints written with transformers' save_pretrained (the hub is unreachable here)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N (pyproject's addopts): the N workers share the cores, so each runs
    # torch on one thread, and so do the headlab processes its tests start
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer (vocab 512) trained on headlab's bundled English text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from headlab.data.texts import bundled_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(bundled_text().split("\n\n"), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    return fast


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, bpe_tokenizer):
    """A random GPT-2 (3 layers x 4 heads, E=32) saved by transformers with a tokenizer."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_head=4, n_embd=32, n_positions=128,
                                  vocab_size=len(bpe_tokenizer),
                                  bos_token_id=bpe_tokenizer.eos_token_id,
                                  eos_token_id=bpe_tokenizer.eos_token_id)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-gpt2")
    model.save_pretrained(path)
    bpe_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def gqa_dir(tmp_path_factory, bpe_tokenizer):
    """A random Llama, 2 layers x 6 query heads over 3 key/value heads (groups of 2)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(bpe_tokenizer), hidden_size=48, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
        max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-gqa-llama")
    model.save_pretrained(path)
    bpe_tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def tiny_gpt2(tiny_gpt2_dir):
    import headlab

    return headlab.load(tiny_gpt2_dir)

