"""Llama family on headlab's attention: Llama 2/3, SmolLM2, TinyLlama, Mistral.

Pre-norm decoder with RMSNorm: x + attn(norm(x)), then x + mlp(norm(x)) with a SwiGLU
MLP; rotary positions (half-split) applied to Q and K; grouped-query attention (H_kv
key/value heads shared by groups of query heads). Mistral adds a sliding window: each
query sees only its last ``sliding_window`` keys. HF names are kept for the
submodules, so the weight mapping is a plain renaming of ``model.layers.{i}``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headlab.attention import MultiHeadAttention
from headlab.hookpoint import HookPoint, run_hook
from headlab.masks import Mask
from headlab.models.base import (
    BlockInputs,
    DecoderLM,
    FamilyConfig,
    WeightMap,
    convert_state_dict,
    invert_state_dict,
    load_into,
)
from headlab.models.registry import register

MODEL_TYPES = ("llama", "mistral")

# rope_type -> the keys its parameters must hold (besides rope_theta)
_ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass
class LlamaConfig(FamilyConfig):
    """Llama/Mistral hyperparameters, named as in HF's config.json.

    ``rope_scaling`` holds the scaled-RoPE parameters (``rope_type`` and its keys),
    or None for plain RoPE; ``sliding_window`` is Mistral's window (None = off).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: same as num_attention_heads (MHA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            _check_rope(self.rope_scaling)

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """Read an HF config dict: transformers v5 (``rope_parameters``) or v4
        (``rope_theta`` + ``rope_scaling``, possibly with ``type`` for ``rope_type``)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(
                f"Llama-family activation {act!r} is not supported; headlab implements "
                "the SwiGLU MLP (hidden_act 'silu')"
            )
        # as transformers does: rope_scaling (v4) wins over rope_parameters (v5), and
        # a top-level rope_theta fills in when the dict has none
        rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ValueError(
                f"partial_rotary_factor {partial} is not supported: headlab rotates the "
                "whole head dimension"
            )
        if rope_type == "llama3":
            rope.setdefault(
                "original_max_position_embeddings", hf.get("max_position_embeddings", 2048)
            )
        scaling = None if rope_type == "default" else {"rope_type": rope_type, **rope}

        kw = cls.known(hf)
        kw.update(rope_theta=theta, rope_scaling=scaling)
        # Only Mistral reads sliding_window (its default is 4096); Llama ignores it.
        if model_type == "mistral":
            kw["sliding_window"] = hf.get("sliding_window", 4096)
        else:
            kw.pop("sliding_window", None)
        return cls(**kw)


def _check_rope(scaling: dict[str, Any]) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type not in _ROPE_TYPES or rope_type == "default":
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; headlab supports plain RoPE and "
            f"the scaled types {sorted(set(_ROPE_TYPES) - {'default'})}"
        )
    missing = [k for k in _ROPE_TYPES[rope_type] if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}: got {scaling}")


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) in float32, as transformers' rope init functions."""
    D = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)
    )
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3: long wavelengths slowed by `factor`, short kept, the middle interpolated
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """(cos, sin) for given positions, computed once per forward and shared by layers.

    The inverse frequencies are kept in float32 off the state dict (not a buffer), so
    casting the model to half precision does not round them.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self._inv_freq = rope_inv_freq(cfg)  # (D/2,) float32

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B|1, S) -> cos, sin each (B|1, S, D) in ``dtype``."""
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self._inv_freq  # (B|1, S, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B|1, S, D), half-split convention
        return emb.cos().to(dtype), emb.sin().to(dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back, as HF Llama."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the fused kernel; bit-identical to the lines below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        E, F_ = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(E, F_, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(E, F_, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(F_, E, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)  # (B, S, F)
        if gate.requires_grad or self.gate_proj._forward_hooks:
            return self.down_proj(F.silu(gate) * self.up_proj(x))
        # no autograd to keep it for and no hook holding it: work in gate's memory, one
        # (B, S, F) tensor fewer to allocate and stream through per layer
        return self.down_proj(F.silu(gate, inplace=True).mul_(self.up_proj(x)))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, kv_index: list[int] | None) -> None:
        super().__init__()
        if kv_index is None:
            n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        else:  # a pruned layer: its heads and groups come from the saved layout
            n_heads, n_kv = len(kv_index), (max(kv_index) + 1 if kv_index else 0)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MultiHeadAttention(
            d_model=cfg.hidden_size, n_heads=n_heads, n_kv_heads=n_kv, head_dim=cfg.head_dim,
            bias=cfg.attention_bias, out_bias=cfg.attention_bias, scale=cfg.head_dim**-0.5,
            kv_index=kv_index,
        )
        self.attn.n_original_heads = cfg.num_attention_heads
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        self.resid_pre = HookPoint()  # (B, S, E)
        self.resid_mid = HookPoint()  # (B, S, E)
        self.resid_post = HookPoint()  # (B, S, E)

    def forward(self, x, mask: Mask, rotary, cache=None) -> torch.Tensor:
        x = run_hook(self.resid_pre, x)
        x = x + self.attn(self.input_layernorm(x), mask=mask, rotary=rotary, cache=cache)
        x = run_hook(self.resid_mid, x)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return run_hook(self.resid_post, x)


