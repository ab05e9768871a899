"""OLMo-2 on headlab's decoder.

Norms after attention and MLP only (x + norm(attn(x)), x + norm(mlp(x))), SwiGLU, and a
QK RMSNorm over the whole Q and K projections (all heads at once) before rotary.

Pruning semantics: that norm divides each head's query by the RMS over every head of
the layer, so a head's query depends on the other heads' projections. Gating a head
(its output times 0) leaves the norm as it was; removing the head removes its rows
from the norm's statistic too, so the kept heads' queries and keys are rescaled by
rms(all) / rms(kept) per position. headlab prunes to the shape HF OLMo-2 can hold (the
norm over the kept heads, its weights for them), which exports as it is; the pruned
model is then not the gated one, and `tests/test_decoders.py` measures by how much.
"""

from __future__ import annotations

import torch

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
)
from headlab.models.registry import register
from headlab.models.weights import WeightMap

MODEL_TYPES = ("olmo2",)

_LAYER = {
    **PROJECTIONS,
    **QK_NORM,
    "layers.{}.post_attention_layernorm.weight": "blocks.{}.attn_post_norm.weight",
    "layers.{}.post_feedforward_layernorm.weight": "blocks.{}.mlp_post_norm.weight",
}
_BIAS = attention_biases("q_proj", "k_proj", "v_proj", "o_proj")


def _weight_map(cfg: DecoderConfig) -> WeightMap:
    per_layer = dict(_LAYER)
    if cfg.qkv_bias:
        per_layer.update(_BIAS)
    return WeightMap(per_layer=per_layer, single=SINGLE, ignore=(r"rotary_emb\.inv_freq$",),
                     optional=("^lm_head.weight",) if cfg.tie_word_embeddings else ())


def read_config(hf: dict) -> DecoderConfig:
    if hf.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"model_type {hf.get('model_type')!r} is not one of {MODEL_TYPES}")
    bias = bool(hf.get("attention_bias", False))
    return DecoderConfig(
        **shared_fields(hf), norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-5),
        pre_norms=False, post_norms=True, act=hf.get("hidden_act", "silu"),
        qkv_bias=bias, out_bias=bias, qk_norm="projection",
        rope={"full_attention": read_rope(hf)},
    )


class Olmo2(Decoder):
    """OLMo-2: ``forward`` returns logits (B, S, V)."""

    family = "olmo2"
    weight_map = staticmethod(_weight_map)
    hf_attention_bias_key = "attention_bias"
    not_applicable = {"gate-equals-prune": "its QK-norm runs over every head of a layer, so a "
                      "pruned layer normalises over the kept heads alone: not the gated layer"}


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> Olmo2:
    return build(Olmo2, read_config(hf_config), hf_state, prefixes=("model.", ""))


register(Olmo2, hf_types=MODEL_TYPES, from_hf=from_hf)
