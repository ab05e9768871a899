"""BERT on headlab's attention: config, blocks, heads and the weight mapping from HF BERT.

Post-norm encoder: x = ln_1(x + attn(x)), then x = ln_2(x + mlp(x)); the input is
word + position + token-type embeddings followed by a LayerNorm. One of three heads
sits on top, chosen from the checkpoint:

* ``head="mlm"`` (BertForMaskedLM / BertForPreTraining): dense, activation, LayerNorm,
  then the word embedding matrix (tied) plus a bias -> logits (B, S, V), kind
  "masked-lm";
* ``head="classifier"`` (BertForSequenceClassification): pooler tanh(dense(h[:, 0])),
  then a linear layer -> logits (B, C), kind "classifier";
* ``head="none"`` (BertModel, sentence-transformers): pooled sentence embeddings
  (B, E), kind "embedding". Pooling follows the sentence-transformers pipeline when
  the directory has one (``modules.json``), mean over real tokens otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from headlab.attention import MultiHeadAttention
from headlab.attention.hookpoint import HookPoint, run_hook
from headlab.attention.masks import Mask
from headlab.models.base import Absent, BlockInputs, FamilyConfig, HeadModel, ModelOutput
from headlab.models.encoder import (
    HEADS,
    TiedDecoder,
    activation,
    build,
    check_options,
    head_map,
    head_of,
    pool,
)
from headlab.models.registry import register
from headlab.models.weights import WeightMap

MODEL_TYPES = ("bert",)

# HF architecture -> headlab head
_ARCHITECTURES = {
    "BertModel": "none",
    "BertForMaskedLM": "mlm",
    "BertForPreTraining": "mlm",
    "BertForSequenceClassification": "classifier",
}


@dataclass
class BertConfig(FamilyConfig):
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    num_labels: int = 2
    labels: list[str] | None = None  # class names, index = class id (classifiers)

    @classmethod
    def from_hf(cls, hf: dict) -> BertConfig:
        kind = hf.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(
                f"BERT position_embedding_type {kind!r} is not supported; headlab "
                "implements learned absolute positions only ('absolute')"
            )
        if hf.get("is_decoder") or hf.get("add_cross_attention"):
            raise ValueError(
                "BERT used as a decoder (is_decoder / add_cross_attention) is not "
                "supported; headlab's BERT is a bidirectional encoder"
            )
        activation(hf.get("hidden_act", "gelu"), family="BERT")
        hidden, heads = hf.get("hidden_size", 768), hf.get("num_attention_heads", 12)
        if hidden % heads:
            raise ValueError(
                f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads})"
            )
        kwargs = cls.known(hf, skip=("labels",))
        # HF serialises num_labels only as id2label (keys are str in JSON, int in memory)
        id2label = {int(k): v for k, v in (hf.get("id2label") or {}).items()}
        if id2label:
            kwargs["num_labels"] = len(id2label)
            kwargs["labels"] = [id2label.get(i, f"LABEL_{i}") for i in range(len(id2label))]
        return cls(**kwargs)


class BertMLP(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act, family="BERT")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class BertBlock(nn.Module):
    """Post-norm: the LayerNorms come after each residual sum, not before the sublayer."""

    def __init__(self, cfg: BertConfig, kv_index: list[int] | None) -> None:
        super().__init__()
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        n_heads = cfg.num_attention_heads if kv_index is None else len(kv_index)
        self.attn = MultiHeadAttention(
            d_model=cfg.hidden_size, n_heads=n_heads, n_kv_heads=n_heads, head_dim=head_dim,
            bias=True, kv_index=kv_index,
        )
        self.attn.n_original_heads = cfg.num_attention_heads
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = BertMLP(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.resid_pre = HookPoint()  # (B, S, E)
        self.resid_mid = HookPoint()  # (B, S, E) after ln_1
        self.resid_post = HookPoint()  # (B, S, E) after ln_2

    def forward(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        x = run_hook(self.resid_pre, x)
        x = self.ln_1(x + self.attn(x, mask=mask))
        x = run_hook(self.resid_mid, x)
        x = self.ln_2(x + self.mlp(x))
        return run_hook(self.resid_post, x)


class BertMLMHead(nn.Module):
    """transform (dense, activation, LayerNorm), then the tied word embeddings + bias."""

    def __init__(self, cfg: BertConfig, word_embeddings: nn.Embedding,
                 act: str | None = None) -> None:
        """``act``: the transform's activation (default: the config's hidden_act)."""
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.act = activation(act or cfg.hidden_act, family="BERT")
        self.ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.decoder = TiedDecoder(word_embeddings)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(self.act(self.dense(h))), self.bias)  # (B, S, V)


class Bert(HeadModel):
    """BERT encoder with an MLM head, a sequence classifier, or pooled embeddings."""

    family = "bert"
    mlp_down = "mlp.proj"
    final_norm = Absent("post-norm: each block ends in its own LayerNorm, none follows the last")
    config_class = BertConfig
    # why `--export hf` keeps the headlab format (headlab.models.export): a pruned layer
    # has fewer heads of the same size, which the HF config cannot say
    hf_export_unsupported = (
        "HF BERT derives the head size from hidden_size / num_attention_heads, so a layer "
        "with fewer heads has no HF config"
    )
    # what a family built on this encoder changes: the MLM transform's activation
    # (None: hidden_act) and the activation on the classifier's pooled first token
    mlm_activation: ClassVar[str | None] = None
    pooler_activation: ClassVar[Callable[[torch.Tensor], torch.Tensor]] = staticmethod(torch.tanh)

    def __init__(
        self,
        config: BertConfig,
        layout: list[list[int]] | None = None,
        *,
        head: str = "none",
        pooling: str = "mean",
        normalize: bool = False,
    ) -> None:
        """``layout``: each layer's kv_index list, for rebuilding a pruned model.
        ``head``: "mlm", "classifier" or "none"; ``pooling`` ("mean", "cls", "max") and
        ``normalize`` (L2) shape the embeddings of ``head="none"``."""
        super().__init__(config)
        layout = check_options("BERT", head=head, pooling=pooling, layout=layout,
                               n_layers=config.num_hidden_layers)
        self.head, self.pooling, self.normalize = head, pooling, normalize
        self.kind = HEADS[head]
        E = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, E)
        self.wpe = nn.Embedding(config.max_position_embeddings, E)
        # families without segments (DistilBERT) have type_vocab_size 0: no table
        self.wtt = nn.Embedding(config.type_vocab_size, E) if config.type_vocab_size else None
        self.ln_emb = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.blocks = nn.ModuleList(BertBlock(config, kv) for kv in layout)
        if head == "mlm":
            self.mlm = BertMLMHead(config, self.wte, self.mlm_activation)
        elif head == "classifier":
            self.pooler = nn.Linear(E, E)
            self.classifier = nn.Linear(E, config.num_labels)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def extra_config(self) -> dict:
        return {"head": self.head, "pooling": self.pooling, "normalize": self.normalize}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        token_type_ids: torch.Tensor | None = None,
        cache: object | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids (B, S); attention_mask (B, S) with 1 = real token; token_type_ids
        (B, S) segment ids (default 0)."""
        if cache is not None:
            raise ValueError(
                "BERT is a bidirectional encoder and keeps no key/value cache: "
                "call it on the whole sequence with cache=None"
            )
        x, mask = self._embed(input_ids, attention_mask, token_type_ids, position_ids)
        for block in self.blocks:
            x = block(x, mask)

        if self.head == "mlm":
            return ModelOutput(last_hidden_state=x, logits=self.mlm(x))
        if self.head == "classifier":
            pooled = self.pooler_activation(self.pooler(x[:, 0]))  # (B, E)
            return ModelOutput(last_hidden_state=x, logits=self.classifier(pooled))
        return ModelOutput(last_hidden_state=x, embeddings=self.embed(x, attention_mask))

    def block_inputs(self, input_ids, attention_mask=None) -> BlockInputs:
        x, mask = self._embed(input_ids, attention_mask, None, None)
        blocks = self.blocks
        return BlockInputs(x, block=lambda i, h: blocks[i](h, mask),
                           attention=lambda i, h: blocks[i].attn(h, mask=mask))

    def _embed(self, input_ids, attention_mask, token_type_ids, position_ids):
        """The first block's input (B, S, E) and the mask every block shares."""
        B, S = input_ids.shape
        if self.max_positions < S:
            raise ValueError(
                f"sequence of {S} tokens exceeds this {type(self).__name__}'s {self.max_positions} "
                "positions; truncate the input (tokenizer(..., truncation=True))"
            )
        if position_ids is None:
            position_ids = self.positions(input_ids)
        x = self.wte(input_ids)
        if self.wtt is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            x = x + self.wtt(token_type_ids)
        x = x + self.wpe(position_ids)
        x = self.ln_emb(x)  # (B, S, E)

        # an all-ones mask changes nothing; dropping it keeps SDPA on its fastest kernel
        padding = attention_mask
        if padding is not None and bool(padding.all()):
            padding = None
        mask = Mask.build(
            batch=B, q_len=S, k_len=S, device=x.device, causal=self.causal,
            key_padding_mask=padding,
        )
        return x, mask

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The position ids of ``input_ids`` (B, S) when none are given: 0 .. S-1, (1, S)."""
        return torch.arange(input_ids.shape[1], device=input_ids.device)[None]

    def embed(self, h: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Pool hidden states (B, S, E) over real tokens to (B, E), as
        sentence-transformers' Pooling (then Normalize, when the pipeline has it) does."""
        return pool(h, attention_mask, pooling=self.pooling, normalize=self.normalize)


