"""Phi-3 (and Phi-3.5/Phi-4 mini variants) on headlab's decoder.

Llama's blocks with the checkpoint's fused ``qkv_proj`` (rows: H*D query, H_kv*D key,
H_kv*D value) and ``gate_up_proj`` (gate rows, then up rows) split by the weight map,
so each head stays separately prunable, and fused again on export. A sliding window on
every layer where the config sets one; partial rotary where ``partial_rotary_factor``
< 1. ``longrope`` scaling (the 128k-context variants) is not supported.
"""

from __future__ import annotations

import torch

from headlab.models.base import Absent
from headlab.models.decoder import Decoder, DecoderConfig, build, read_rope, shared_fields
from headlab.models.registry import register
from headlab.models.weights import WeightMap

MODEL_TYPES = ("phi3",)

_LAYER = {
    "layers.{}.self_attn.o_proj.weight": "blocks.{}.attn.o_proj.weight",
    "layers.{}.mlp.down_proj.weight": "blocks.{}.mlp.down_proj.weight",
    "layers.{}.input_layernorm.weight": "blocks.{}.attn_norm.weight",
    "layers.{}.post_attention_layernorm.weight": "blocks.{}.mlp_norm.weight",
}
_SPLITS = {
    "layers.{}.self_attn.qkv_proj.weight": ("blocks.{}.attn.q_proj.weight",
                                            "blocks.{}.attn.k_proj.weight",
                                            "blocks.{}.attn.v_proj.weight"),
    "layers.{}.mlp.gate_up_proj.weight": ("blocks.{}.mlp.gate_proj.weight",
                                          "blocks.{}.mlp.up_proj.weight"),
}
_SINGLE = {"embed_tokens.weight": "embed_tokens.weight", "norm.weight": "norm.weight",
           "^lm_head.weight": "lm_head.weight"}


def _weight_map(cfg: DecoderConfig) -> WeightMap:
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return WeightMap(
        per_layer=_LAYER, single=_SINGLE, splits=_SPLITS,
        split_sizes={"layers.{}.self_attn.qkv_proj.weight": (q, kv, kv)},
        ignore=(r"rotary_emb\.inv_freq$",),
        optional=("^lm_head.weight",) if cfg.tie_word_embeddings else (),
    )


def read_config(hf: dict) -> DecoderConfig:
    if hf.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"model_type {hf.get('model_type')!r} is not one of {MODEL_TYPES}")
    fields = shared_fields(hf)
    rope = read_rope(hf)
    if rope["rope_type"] in ("longrope", "su", "yarn"):
        raise ValueError("Phi-3 longrope scaling (the 128k-context variants) is not "
                         "supported; the 4k-context Phi-3 models load")
    params = hf.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(fields["head_dim"] * partial)
    window = hf.get("sliding_window")
    return DecoderConfig(
        **fields, norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-5),
        act=hf.get("hidden_act", "silu"),
        rotary_dim=None if rotary_dim == fields["head_dim"] else rotary_dim,
        rope={"full_attention": rope, "sliding_attention": rope},
        layer_types=["sliding_attention" if window else "full_attention"]
        * hf["num_hidden_layers"],
        sliding_window=window,
    )


class Phi3(Decoder):
    """Phi-3: ``forward`` returns logits (B, S, V)."""

    family = "phi3"
    weight_map = staticmethod(_weight_map)
    hf_attention_bias_key = Absent("HF Phi-3's attention has no biases, nor a key to add them")


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> Phi3:
    return build(Phi3, read_config(hf_config), hf_state, prefixes=("model.", ""))


register(Phi3, hf_types=MODEL_TYPES, from_hf=from_hf)