class Llama(DecoderLM):
    """Llama-family causal language model: ``forward`` returns logits (B, S, V)."""

    family = "llama"
    mlp_down = "mlp.down_proj"
    config_class = LlamaConfig

    def __init__(self, config: LlamaConfig, layout: list[list[int]] | None = None) -> None:
        """``layout``: each layer's kv_index list, for rebuilding a pruned model."""
        super().__init__(config)
        layout = layout or [None] * config.num_hidden_layers
        if len(layout) != config.num_hidden_layers:
            raise ValueError(
                f"layout has {len(layout)} layers, the config {config.num_hidden_layers}"
            )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.blocks = nn.ModuleList(LlamaBlock(config, kv) for kv in layout)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last block and the unembedding (logit attribution)."""
        return self.norm

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def decode(self, input_ids, attention_mask, position_ids, past, cache):
        x, mask, rotary = self._embed(input_ids, attention_mask, position_ids, past)
        for i, block in enumerate(self.blocks):
            x = block(x, mask, rotary, cache.layers[i] if cache is not None else None)
        return self.norm(x)

    def block_inputs(self, input_ids, attention_mask=None) -> BlockInputs:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x, mask, rotary = self._embed(input_ids, attention_mask, positions, 0)
        blocks = self.blocks
        return BlockInputs(
            x, block=lambda i, h: blocks[i](h, mask, rotary),
            attention=lambda i, h: blocks[i].attn(blocks[i].input_layernorm(h), mask=mask,
                                                  rotary=rotary),
        )

    def _embed(self, input_ids, attention_mask, position_ids, past):
        """The first block's input (B, S, E), the mask and the rotary (cos, sin) that
        every block shares."""
        B, S = input_ids.shape
        x = self.embed_tokens(input_ids)  # (B, S, E)
        rotary = self.rotary(position_ids, x.dtype)  # cos, sin: (B|1, S, D)
        # a window as long as every key cuts nothing: leave it out to keep SDPA's fast path
        window = self.config.sliding_window
        if window is not None and past + S <= window:
            window = None
        mask = Mask.build(
            batch=B, q_len=S, k_len=past + S, device=x.device, causal=self.causal,
            key_padding_mask=attention_mask, window=window,
        )
        return x, mask, rotary

    # ---------------------------------------------------------------- HF export
    hf_export_unsupported = None  # whole, equal GQA groups export as they are
    hf_attention_bias_key = "attention_bias"

    def to_hf(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """An HF config dict and state dict for a (uniformly pruned) Llama/Mistral.

        HF Llama takes ``head_dim`` apart from ``hidden_size / num_attention_heads`` and
        groups query heads contiguously per key/value head, so a model whose layers keep
        the same number of heads and whole, equal groups is expressible as it is
        (`headlab.models.export.hf_expressible` checks that before calling this).
        """
        cfg = self.config
        mistral = cfg.sliding_window is not None
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling:
            rope.update(cfg.rope_scaling)
        hf = {
            "model_type": "mistral" if mistral else "llama",
            "architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": self.heads_per_layer[0],
            "num_key_value_heads": self.kv_heads_per_layer[0],
            "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "rope_parameters": rope, "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
        }
        if mistral:
            hf["sliding_window"] = cfg.sliding_window
        state = {k: v for k, v in self.state_dict().items()
                 if not k.endswith(("head_ids", "kv_head_ids", "kv_index", "head_gate"))}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        if not cfg.attention_bias and any(a.o_proj.bias is not None for a in self.attentions):
            # a W_O bias that recovery added: HF Llama has one only with attention_bias,
            # which gives Q, K and V biases too; zeros leave the function as it is
            hf["attention_bias"] = True
            cfg = replace(cfg, attention_bias=True)
            state.update(self._zero_biases())
        return hf, invert_state_dict(state, weight_map(cfg), cfg.num_hidden_layers,
                                     prefix="model.")

    def _zero_biases(self) -> dict[str, torch.Tensor]:
        """Zero Q/K/V biases for every layer, and zero W_O biases where none was added."""
        out = {}
        for i, a in enumerate(self.attentions):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                lin = getattr(a, name)
                if lin.bias is None:
                    w = lin.weight
                    out[f"blocks.{i}.attn.{name}.bias"] = w.new_zeros(w.shape[0])
        return out


# ---------------------------------------------------------------------- conversion
_LAYER = {
    "layers.{}.self_attn.q_proj.weight": "blocks.{}.attn.q_proj.weight",
    "layers.{}.self_attn.k_proj.weight": "blocks.{}.attn.k_proj.weight",
    "layers.{}.self_attn.v_proj.weight": "blocks.{}.attn.v_proj.weight",
    "layers.{}.self_attn.o_proj.weight": "blocks.{}.attn.o_proj.weight",
    "layers.{}.mlp.gate_proj.weight": "blocks.{}.mlp.gate_proj.weight",
    "layers.{}.mlp.up_proj.weight": "blocks.{}.mlp.up_proj.weight",
    "layers.{}.mlp.down_proj.weight": "blocks.{}.mlp.down_proj.weight",
    "layers.{}.input_layernorm.weight": "blocks.{}.input_layernorm.weight",
    "layers.{}.post_attention_layernorm.weight": "blocks.{}.post_attention_layernorm.weight",
}
_ATTN_BIAS = {
    f"layers.{{}}.self_attn.{p}.bias": f"blocks.{{}}.attn.{p}.bias"
    for p in ("q_proj", "k_proj", "v_proj", "o_proj")
}
_MLP_BIAS = {
    f"layers.{{}}.mlp.{p}.bias": f"blocks.{{}}.mlp.{p}.bias"
    for p in ("gate_proj", "up_proj", "down_proj")
}
_SINGLE = {
    "embed_tokens.weight": "embed_tokens.weight",
    "norm.weight": "norm.weight",
    "^lm_head.weight": "lm_head.weight",
}


def weight_map(cfg: LlamaConfig) -> WeightMap:
    """The HF -> headlab names for this config (biases only where the config has them)."""
    per_layer = dict(_LAYER)
    if cfg.attention_bias:
        per_layer.update(_ATTN_BIAS)
    if cfg.mlp_bias:
        per_layer.update(_MLP_BIAS)
    return WeightMap(
        per_layer=per_layer,
        single=_SINGLE,
        # old checkpoints saved the rotary frequencies; headlab recomputes them
        ignore=(r"rotary_emb\.inv_freq$",),
        optional=("^lm_head.weight",) if cfg.tie_word_embeddings else (),
    )


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> Llama:
    """Build a Llama from an HF config dict and state dict (LlamaForCausalLM,
    MistralForCausalLM, or their bare ``model.`` backbones when embeddings are tied)."""
    cfg = LlamaConfig.from_hf(hf_config)
    model = Llama(cfg)
    state = convert_state_dict(
        hf_state, weight_map(cfg), cfg.num_hidden_layers, prefixes=("model.", "")
    )
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["embed_tokens.weight"])
    load_into(model, state, what=f"{hf_config.get('model_type', 'llama')} checkpoint")
    return model


register(Llama, hf_types=MODEL_TYPES, from_hf=from_hf, read_config=LlamaConfig.from_hf,
         weight_map=weight_map)
