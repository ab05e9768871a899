"""Qwen2/2.5 and Qwen3 on headlab's decoder (`headlab.models.decoder`).

Qwen2: Llama's blocks with biases on Q, K and V (none on W_O). Qwen3: no attention
bias (unless ``attention_bias``), and a per-head RMSNorm on Q and K (``q_norm``,
``k_norm`` of size D) before rotary. Both may slide a window on some layers:
``layer_types``, or with ``use_sliding_window`` the layers from ``max_window_layers`` on.
"""

from __future__ import annotations

import torch

from headlab.models.base import Absent
from headlab.models.decoder import (
    PROJECTIONS,
    QK_NORM,
    SINGLE,
    Decoder,
    DecoderConfig,
    attention_biases,
    build,
    read_rope,
    shared_fields,
    sliding_layers,
)
from headlab.models.registry import register
from headlab.models.weights import WeightMap

MODEL_TYPES = ("qwen2", "qwen3")

_LAYER = {
    **PROJECTIONS,
    "layers.{}.input_layernorm.weight": "blocks.{}.attn_norm.weight",
    "layers.{}.post_attention_layernorm.weight": "blocks.{}.mlp_norm.weight",
}
_QKV_BIAS = attention_biases("q_proj", "k_proj", "v_proj")
_O_BIAS = attention_biases("o_proj")


def _weight_map(cfg: DecoderConfig) -> WeightMap:
    per_layer = dict(_LAYER)
    if cfg.qkv_bias:
        per_layer.update(_QKV_BIAS)
    if cfg.out_bias:
        per_layer.update(_O_BIAS)
    if cfg.qk_norm:
        per_layer.update(QK_NORM)
    return WeightMap(per_layer=per_layer, single=SINGLE,
                     ignore=(r"rotary_emb\.inv_freq$",),
                     optional=("^lm_head.weight",) if cfg.tie_word_embeddings else ())


def read_config(hf: dict) -> DecoderConfig:
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
    qwen3 = model_type == "qwen3"
    bias = bool(hf.get("attention_bias", False)) if qwen3 else True
    # as transformers' Qwen configs: no window at all unless use_sliding_window
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    layer_types = sliding_layers(hf) if window else None
    rope = read_rope(hf)
    return DecoderConfig(
        **shared_fields(hf), norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6),
        act=hf.get("hidden_act", "silu"), qkv_bias=bias, out_bias=bias and qwen3,
        qk_norm="head" if qwen3 else None, layer_types=layer_types,
        sliding_window=window,
        rope={"full_attention": rope, "sliding_attention": rope},
    )


class Qwen2(Decoder):
    """Qwen2/2.5: ``forward`` returns logits (B, S, V)."""

    family = "qwen2"
    weight_map = staticmethod(_weight_map)
    hf_attention_bias_key = Absent("HF Qwen2 has biases on Q, K and V, none on W_O, and no "
                                   "key to give it one")


class Qwen3(Qwen2):
    """Qwen3: per-head QK RMSNorm; ``attention_bias`` switches all four biases."""

    family = "qwen3"
    hf_attention_bias_key = "attention_bias"


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> Qwen2:
    cfg = read_config(hf_config)
    cls = Qwen3 if hf_config["model_type"] == "qwen3" else Qwen2
    return build(cls, cfg, hf_state, prefixes=("model.", ""))


register(Qwen2, hf_types=("qwen2",), from_hf=from_hf)
register(Qwen3, hf_types=("qwen3",), from_hf=from_hf)
