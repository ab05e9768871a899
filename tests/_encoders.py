"""Random-weight encoder checkpoints of each family beside BERT, written by transformers'
``save_pretrained`` (the configs live in _families.py), and the batches and tokenizers
the equivalence tests feed them (for test_encoders.py). Tiny sizes: the whole family
suite stays within seconds."""

from __future__ import annotations

import torch
import transformers
from _families import ENCODERS as FAMILIES
from _families import VOCAB, write_encoder


def write_checkpoint(path, family: str, head: str, *, seed: int = 0, std: float = 0.3, **extra):
    """Save a random HF model of ``family`` (`_families.write_encoder`)."""
    return write_encoder(path, FAMILIES[family], head, seed=seed, std=std, **extra)


def load_hf(directory, family: str, head: str, impl: str = "eager"):
    return FAMILIES[family].hf_class(head).from_pretrained(
        directory, attn_implementation=impl).eval()


def batch(family: str, *, length: int = 12, seed: int = 1, padded: bool = True):
    """ids (4, S) drawn away from the special ids, and an attention mask with right
    padding, left padding, a single real token and a full row (pad ids where masked)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (4, length), generator=g)
    mask = torch.ones(4, length, dtype=torch.long)
    if padded:
        mask[1, length - 5:] = 0  # right padding
        mask[2, :4] = 0  # left padding: position 0 is a pad token
        mask[3, 1:] = 0  # a single real token
    ids = ids.masked_fill(mask == 0, FAMILIES[family].pad)
    return ids, mask


def bpe_tokenizer(*, cls: str, sep: str, pad: str, mask: str, unk: str, specials: list[str],
                  double_sep: bool = False):
    """A byte-level BPE tokenizer (vocab 400) trained on headlab's bundled text whose
    encodings are ``cls`` text ``sep`` (pairs ``cls a sep b sep``, RoBERTa's ``cls a sep
    sep b sep`` with ``double_sep``), with the given special tokens first in the vocab
    (their order fixes their ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from headlab.data.texts import bundled_text

    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(bundled_text().split("\n\n"), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} {sep + ' ' if double_sep else ''}$B {sep}",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token=cls, sep_token=sep, pad_token=pad, mask_token=mask,
        unk_token=unk, bos_token=cls, eos_token=sep)


def write_mlm_with_tokenizer(path, family: str, tokenizer, **extra):
    """A random MLM checkpoint of ``family`` sized to ``tokenizer``, saved with it."""
    torch.manual_seed(0)
    fam = FAMILIES[family]
    hf = fam.hf_class("mlm")(fam.hf_config(vocab_size=len(tokenizer),
                                          pad_token_id=tokenizer.pad_token_id, **extra))
    directory = path / f"{family}-mlm-tok"
    hf.eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
