"""Llama and Mistral on headlab's decoder (`headlab.models.decoder`): Llama 2/3,
SmolLM2, TinyLlama, Mistral.

Pre-norm blocks with RMSNorm, a SwiGLU MLP, half-split rotary on the whole head
(plain, ``linear`` or ``llama3`` scaled), grouped-query attention; ``attention_bias``
puts biases on Q, K, V and W_O together, ``mlp_bias`` on the three MLP projections.
Mistral (model_type ``mistral``) slides a window over every layer, ``sliding_window``
(4096 where its config.json has no such key), and has no biases; Llama ignores the key.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from headlab.models.base import Absent
from headlab.models.decoder import (
    PROJECTIONS,
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

MODEL_TYPES = ("llama", "mistral")

_LAYER = {
    **PROJECTIONS,
    "layers.{}.input_layernorm.weight": "blocks.{}.attn_norm.weight",
    "layers.{}.post_attention_layernorm.weight": "blocks.{}.mlp_norm.weight",
}
_ATTN_BIAS = attention_biases("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_BIAS = {f"layers.{{}}.mlp.{p}.bias": f"blocks.{{}}.mlp.{p}.bias"
             for p in ("gate_proj", "up_proj", "down_proj")}


class LlamaConfig(DecoderConfig):
    """A `DecoderConfig` read from a Llama or Mistral config.json (`from_hf`)."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Read an HF config dict: transformers v5 (``rope_parameters``) or v4
        (``rope_theta`` + ``rope_scaling``, possibly with ``type`` for ``rope_type``)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Llama-family activation {act!r} is not supported; headlab "
                             "implements the SwiGLU MLP (hidden_act 'silu')")
        raw = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        partial = raw.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor {partial} is not supported: Llama "
                             "rotates the whole head dimension")
        rope = read_rope(hf)
        mistral = model_type == "mistral"
        window = hf.get("sliding_window", 4096) if mistral else None
        bias = not mistral and bool(hf.get("attention_bias", False))
        fields = shared_fields({"model_type": model_type, **hf})
        # transformers' LlamaConfig defaults, for a config.json that leaves them out
        fields.update(bos_token_id=hf.get("bos_token_id", 1),
                      eos_token_id=hf.get("eos_token_id", 2))
        return cls(
            **fields, norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6), act="silu",
            mlp_bias=not mistral and bool(hf.get("mlp_bias", False)),
            qkv_bias=bias, out_bias=bias,
            rope={"full_attention": rope, "sliding_attention": rope},
            layer_types=["sliding_attention"] * hf["num_hidden_layers"] if window else None,
            sliding_window=window,
        )


def weight_map(cfg: DecoderConfig) -> WeightMap:
    """The HF -> headlab names for ``cfg`` (biases only where it has them)."""
    per_layer = dict(_LAYER)
    if cfg.qkv_bias:
        per_layer.update(attention_biases("q_proj", "k_proj", "v_proj"))
    if cfg.out_bias:
        per_layer.update(attention_biases("o_proj"))
    if cfg.mlp_bias:
        per_layer.update(_MLP_BIAS)
    return WeightMap(per_layer=per_layer, single=SINGLE,
                     # old checkpoints saved the rotary frequencies; headlab recomputes them
                     ignore=(r"rotary_emb\.inv_freq$",),
                     optional=("^lm_head.weight",) if cfg.tie_word_embeddings else ())


class Llama(Decoder):
    """Llama-family causal language model: ``forward`` returns logits (B, S, V)."""

    family = "llama"
    config_class = LlamaConfig
    weight_map = staticmethod(weight_map)

    @property
    def hf_attention_bias_key(self) -> str | Absent:  # type: ignore[override]
        """HF Llama's switch for all four attention biases; HF Mistral has none."""
        if self.config.hf_config.get("model_type") == "mistral":
            return Absent("HF Mistral's attention has no biases, nor a key to add them")
        return "attention_bias"

    @classmethod
    def upgrade(cls, meta: dict[str, Any], state: dict[str, Any]
                ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A directory saved before Llama was a `Decoder`: its config (HF names, no
        ``norm_eps``) read as the config.json it stood for, and its block norms
        ``input_layernorm`` / ``post_attention_layernorm`` renamed."""
        old = meta["config"]
        if "rms_norm_eps" not in old:
            return meta, state
        # that Llama kept the biases it was given even with a window (a Mistral)
        config = replace(LlamaConfig.from_hf(_legacy_hf_config(old)),
                         qkv_bias=old["attention_bias"], out_bias=old["attention_bias"],
                         mlp_bias=old["mlp_bias"])
        renames = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
        pattern = re.compile(r"^(blocks\.\d+\.)(input_layernorm|post_attention_layernorm)\.")
        return ({**meta, "config": config.to_dict()},
                {pattern.sub(lambda m: m[1] + renames[m[2]] + ".", k): v
                 for k, v in state.items()})


def _legacy_hf_config(old: dict[str, Any]) -> dict[str, Any]:
    """The config.json that a saved config of the earlier Llama (HF field names, rope
    as ``rope_theta`` + ``rope_scaling``, a Mistral told by its window) stood for."""
    mistral = old.get("sliding_window") is not None
    rope = {"rope_type": "default", "rope_theta": old["rope_theta"],
            **(old.get("rope_scaling") or {})}
    kept = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    return {**kept, "model_type": "mistral" if mistral else "llama",
            "architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
            "hidden_act": "silu", "rope_parameters": rope}


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> Llama:
    """Build a Llama from an HF config dict and state dict (LlamaForCausalLM,
    MistralForCausalLM, or their bare ``model.`` backbones when embeddings are tied)."""
    return build(Llama, LlamaConfig.from_hf(hf_config), hf_state, prefixes=("model.", ""))


register(Llama, hf_types=MODEL_TYPES, from_hf=from_hf, read_config=LlamaConfig.from_hf,
         weight_map=weight_map)
