"""ModernBERT on headlab's attention: a pre-norm encoder with alternating global and
local (sliding-window, bidirectional) attention and rotary positions.

Layer i is global when ``i % global_attn_every_n_layers == 0`` (``layer_types`` in
transformers v5 configs), local otherwise; a local query sees the keys within
``local_attention // 2`` positions on either side (|i - j| <= local_attention // 2).
Global and local layers rotate Q and K with their own rope theta
(``global_rope_theta``, ``local_rope_theta``). Blocks: x + attn(norm(x)) (layer 0 has
no attention norm: the embeddings are normed already), then x + mlp(norm(x)) with a
GeGLU MLP (``Wi`` gives input and gate, ``act(input) * gate``, then ``Wo``); no biases
unless the config asks. The fused ``Wqkv`` checkpoint matrix is split into Q, K, V.
A final norm follows the last block; heads:

* ``head="mlm"``: ``head`` (dense, classifier_activation, norm), then the tied word
  embeddings + ``decoder.bias``, kind "masked-lm";
* ``head="classifier"``: the first token (``classifier_pooling="cls"``) or the mean
  over real tokens, ``head``, then ``classifier``, kind "classifier";
* ``head="none"``: pooled sentence embeddings, kind "embedding".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from headlab.attention import MultiHeadAttention
from headlab.attention.hookpoint import HookPoint, run_hook
from headlab.attention.masks import Mask
from headlab.models.base import BlockInputs, FamilyConfig, HeadModel, ModelOutput
from headlab.models.encoder import (
    HEADS,
    TiedDecoder,
    activation,
    build,
    check_options,
    head_of,
    pool,
)
from headlab.models.registry import register
from headlab.models.weights import WeightMap

MODEL_TYPES = ("modernbert",)
GLOBAL, LOCAL = "full_attention", "sliding_attention"
_ARCHITECTURES = {"ModernBertModel": "none", "ModernBertForMaskedLM": "mlm",
                  "ModernBertForSequenceClassification": "classifier"}


@dataclass
class ModernBertConfig(FamilyConfig):
    """ModernBERT hyperparameters, named as in HF's config.json (v4 names for the
    rope thetas; ``layer_types`` lists each layer's ``full_attention`` or
    ``sliding_attention``)."""

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    decoder_bias: bool = True
    classifier_pooling: str = "cls"
    classifier_bias: bool = False
    classifier_activation: str = "gelu"
    local_attention: int = 128
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    layer_types: list[str] | None = None
    pad_token_id: int | None = 50283
    num_labels: int = 2
    labels: list[str] | None = None  # class names, index = class id (classifiers)

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [LOCAL if i % 3 else GLOBAL for i in range(self.num_hidden_layers)]
        bad = sorted(set(self.layer_types) - {GLOBAL, LOCAL})
        if bad or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must name {GLOBAL!r} or {LOCAL!r} for each of the "
                f"{self.num_hidden_layers} layers; got {self.layer_types}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("rotary embeddings need an even head size")
        if self.classifier_pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling {self.classifier_pooling!r} is not "
                             "supported; ModernBERT pools with 'cls' or 'mean'")
        for name in (self.hidden_activation, self.classifier_activation):
            activation(name, family="ModernBERT")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf: dict) -> ModernBertConfig:
        """Read an HF config dict: transformers v5 (``layer_types``, ``rope_parameters``
        per layer type) or v4 (``global_attn_every_n_layers``, ``global_rope_theta``,
        ``local_rope_theta``)."""
        model_type = hf.get("model_type", "modernbert")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
        kw = cls.known(hf, skip=("labels", "layer_types", "global_rope_theta",
                                 "local_rope_theta"))
        layers = hf.get("num_hidden_layers", 22)
        every = hf.get("global_attn_every_n_layers", 3)
        kw["layer_types"] = list(hf.get("layer_types")
                                 or [LOCAL if i % every else GLOBAL for i in range(layers)])
        rope = hf.get("rope_parameters") or {}
        if hf.get("rope_scaling"):
            raise ValueError("ModernBERT rope_scaling is not supported: headlab implements "
                             "plain RoPE with the global and local thetas")
        for kind, key, default in ((GLOBAL, "global_rope_theta", 160000.0),
                                   (LOCAL, "local_rope_theta", 10000.0)):
            params = rope.get(kind) or {}
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"ModernBERT rope_type {params['rope_type']!r} is not "
                                 "supported; headlab implements plain RoPE ('default')")
            kw[key] = float(params.get("rope_theta", hf.get(key, default)))
        id2label = {int(k): v for k, v in (hf.get("id2label") or {}).items()}
        if id2label:
            kw["num_labels"] = len(id2label)
            kw["labels"] = [id2label.get(i, f"LABEL_{i}") for i in range(len(id2label))]
        return cls(**kw)


def _norm(cfg: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)


class GeGLU(nn.Module):
    """wo(act(input) * gate), input and gate the two halves of wi(x)."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_activation, family="ModernBERT")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp, gate = self.wi(x).chunk(2, dim=-1)  # (B, S, I) each
        return self.wo(self.act(inp) * gate)


