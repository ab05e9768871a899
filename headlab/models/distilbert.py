"""DistilBERT on headlab's attention: BERT's post-norm encoder under other names.

What differs from `headlab.models.bert` is data: no token types (no segment table),
LayerNorms with eps 1e-12, the config's own names (``dim``, ``n_layers``, ``n_heads``,
``hidden_dim``, ``activation``), the attention's ``q_lin/k_lin/v_lin/out_lin``, an MLM
head ``vocab_transform`` -> activation -> ``vocab_layer_norm`` -> tied
``vocab_projector``, and a classifier ``pre_classifier`` -> ReLU -> ``classifier`` on
the first token (no tanh pooler). Sinusoidal position tables are stored as weights in
the checkpoint and load like learned ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from headlab.models.bert import Bert, BertConfig
from headlab.models.encoder import build, head_map, head_of
from headlab.models.registry import register
from headlab.models.weights import WeightMap

MODEL_TYPES = ("distilbert",)
_ARCHITECTURES = {"DistilBertModel": "none", "DistilBertForMaskedLM": "mlm",
                  "DistilBertForSequenceClassification": "classifier"}
# DistilBERT config.json name -> headlab (BertConfig) name
_RENAMES = {"dim": "hidden_size", "n_layers": "num_hidden_layers",
            "n_heads": "num_attention_heads", "hidden_dim": "intermediate_size",
            "activation": "hidden_act"}
_BACKBONE = WeightMap(
    per_layer={
        **{f"transformer.layer.{{}}.attention.{hf}.{p}": f"blocks.{{}}.attn.{hl}.{p}"
           for hf, hl in (("q_lin", "q_proj"), ("k_lin", "k_proj"), ("v_lin", "v_proj"),
                          ("out_lin", "o_proj"))
           for p in ("weight", "bias")},
        **{f"transformer.layer.{{}}.{hf}.{p}": f"blocks.{{}}.{hl}.{p}"
           for hf, hl in (("sa_layer_norm", "ln_1"), ("ffn.lin1", "mlp.fc"),
                          ("ffn.lin2", "mlp.proj"), ("output_layer_norm", "ln_2"))
           for p in ("weight", "bias")},
    },
    single={
        "embeddings.word_embeddings.weight": "wte.weight",
        "embeddings.position_embeddings.weight": "wpe.weight",
        "embeddings.LayerNorm.weight": "ln_emb.weight",
        "embeddings.LayerNorm.bias": "ln_emb.bias",
    },
    ignore=(r"embeddings\.position_ids$",),
)
# per head: the extra weights it needs, and the known checkpoint parts it does not use
_HEAD_WEIGHTS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "mlm": (
        {
            "^vocab_transform.weight": "mlm.dense.weight",
            "^vocab_transform.bias": "mlm.dense.bias",
            "^vocab_layer_norm.weight": "mlm.ln.weight",
            "^vocab_layer_norm.bias": "mlm.ln.bias",
            "^vocab_projector.bias": "mlm.bias",
        },
        # the projector's matrix is the word embeddings where a checkpoint stores it
        (r"^vocab_projector\.weight$",),
    ),
    "classifier": (
        {
            "^pre_classifier.weight": "pooler.weight",
            "^pre_classifier.bias": "pooler.bias",
            "^classifier.weight": "classifier.weight",
            "^classifier.bias": "classifier.bias",
        },
        (),
    ),
    "none": ({}, ()),
}


@dataclass
class DistilBertConfig(BertConfig):
    """DistilBERT's hyperparameters under BERT's names (see ``_RENAMES``)."""

    num_hidden_layers: int = 6
    type_vocab_size: int = 0

    @classmethod
    def from_hf(cls, hf: dict) -> DistilBertConfig:
        model_type = hf.get("model_type", "distilbert")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
        renamed = {_RENAMES.get(k, k): v for k, v in hf.items()
                   if k not in _RENAMES.values() and k != "type_vocab_size"}
        # DistilBERT's LayerNorms have eps 1e-12 whatever the config says
        renamed.update(type_vocab_size=0, layer_norm_eps=1e-12)
        return super().from_hf(renamed)


class DistilBert(Bert):
    """DistilBERT encoder with an MLM head, a sequence classifier, or embeddings."""

    family = "distilbert"
    config_class = DistilBertConfig
    pooler_activation = staticmethod(F.relu)


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> DistilBert:
    """Build a DistilBert from an HF config dict and state dict (DistilBertModel,
    ForMaskedLM, ForSequenceClassification); ``path``, the checkpoint directory, tells
    whether it is a sentence-transformers model and how it pools."""
    cfg = DistilBertConfig.from_hf(hf_config)
    head = head_of(hf_config, hf_state, family="DistilBERT", architectures=_ARCHITECTURES,
                   mlm_prefix="vocab_")
    return build(DistilBert, cfg, hf_config, hf_state, head=head,
                 wmap=head_map(_BACKBONE, _HEAD_WEIGHTS, head), prefixes=("distilbert.", ""),
                 path=path, what="DistilBERT checkpoint")


register(DistilBert, hf_types=MODEL_TYPES, from_hf=from_hf)
