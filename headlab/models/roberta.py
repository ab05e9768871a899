"""RoBERTa and XLM-RoBERTa on headlab's attention: BERT with other positions and names.

The encoder is BERT's (`headlab.models.bert`); what differs is data:

* positions count real tokens only and start at ``pad_token_id + 1``: a pad token gets
  position ``pad_token_id`` and the others ``pad_token_id + 1, +2, ...`` in order
  (transformers' ``create_position_ids_from_input_ids``), so ``max_positions`` is
  ``max_position_embeddings - pad_token_id - 1``;
* the MLM head (``lm_head``: dense, GELU, LayerNorm, tied decoder + bias) uses GELU
  whatever ``hidden_act`` says; the classifier (``classifier.dense``, tanh,
  ``classifier.out_proj``) reads the first token (``<s>``) without BERT's pooler;
* checkpoint names start with ``roberta.``; token types exist (one type in practice).

XLM-R (model_type ``xlm-roberta``) is the same network with a larger vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headlab.models.bert import _BACKBONE, Bert, BertConfig
from headlab.models.encoder import build, head_map, head_of
from headlab.models.registry import register

MODEL_TYPES = ("roberta", "xlm-roberta")
# HF architecture -> headlab head
_ARCHITECTURES = {
    f"{prefix}{suffix}": head
    for prefix in ("Roberta", "XLMRoberta")
    for suffix, head in (("Model", "none"), ("ForMaskedLM", "mlm"),
                         ("ForSequenceClassification", "classifier"))
}
_POOLER = r"^(roberta\.)?pooler\.dense\."
# per head: the extra weights it needs, and the known checkpoint parts it does not use
_HEAD_WEIGHTS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "mlm": (
        {
            "^lm_head.dense.weight": "mlm.dense.weight",
            "^lm_head.dense.bias": "mlm.dense.bias",
            "^lm_head.layer_norm.weight": "mlm.ln.weight",
            "^lm_head.layer_norm.bias": "mlm.ln.bias",
            "^lm_head.bias": "mlm.bias",
        },
        # the decoder is a copy of the word embeddings (and of lm_head.bias) where stored
        (r"^lm_head\.decoder\.(weight|bias)$", _POOLER),
    ),
    "classifier": (
        {
            "^classifier.dense.weight": "pooler.weight",
            "^classifier.dense.bias": "pooler.bias",
            "^classifier.out_proj.weight": "classifier.weight",
            "^classifier.out_proj.bias": "classifier.bias",
        },
        (_POOLER,),
    ),
    "none": ({}, (_POOLER,)),
}


@dataclass
class RobertaConfig(BertConfig):
    vocab_size: int = 50265
    max_position_embeddings: int = 514
    type_vocab_size: int = 1
    layer_norm_eps: float = 1e-5
    pad_token_id: int | None = 1

    @classmethod
    def from_hf(cls, hf: dict) -> RobertaConfig:
        model_type = hf.get("model_type", "roberta")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
        if hf.get("pad_token_id") is None:
            raise ValueError(
                "RoBERTa config.json has no pad_token_id: its positions are counted from "
                "it (pad_token_id + 1 is the first position)"
            )
        cfg = super().from_hf(hf)
        if cfg.max_position_embeddings <= cfg.pad_token_id + 1:
            raise ValueError(
                f"max_position_embeddings ({cfg.max_position_embeddings}) leaves no position "
                f"after the padding offset pad_token_id + 1 = {cfg.pad_token_id + 1}"
            )
        return cfg


class Roberta(Bert):
    """RoBERTa / XLM-R encoder with an MLM head, a sequence classifier, or embeddings."""

    family = "roberta"
    config_class = RobertaConfig
    mlm_activation = "gelu"

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings - self.config.pad_token_id - 1

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, S): pad tokens at pad_token_id, real ones from pad_token_id + 1 in order."""
        pad = self.config.pad_token_id
        real = input_ids.ne(pad).int()
        return torch.cumsum(real, dim=1).type_as(real) * real + pad


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> Roberta:
    """Build a Roberta from an HF config dict and state dict ((XLM)RobertaModel,
    ForMaskedLM, ForSequenceClassification); ``path``, the checkpoint directory, tells
    whether it is a sentence-transformers model and how it pools."""
    cfg = RobertaConfig.from_hf(hf_config)
    head = head_of(hf_config, hf_state, family="RoBERTa", architectures=_ARCHITECTURES,
                   mlm_prefix="lm_head.")
    return build(Roberta, cfg, hf_config, hf_state, head=head,
                 wmap=head_map(_BACKBONE, _HEAD_WEIGHTS, head), prefixes=("roberta.", ""),
                 path=path, what="RoBERTa checkpoint")


register(Roberta, hf_types=MODEL_TYPES, from_hf=from_hf)