class ModernBertBlock(nn.Module):
    """Pre-norm: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, cfg: ModernBertConfig, index: int, kv_index: list[int] | None) -> None:
        super().__init__()
        H = cfg.num_attention_heads if kv_index is None else len(kv_index)
        self.is_local = cfg.layer_types[index] == LOCAL
        self.attn_norm = _norm(cfg) if index else nn.Identity()
        self.attn = MultiHeadAttention(
            d_model=cfg.hidden_size, n_heads=H, n_kv_heads=H, head_dim=cfg.head_dim,
            bias=cfg.attention_bias, kv_index=kv_index,
        )
        self.attn.n_original_heads = cfg.num_attention_heads
        self.mlp_norm = _norm(cfg)
        self.mlp = GeGLU(cfg)
        self.resid_pre = HookPoint()  # (B, S, E)
        self.resid_mid = HookPoint()  # (B, S, E) after the attention's residual sum
        self.resid_post = HookPoint()  # (B, S, E)

    def forward(self, x: torch.Tensor, masks: dict[bool, Mask], rotary: dict) -> torch.Tensor:
        x = run_hook(self.resid_pre, x)
        x = x + self.attn(self.attn_norm(x), mask=masks[self.is_local],
                          rotary=rotary[self.is_local])
        x = run_hook(self.resid_mid, x)
        x = x + self.mlp(self.mlp_norm(x))
        return run_hook(self.resid_post, x)


class ModernBertHead(nn.Module):
    """dense, classifier_activation, norm: before the MLM decoder and the classifier."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.act = activation(cfg.classifier_activation, family="ModernBERT")
        self.norm = _norm(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(h)))


def local_window(length: int, half: int, device) -> torch.Tensor | None:
    """(S, S) bool: True where |i - j| <= half, or None when that holds everywhere."""
    if length <= half + 1:
        return None
    pos = torch.arange(length, device=device)
    return (pos[:, None] - pos[None, :]).abs() <= half


