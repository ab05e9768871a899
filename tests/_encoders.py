"""Random-weight encoder checkpoints of each family beside BERT, written by transformers'
``save_pretrained``, and the batches the equivalence tests feed them (for
test_encoders.py). Tiny sizes: the whole family suite stays within seconds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers

VOCAB = 97


@dataclass(frozen=True)
class Family:
    """One encoder family: its HF config class and keyword arguments, and its HF model
    class per headlab head ("encoder", "mlm", "classifier")."""

    name: str
    config: Any
    kwargs: dict
    classes: dict
    pad: int

    def hf_config(self, **extra) -> transformers.PretrainedConfig:
        return self.config(**{**self.kwargs, **extra})


_BERT_LIKE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, num_labels=3)
FAMILIES = {
    "roberta": Family(
        "roberta", transformers.RobertaConfig,
        dict(_BERT_LIKE, max_position_embeddings=24, pad_token_id=1, bos_token_id=0,
             eos_token_id=2),
        {"encoder": transformers.RobertaModel, "mlm": transformers.RobertaForMaskedLM,
         "classifier": transformers.RobertaForSequenceClassification}, pad=1),
    "xlm-roberta": Family(
        "xlm-roberta", transformers.XLMRobertaConfig,
        dict(_BERT_LIKE, max_position_embeddings=24, pad_token_id=1, bos_token_id=0,
             eos_token_id=2, hidden_act="gelu_new"),
        {"encoder": transformers.XLMRobertaModel, "mlm": transformers.XLMRobertaForMaskedLM,
         "classifier": transformers.XLMRobertaForSequenceClassification}, pad=1),
    "distilbert": Family(
        "distilbert", transformers.DistilBertConfig,
        dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
             max_position_embeddings=24, num_labels=3, pad_token_id=0, activation="gelu"),
        {"encoder": transformers.DistilBertModel, "mlm": transformers.DistilBertForMaskedLM,
         "classifier": transformers.DistilBertForSequenceClassification}, pad=0),
    # 3 layers: global, local, global; a local query sees 2 keys either side (S = 12)
    "modernbert": Family(
        "modernbert", transformers.ModernBertConfig,
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             intermediate_size=48, max_position_embeddings=64, local_attention=4,
             global_attn_every_n_layers=2, num_labels=3, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, cls_token_id=1, sep_token_id=2),
        {"encoder": transformers.ModernBertModel, "mlm": transformers.ModernBertForMaskedLM,
         "classifier": transformers.ModernBertForSequenceClassification}, pad=0),
}


def write_checkpoint(path, family: str, head: str, *, seed: int = 0, std: float = 0.3, **extra):
    """Save a random HF model whose every parameter is drawn with ``std`` (biases and
    norms included), so attention is far from uniform; returns the directory."""
    fam = FAMILIES[family]
    torch.manual_seed(seed)
    hf = fam.classes[head](fam.hf_config(**extra))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, std)
    directory = path / f"{family}-{head}"
    hf.save_pretrained(directory)
    return directory


def load_hf(directory, family: str, head: str, impl: str = "eager"):
    return FAMILIES[family].classes[head].from_pretrained(
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

    from headlab.data import bundled_text

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
    hf = fam.classes["mlm"](fam.hf_config(vocab_size=len(tokenizer),
                                          pad_token_id=tokenizer.pad_token_id, **extra))
    directory = path / f"{family}-mlm-tok"
    hf.eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
