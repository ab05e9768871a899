"""GPT-2 on headlab's attention: config, blocks, and the weight mapping from HF GPT-2.

Pre-norm decoder: x + attn(ln_1(x)), then x + mlp(ln_2(x)); learned positions; the LM
head is tied to the token embedding. HF stores its linear layers as Conv1D (in, out),
so those weights are transposed on load; the fused c_attn is split into Q, K, V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from headlab.attention import MultiHeadAttention
from headlab.attention.hookpoint import HookPoint, run_hook
from headlab.attention.masks import Mask
from headlab.models.base import BlockInputs, DecoderLM, FamilyConfig
from headlab.models.registry import register
from headlab.models.weights import WeightMap, convert_state_dict, load_into

MODEL_TYPES = ("gpt2",)

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


@dataclass
class GPT2Config(FamilyConfig):
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256

    @classmethod
    def from_hf(cls, hf: dict) -> GPT2Config:
        if hf.get("activation_function", "gelu_new") not in _ACTIVATIONS:
            raise ValueError(
                f"GPT-2 activation {hf['activation_function']!r} is not supported; "
                f"supported: {sorted(_ACTIVATIONS)}"
            )
        # reorder_and_upcast_attn only upcasts: headlab always computes scores in float32
        return cls(**cls.known(hf))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.fc = nn.Linear(cfg.n_embd, inner)
        self.proj = nn.Linear(inner, cfg.n_embd)
        self.act = _ACTIVATIONS[cfg.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int, kv_index: list[int] | None) -> None:
        super().__init__()
        head_dim = cfg.n_embd // cfg.n_head
        scale = head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        n_heads = cfg.n_head if kv_index is None else len(kv_index)
        self.attn = MultiHeadAttention(
            d_model=cfg.n_embd, n_heads=n_heads, n_kv_heads=n_heads, head_dim=head_dim,
            bias=True, scale=scale, kv_index=kv_index,
        )
        self.attn.n_original_heads = cfg.n_head
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)
        self.resid_pre = HookPoint()  # (B, S, E)
        self.resid_mid = HookPoint()  # (B, S, E)
        self.resid_post = HookPoint()  # (B, S, E)

    def forward(self, x, mask: Mask, cache=None) -> torch.Tensor:
        x = run_hook(self.resid_pre, x)
        x = x + self.attn(self.ln_1(x), mask=mask, cache=cache)
        x = run_hook(self.resid_mid, x)
        x = x + self.mlp(self.ln_2(x))
        return run_hook(self.resid_post, x)


class GPT2(DecoderLM):
    """GPT-2 causal language model: ``forward`` returns logits (B, S, V)."""

    family = "gpt2"
    mlp_down = "mlp.proj"
    config_class = GPT2Config
    # why `--export hf` keeps the headlab format (headlab.models.export): a pruned layer
    # has fewer heads of the same size, which the HF config cannot say
    hf_export_unsupported = (
        "HF GPT-2 derives the head size from n_embd / n_head, so a layer with fewer heads "
        "has no HF config"
    )

    def __init__(self, config: GPT2Config, layout: list[list[int]] | None = None) -> None:
        """``layout``: each layer's kv_index list, for rebuilding a pruned model."""
        super().__init__(config)
        layout = layout or [None] * config.n_layer
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.blocks = nn.ModuleList(GPT2Block(config, i, kv) for i, kv in enumerate(layout))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in HF GPT-2

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last block and the unembedding (logit attribution)."""
        return self.ln_f

    @property
    def max_positions(self) -> int:
        return self.config.n_positions

    def decode(self, input_ids, attention_mask, position_ids, past, cache):
        x, mask = self._embed(input_ids, attention_mask, position_ids, past)
        for i, block in enumerate(self.blocks):
            x = block(x, mask, cache.layers[i] if cache is not None else None)
        return self.ln_f(x)

    def block_inputs(self, input_ids, attention_mask=None) -> BlockInputs:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x, mask = self._embed(input_ids, attention_mask, positions, 0)
        blocks = self.blocks
        return BlockInputs(
            x, block=lambda i, h: blocks[i](h, mask),
            attention=lambda i, h: blocks[i].attn(blocks[i].ln_1(h), mask=mask),
        )

    def _embed(self, input_ids, attention_mask, position_ids, past) -> tuple[torch.Tensor, Mask]:
        """The first block's input (B, S, E) and the mask every block shares."""
        B, S = input_ids.shape
        if past + S > self.config.n_positions:
            raise ValueError(
                f"sequence of {past + S} tokens exceeds GPT-2's {self.config.n_positions} "
                "positions; truncate the input or use shorter blocks"
            )
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, S, E)
        mask = Mask.build(
            batch=B, q_len=S, k_len=past + S, device=x.device, causal=self.causal,
            key_padding_mask=attention_mask,
        )
        return x, mask


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()


WEIGHTS = WeightMap(
    per_layer={
        "h.{}.ln_1.weight": "blocks.{}.ln_1.weight",
        "h.{}.ln_1.bias": "blocks.{}.ln_1.bias",
        "h.{}.attn.c_proj.weight": "blocks.{}.attn.o_proj.weight",
        "h.{}.attn.c_proj.bias": "blocks.{}.attn.o_proj.bias",
        "h.{}.ln_2.weight": "blocks.{}.ln_2.weight",
        "h.{}.ln_2.bias": "blocks.{}.ln_2.bias",
        "h.{}.mlp.c_fc.weight": "blocks.{}.mlp.fc.weight",
        "h.{}.mlp.c_fc.bias": "blocks.{}.mlp.fc.bias",
        "h.{}.mlp.c_proj.weight": "blocks.{}.mlp.proj.weight",
        "h.{}.mlp.c_proj.bias": "blocks.{}.mlp.proj.bias",
    },
    splits={
        "h.{}.attn.c_attn.weight": (
            "blocks.{}.attn.q_proj.weight", "blocks.{}.attn.k_proj.weight",
            "blocks.{}.attn.v_proj.weight",
        ),
        "h.{}.attn.c_attn.bias": (
            "blocks.{}.attn.q_proj.bias", "blocks.{}.attn.k_proj.bias",
            "blocks.{}.attn.v_proj.bias",
        ),
    },
    single={
        "wte.weight": "wte.weight",
        "wpe.weight": "wpe.weight",
        "ln_f.weight": "ln_f.weight",
        "ln_f.bias": "ln_f.bias",
        "^lm_head.weight": "lm_head.weight",
    },
    # HF Conv1D layers store (in, out): these are the transposed weights.
    transforms={r".*\.(c_attn|c_proj|c_fc)\.weight": _t},
    ignore=(r"\.attn\.(masked_)?bias$",),
    optional=("^lm_head.weight",),
)


def from_hf(hf_config: dict, hf_state: dict[str, torch.Tensor], *, path=None) -> GPT2:
    """Build a GPT2 from an HF config dict and state dict (GPT2Model or GPT2LMHeadModel)."""
    cfg = GPT2Config.from_hf(hf_config)
    model = GPT2(cfg)
    state = convert_state_dict(hf_state, WEIGHTS, cfg.n_layer, prefixes=("transformer.", ""))
    state.setdefault("lm_head.weight", state["wte.weight"])
    load_into(model, state, what="GPT-2 checkpoint")
    return model


register(GPT2, hf_types=MODEL_TYPES, from_hf=from_hf)