# ---------------------------------------------------------------------- conversion
_BACKBONE = WeightMap(
    per_layer={
        "encoder.layer.{}.attention.self.query.weight": "blocks.{}.attn.q_proj.weight",
        "encoder.layer.{}.attention.self.query.bias": "blocks.{}.attn.q_proj.bias",
        "encoder.layer.{}.attention.self.key.weight": "blocks.{}.attn.k_proj.weight",
        "encoder.layer.{}.attention.self.key.bias": "blocks.{}.attn.k_proj.bias",
        "encoder.layer.{}.attention.self.value.weight": "blocks.{}.attn.v_proj.weight",
        "encoder.layer.{}.attention.self.value.bias": "blocks.{}.attn.v_proj.bias",
        "encoder.layer.{}.attention.output.dense.weight": "blocks.{}.attn.o_proj.weight",
        "encoder.layer.{}.attention.output.dense.bias": "blocks.{}.attn.o_proj.bias",
        "encoder.layer.{}.attention.output.LayerNorm.weight": "blocks.{}.ln_1.weight",
        "encoder.layer.{}.attention.output.LayerNorm.bias": "blocks.{}.ln_1.bias",
        "encoder.layer.{}.intermediate.dense.weight": "blocks.{}.mlp.fc.weight",
        "encoder.layer.{}.intermediate.dense.bias": "blocks.{}.mlp.fc.bias",
        "encoder.layer.{}.output.dense.weight": "blocks.{}.mlp.proj.weight",
        "encoder.layer.{}.output.dense.bias": "blocks.{}.mlp.proj.bias",
        "encoder.layer.{}.output.LayerNorm.weight": "blocks.{}.ln_2.weight",
        "encoder.layer.{}.output.LayerNorm.bias": "blocks.{}.ln_2.bias",
    },
    single={
        "embeddings.word_embeddings.weight": "wte.weight",
        "embeddings.position_embeddings.weight": "wpe.weight",
        "embeddings.token_type_embeddings.weight": "wtt.weight",
        "embeddings.LayerNorm.weight": "ln_emb.weight",
        "embeddings.LayerNorm.bias": "ln_emb.bias",
    },
    # buffers some checkpoints carry (position ids, default token types)
    ignore=(r"embeddings\.(position_ids|token_type_ids)$",),
)
_POOLER = {"pooler.dense.weight": "pooler.weight", "pooler.dense.bias": "pooler.bias"}
# per head: the extra weights it needs, and the known checkpoint parts it does not use
_HEAD_WEIGHTS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "mlm": (
        {
            "^cls.predictions.transform.dense.weight": "mlm.dense.weight",
            "^cls.predictions.transform.dense.bias": "mlm.dense.bias",
            "^cls.predictions.transform.LayerNorm.weight": "mlm.ln.weight",
            "^cls.predictions.transform.LayerNorm.bias": "mlm.ln.bias",
            "^cls.predictions.bias": "mlm.bias",
        },
        # decoder.weight/bias are copies of the word embeddings / predictions.bias in the
        # checkpoints that store them; pooler and NSP come with BertForPreTraining
        (r"^cls\.predictions\.decoder\.(weight|bias)$", r"^(bert\.)?pooler\.dense\.",
         r"^cls\.seq_relationship\."),
    ),
    "classifier": (
        {**_POOLER, "^classifier.weight": "classifier.weight",
         "^classifier.bias": "classifier.bias"},
        (),
    ),
    "none": ({}, (r"^(bert\.)?pooler\.dense\.",)),
}


def _rename_legacy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original TF-converted checkpoints name LayerNorm parameters gamma/beta."""
    def fix(k: str) -> str:
        return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight",
                      re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k))
    return {fix(k): v for k, v in state.items()}


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> Bert:
    """Build a Bert from an HF config dict and state dict (BertModel, BertForMaskedLM,
    BertForPreTraining, BertForSequenceClassification); ``path``, the checkpoint
    directory, tells whether it is a sentence-transformers model and how it pools."""
    cfg = BertConfig.from_hf(hf_config)
    hf_state = _rename_legacy(hf_state)
    head = head_of(hf_config, hf_state, family="BERT", architectures=_ARCHITECTURES,
                   mlm_prefix="cls.predictions.")
    return build(Bert, cfg, hf_config, hf_state, head=head,
                 wmap=head_map(_BACKBONE, _HEAD_WEIGHTS, head), prefixes=("bert.", ""),
                 path=path, what="BERT checkpoint")


register(Bert, hf_types=MODEL_TYPES, from_hf=from_hf)
