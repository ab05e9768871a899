"""Gemma-2 and Gemma-3 (text) on headlab's decoder (`headlab.models.decoder`).

Both: RMSNorm with (1 + w) computed in float32, a norm before and after both attention
and MLP, embeddings times sqrt(E) (rounded to the model dtype), GeGLU with tanh GELU,
scale ``query_pre_attn_scalar``^-1/2, sliding-window and global layers (``layer_types``).
Gemma-2 adds logit soft-capping in attention and on the final logits. Gemma-3 adds a
per-head QK-norm and a rotary theta per layer type (``rope_parameters`` keyed by layer
type; v4 configs: ``rope_theta`` global, ``rope_local_base_freq`` local, ``rope_scaling``
on the global layers only). The multimodal Gemma-3 checkpoint loads its text model.
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

MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3")

_LAYER = {
    **PROJECTIONS,
    "layers.{}.input_layernorm.weight": "blocks.{}.attn_norm.weight",
    "layers.{}.post_attention_layernorm.weight": "blocks.{}.attn_post_norm.weight",
    "layers.{}.pre_feedforward_layernorm.weight": "blocks.{}.mlp_norm.weight",
    "layers.{}.post_feedforward_layernorm.weight": "blocks.{}.mlp_post_norm.weight",
}
_BIAS = attention_biases("q_proj", "k_proj", "v_proj", "o_proj")
# the multimodal checkpoint's text model sits under one of these (v5, v4)
_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")


def _weight_map(cfg: DecoderConfig) -> WeightMap:
    per_layer = dict(_LAYER)
    if cfg.qkv_bias:
        per_layer.update(_BIAS)
    if cfg.qk_norm:
        per_layer.update(QK_NORM)
    return WeightMap(
        per_layer=per_layer, single=SINGLE,
        ignore=(r"rotary_emb\.inv_freq$", r"vision_tower\.", r"multi_modal_projector\."),
        optional=("^lm_head.weight", "^language_model.lm_head.weight")
        if cfg.tie_word_embeddings else (),
    )


def _layer_types(hf: dict, pattern: int) -> list[str]:
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern", pattern)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(hf["num_hidden_layers"])]


def _gemma3_rope(hf: dict) -> dict[str, dict]:
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # v5, per layer type
        return {t: read_rope({"rope_parameters": params.get(t) or {}},
                             default_theta=1e6 if t == "full_attention" else 1e4)
                for t in ("full_attention", "sliding_attention")}
    glob = read_rope({k: hf[k] for k in ("rope_scaling", "rope_theta") if k in hf},
                     default_theta=1e6)
    local = {"rope_type": "default", "rope_theta": float(hf.get("rope_local_base_freq", 1e4))}
    return {"full_attention": glob, "sliding_attention": local}


def read_config(hf: dict) -> DecoderConfig:
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
    if model_type == "gemma3":  # the multimodal config: its text model
        hf = {"model_type": "gemma3_text", **hf["text_config"],
              "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    gemma3 = hf["model_type"] == "gemma3_text"
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma with use_bidirectional_attention is an encoder: headlab "
                         "loads the causal Gemma models only")
    bias = bool(hf.get("attention_bias", False))
    if gemma3:
        rope = _gemma3_rope(hf)
    else:
        single = read_rope(hf)
        rope = {"full_attention": single, "sliding_attention": single}
    return DecoderConfig(
        **shared_fields(hf, tie_default=True), norm="rms1p",
        norm_eps=hf.get("rms_norm_eps", 1e-6), post_norms=True,
        act=hf.get("hidden_activation") or "gelu_pytorch_tanh", qkv_bias=bias, out_bias=bias,
        qk_norm="head" if gemma3 else None,
        attn_softcap=hf.get("attn_logit_softcapping", None if gemma3 else 50.0),
        final_softcap=hf.get("final_logit_softcapping", None if gemma3 else 30.0),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256), embed_scale=True,
        rope=rope, layer_types=_layer_types(hf, 6 if gemma3 else 2),
        sliding_window=hf.get("sliding_window", 4096),
    )


class Gemma2(Decoder):
    """Gemma-2: ``forward`` returns soft-capped logits (B, S, V)."""

    family = "gemma2"
    weight_map = staticmethod(_weight_map)
    hf_attention_bias_key = "attention_bias"


class Gemma3(Gemma2):
    """Gemma-3's text model: exports as ``Gemma3ForCausalLM``."""

    family = "gemma3"

    def to_hf(self):
        hf, state = super().to_hf()
        hf.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"])
        return hf, state


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> Gemma2:
    cfg = read_config(hf_config)
    cls = Gemma2 if hf_config["model_type"] == "gemma2" else Gemma3
    if hf_config["model_type"] == "gemma3":  # keep the text config for export
        cfg.hf_config = {"model_type": "gemma3_text", **hf_config["text_config"]}
    return build(cls, cfg, hf_state, prefixes=_PREFIXES)


register(Gemma2, hf_types=("gemma2",), from_hf=from_hf)
register(Gemma3, hf_types=("gemma3", "gemma3_text"), from_hf=from_hf)
