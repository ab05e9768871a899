"""GPT-NeoX / Pythia on headlab's decoder.

LayerNorm (with bias) before attention and MLP, joined by the parallel residual
x + attn(ln1(x)) + mlp(ln2(x)) (``use_parallel_residual``; sequential otherwise), a
plain GELU MLP, biases everywhere, rotary on the first ``rotary_pct`` of each head's
dims. The checkpoint fuses Q, K and V per head (``query_key_value`` rows: head 0's q,
k, v, head 1's q, k, v, ...): the weight map regroups and splits them, and export
interleaves them again. HF derives the head size from hidden_size / heads, so a pruned
GPT-NeoX has no HF config (headlab's own format keeps it).
"""

from __future__ import annotations

import torch

from headlab.models.decoder import Decoder, DecoderConfig, build, read_rope, shared_fields
from headlab.models.registry import register
from headlab.models.weights import WeightMap

MODEL_TYPES = ("gpt_neox",)

_LAYER = {
    "layers.{}.attention.dense.weight": "blocks.{}.attn.o_proj.weight",
    "layers.{}.mlp.dense_h_to_4h.weight": "blocks.{}.mlp.up_proj.weight",
    "layers.{}.mlp.dense_4h_to_h.weight": "blocks.{}.mlp.down_proj.weight",
    "layers.{}.mlp.dense_h_to_4h.bias": "blocks.{}.mlp.up_proj.bias",
    "layers.{}.mlp.dense_4h_to_h.bias": "blocks.{}.mlp.down_proj.bias",
    "layers.{}.input_layernorm.weight": "blocks.{}.attn_norm.weight",
    "layers.{}.input_layernorm.bias": "blocks.{}.attn_norm.bias",
    "layers.{}.post_attention_layernorm.weight": "blocks.{}.mlp_norm.weight",
    "layers.{}.post_attention_layernorm.bias": "blocks.{}.mlp_norm.bias",
}
_QKV = "layers.{}.attention.query_key_value.{}"
_SINGLE = {"embed_in.weight": "embed_tokens.weight",
           "final_layer_norm.weight": "norm.weight", "final_layer_norm.bias": "norm.bias",
           "^embed_out.weight": "lm_head.weight"}


def _by_kind(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (H, 3, D, ...) per head -> (3, H, D, ...): all q rows, all k rows, all v rows."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _by_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _weight_map(cfg: DecoderConfig) -> WeightMap:
    per_layer = dict(_LAYER)
    splits = {_QKV.format("{}", "weight"): tuple(f"blocks.{{}}.attn.{p}_proj.weight"
                                                 for p in "qkv")}
    if cfg.qkv_bias:
        per_layer.update({"layers.{}.attention.dense.bias": "blocks.{}.attn.o_proj.bias"})
        splits[_QKV.format("{}", "bias")] = tuple(f"blocks.{{}}.attn.{p}_proj.bias"
                                                  for p in "qkv")
    H = cfg.num_attention_heads
    return WeightMap(
        per_layer=per_layer, single=_SINGLE, splits=splits,
        transforms={r".*query_key_value\.(weight|bias)": lambda t: _by_kind(t, H)},
        # old checkpoints saved the causal mask and rotary frequencies as buffers
        ignore=(r"attention\.(bias|masked_bias)$", r"rotary_emb\.inv_freq$"),
        optional=("^embed_out.weight",) if cfg.tie_word_embeddings else (),
    )


def read_config(hf: dict) -> DecoderConfig:
    if hf.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"model_type {hf.get('model_type')!r} is not one of {MODEL_TYPES}")
    fields = shared_fields(hf)
    fields["num_key_value_heads"] = fields["num_attention_heads"]
    fields["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    params = hf.get("rope_parameters") or {}
    pct = float(params.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)))
    rope = read_rope(hf, default_theta=float(hf.get("rotary_emb_base", 10000.0)))
    rotary_dim = int(fields["head_dim"] * pct)
    bias = bool(hf.get("attention_bias", True))
    return DecoderConfig(
        **fields, norm="layer", norm_eps=hf.get("layer_norm_eps", 1e-5),
        parallel_residual=bool(hf.get("use_parallel_residual", True)), gated_mlp=False,
        act=hf.get("hidden_act", "gelu"), mlp_bias=True, qkv_bias=bias, out_bias=bias,
        rotary_dim=None if rotary_dim == fields["head_dim"] else rotary_dim,
        rope={"full_attention": rope},
    )


class GPTNeoX(Decoder):
    """GPT-NeoX / Pythia: ``forward`` returns logits (B, S, V)."""

    family = "gpt_neox"
    weight_map = staticmethod(_weight_map)
    hf_prefix = "gpt_neox."
    hf_attention_bias_key = "attention_bias"
    _hf_export_unsupported = ("HF GPT-NeoX derives the head size from hidden_size / "
                             "num_attention_heads, so fewer heads do not fit its config")


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> GPTNeoX:
    cfg = read_config(hf_config)
    if "lm_head.weight" in hf_state:  # transformers v5 names the unembedding lm_head
        hf_state = dict(hf_state)
        hf_state["embed_out.weight"] = hf_state.pop("lm_head.weight")
    return build(GPTNeoX, cfg, hf_state, prefixes=("gpt_neox.", ""))


register(GPTNeoX, hf_types=MODEL_TYPES, from_hf=from_hf)