class ModernBert(HeadModel):
    """ModernBERT encoder with an MLM head, a sequence classifier, or embeddings."""

    family = "modernbert"
    config_class = ModernBertConfig
    mlp_down = "mlp.wo"
    final_norm: nn.Module  # the LayerNorm after the last block, set in __init__
    hf_export_unsupported = (
        "HF ModernBERT derives the head size from hidden_size / num_attention_heads, so a "
        "layer with fewer heads has no HF config"
    )
    not_applicable = {"attribution": "direct logit attribution follows a pre-norm decoder's "
                      "final norm or BERT's post-norm MLM head; ModernBERT's pre-norm MLM is "
                      "neither"}

    def __init__(self, config: ModernBertConfig, layout: list[list[int]] | None = None, *,
                 head: str = "none", pooling: str = "mean", normalize: bool = False) -> None:
        """``layout``: each layer's kv_index list, for rebuilding a pruned model.
        ``head``: "mlm", "classifier" or "none"; ``pooling`` ("mean", "cls", "max") and
        ``normalize`` (L2) shape the embeddings of ``head="none"``."""
        super().__init__(config)
        layout = check_options("ModernBERT", head=head, pooling=pooling, layout=layout,
                               n_layers=config.num_hidden_layers)
        self.head, self.pooling, self.normalize = head, pooling, normalize
        self.kind = HEADS[head]
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.ln_emb = _norm(config)
        self.blocks = nn.ModuleList(ModernBertBlock(config, i, kv) for i, kv in enumerate(layout))
        self.final_norm = _norm(config)
        D = config.head_dim
        # inverse frequencies (D/2,) per layer kind, float32, off the state dict
        self._inv_freq = {
            local: 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
            for local, theta in ((False, config.global_rope_theta),
                                 (True, config.local_rope_theta))
        }
        if head in ("mlm", "classifier"):
            self.prediction_head = ModernBertHead(config)
        if head == "mlm":
            self.decoder = TiedDecoder(self.wte)
            self.decoder_bias = (nn.Parameter(torch.zeros(config.vocab_size))
                                 if config.decoder_bias else None)
        elif head == "classifier":
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def extra_config(self) -> dict:
        return {"head": self.head, "pooling": self.pooling, "normalize": self.normalize}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                cache: object | None = None,
                position_ids: torch.Tensor | None = None) -> ModelOutput:
        """input_ids (B, S); attention_mask (B, S) with 1 = real token; position_ids
        (B|1, S), by default 0 .. S-1 (padding included, as transformers does)."""
        if cache is not None:
            raise ValueError("ModernBERT is a bidirectional encoder and keeps no key/value "
                             "cache: call it on the whole sequence with cache=None")
        x, masks, rotary = self._embed(input_ids, attention_mask, position_ids)
        for block in self.blocks:
            x = block(x, masks, rotary)
        x = self.final_norm(x)  # (B, S, E)
        if self.head == "mlm":
            logits = self.decoder(self.prediction_head(x), self.decoder_bias)  # (B, S, V)
            return ModelOutput(last_hidden_state=x, logits=logits)
        if self.head == "classifier":
            if self.config.classifier_pooling == "cls":
                pooled = x[:, 0]
            else:
                pooled = pool(x, attention_mask, pooling="mean", normalize=False)  # (B, E)
            return ModelOutput(last_hidden_state=x,
                               logits=self.classifier(self.prediction_head(pooled)))  # (B, C)
        return ModelOutput(last_hidden_state=x, embeddings=pool(
            x, attention_mask, pooling=self.pooling, normalize=self.normalize))

    def block_inputs(self, input_ids, attention_mask=None) -> BlockInputs:
        x, masks, rotary = self._embed(input_ids, attention_mask, None)
        blocks = self.blocks
        return BlockInputs(
            x, block=lambda i, h: blocks[i](h, masks, rotary),
            attention=lambda i, h: blocks[i].attn(
                blocks[i].attn_norm(h), mask=masks[blocks[i].is_local],
                rotary=rotary[blocks[i].is_local]))

    def _embed(self, input_ids, attention_mask, position_ids):
        """The first block's input (B, S, E), and per layer kind (local?) the mask and
        the rotary (cos, sin), each (B|1, S, D), that its blocks share."""
        B, S = input_ids.shape
        if self.max_positions < S:
            raise ValueError(
                f"sequence of {S} tokens exceeds this ModernBERT's {self.max_positions} "
                "positions; truncate the input (tokenizer(..., truncation=True))")
        x = self.ln_emb(self.wte(input_ids))  # (B, S, E)
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None]  # (1, S)
        padding = attention_mask
        if padding is not None and bool(padding.all()):
            padding = None  # keeps SDPA on its fastest kernel
        band = local_window(S, self.config.local_attention // 2, x.device)
        masks, rotary = {}, {}
        for local in (False, True):
            masks[local] = Mask.build(batch=B, q_len=S, k_len=S, device=x.device,
                                      key_padding_mask=padding,
                                      attn_mask=band if local else None)
            inv_freq = self._inv_freq[local].to(x.device)
            freqs = position_ids[..., None].float() * inv_freq  # (B|1, S, D/2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (B|1, S, D), half-split
            rotary[local] = (emb.cos().to(x.dtype), emb.sin().to(x.dtype))
        return x, masks, rotary


# ---------------------------------------------------------------------- conversion
def weight_map(cfg: ModernBertConfig, head: str) -> WeightMap:
    """HF names -> headlab names for a config (which biases exist) and a head."""
    per_layer = {
        "layers.{}.attn.Wo.weight": "blocks.{}.attn.o_proj.weight",
        "layers.{}.mlp.Wi.weight": "blocks.{}.mlp.wi.weight",
        "layers.{}.mlp.Wo.weight": "blocks.{}.mlp.wo.weight",
        "layers.{}.attn_norm.weight": "blocks.{}.attn_norm.weight",
        "layers.{}.mlp_norm.weight": "blocks.{}.mlp_norm.weight",
    }
    single = {"embeddings.tok_embeddings.weight": "wte.weight",
              "embeddings.norm.weight": "ln_emb.weight", "final_norm.weight": "final_norm.weight"}
    splits = {"layers.{}.attn.Wqkv.weight": tuple(f"blocks.{{}}.attn.{p}_proj.weight"
                                                  for p in "qkv")}
    if cfg.attention_bias:
        per_layer["layers.{}.attn.Wo.bias"] = "blocks.{}.attn.o_proj.bias"
        splits["layers.{}.attn.Wqkv.bias"] = tuple(f"blocks.{{}}.attn.{p}_proj.bias"
                                                   for p in "qkv")
    if cfg.mlp_bias:
        per_layer.update({"layers.{}.mlp.Wi.bias": "blocks.{}.mlp.wi.bias",
                          "layers.{}.mlp.Wo.bias": "blocks.{}.mlp.wo.bias"})
    if cfg.norm_bias:
        per_layer.update({k.replace("weight", "bias"): v.replace("weight", "bias")
                          for k, v in per_layer.items() if "norm" in k})
        single.update({k.replace("weight", "bias"): v.replace("weight", "bias")
                       for k, v in single.items() if "norm" in k})
    ignore: tuple[str, ...] = ()
    if head in ("mlm", "classifier"):
        single.update({"^head.dense.weight": "prediction_head.dense.weight",
                       "^head.norm.weight": "prediction_head.norm.weight"})
        if cfg.classifier_bias:
            single["^head.dense.bias"] = "prediction_head.dense.bias"
        if cfg.norm_bias:
            single["^head.norm.bias"] = "prediction_head.norm.bias"
    if head == "mlm":
        if cfg.decoder_bias:
            single["^decoder.bias"] = "decoder_bias"
        ignore = (r"^decoder\.weight$",)  # a copy of the word embeddings where stored
    elif head == "classifier":
        single.update({"^classifier.weight": "classifier.weight",
                       "^classifier.bias": "classifier.bias"})
    # layer 0 has no attention norm: its templated keys are allowed to be absent
    optional = ("layers.0.attn_norm.weight", "layers.0.attn_norm.bias")
    return WeightMap(per_layer=per_layer, single=single, splits=splits, ignore=ignore,
                     optional=optional)


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> ModernBert:
    """Build a ModernBert from an HF config dict and state dict (ModernBertModel,
    ForMaskedLM, ForSequenceClassification); ``path``, the checkpoint directory, tells
    whether it is a sentence-transformers model and how it pools."""
    cfg = ModernBertConfig.from_hf(hf_config)
    head = head_of(hf_config, hf_state, family="ModernBERT", architectures=_ARCHITECTURES,
                   mlm_prefix="decoder.")
    return build(ModernBert, cfg, hf_config, hf_state, head=head, wmap=weight_map(cfg, head),
                 prefixes=("model.", ""), path=path, what="ModernBERT checkpoint")


register(ModernBert, hf_types=MODEL_TYPES, from_hf=from_hf)
