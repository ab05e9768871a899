"""A configurable decoder on headlab's attention: the blocks the Llama-like families
share, composed by a `DecoderConfig` instead of branching on the family.

The vocabulary (each family file reads its config.json into these fields):

* norms: ``rms`` (w * x / rms(x), as Llama), ``rms1p`` ((1 + w) * x / rms(x) in
  float32, as Gemma), ``layer`` (LayerNorm with bias, as GPT-NeoX);
* block: pre-norms before attention and MLP (``pre_norms``), norms on their outputs
  before the residual add (``post_norms``: OLMo-2 alone, Gemma with both), and the
  parallel residual x + attn(n1(x)) + mlp(n2(x)) (GPT-NeoX);
* attention (`headlab.attention.MultiHeadAttention` options): QK-norm per head or over
  the whole projection, logit soft-capping, a scale from ``query_pre_attn_scalar``,
  partial rotary (``rotary_dim`` < D), biases on Q/K/V and on W_O apart;
* layers: ``layer_types`` marks each layer ``full_attention`` or ``sliding_attention``
  (window ``sliding_window``), and ``rope`` gives each layer type its rotary frequencies;
* model: embeddings scaled by sqrt(E) in the model dtype, final logit soft-capping.

Names inside a block: ``attn_norm``, ``attn``, ``attn_post_norm``, ``mlp_norm``, ``mlp``,
``mlp_post_norm`` (absent norms are None); hooks as in every headlab model. The norms,
the MLP and the rotary embeddings come from `headlab.models.layers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from headlab.attention import MultiHeadAttention
from headlab.attention.hookpoint import HookPoint, run_hook
from headlab.attention.masks import Mask
from headlab.attention.rotary import RotaryEmbedding, check_rope
from headlab.errors import UserError
from headlab.models.base import BlockInputs, DecoderLM, FamilyConfig
from headlab.models.layers import ACTIVATIONS, MLP, NORMS, make_norm
from headlab.models.weights import WeightMap, convert_state_dict, load_into

LAYER_TYPES = ("full_attention", "sliding_attention")

# Checkpoint names the Llama-style families share (transformers' `*DecoderLayer`): the
# projections of attention and MLP, the QK norms, biases by projection, and the tensors
# outside the layers. Each family adds its norms (`WeightMap.per_layer` patterns).
PROJECTIONS = {
    f"layers.{{}}.{part}.{p}.weight": f"blocks.{{}}.{short}.{p}.weight"
    for part, short, names in (("self_attn", "attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                               ("mlp", "mlp", ("gate_proj", "up_proj", "down_proj")))
    for p in names
}
QK_NORM = {f"layers.{{}}.self_attn.{p}.weight": f"blocks.{{}}.attn.{p}.weight"
           for p in ("q_norm", "k_norm")}
SINGLE = {"embed_tokens.weight": "embed_tokens.weight", "norm.weight": "norm.weight",
          "^lm_head.weight": "lm_head.weight"}


def attention_biases(*names: str) -> dict[str, str]:
    """The checkpoint names of the biases of these attention projections."""
    return {f"layers.{{}}.self_attn.{p}.bias": f"blocks.{{}}.attn.{p}.bias" for p in names}


@dataclass
class DecoderConfig(FamilyConfig):
    """A decoder's structure in headlab's vocabulary (see the module docstring).

    ``rope`` maps each layer type to its rotary parameters (``rope_theta`` and, when
    scaled, ``rope_type`` with its keys); ``hf_config`` keeps the checkpoint's own
    config.json, which an export writes back with the pruned head counts.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    norm: str = "rms"
    norm_eps: float = 1e-6
    pre_norms: bool = True
    post_norms: bool = False
    parallel_residual: bool = False
    gated_mlp: bool = True
    act: str = "silu"
    mlp_bias: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: str | None = None  # None, "head" or "projection"
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None  # scale = its -1/2 power; None: D^-1/2
    embed_scale: bool = False
    rotary_dim: int | None = None  # None: the whole head
    rope: dict[str, dict[str, Any]] = field(default_factory=dict)
    layer_types: list[str] | None = None  # None: every layer full_attention
    sliding_window: int | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    hf_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        checks = [
            (self.norm in NORMS, f"norm {self.norm!r} is not one of {NORMS}"),
            (self.act in ACTIVATIONS, f"activation {self.act!r} is not one of "
                                      f"{sorted(ACTIVATIONS)}"),
            (self.qk_norm in (None, "head", "projection"),
             f"qk_norm {self.qk_norm!r} is not None, 'head' or 'projection'"),
            (self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
             f"num_key_value_heads ({self.num_key_value_heads})"),
            (len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries for "
             f"{self.num_hidden_layers} layers"),
            (set(self.layer_types) <= set(LAYER_TYPES),
             f"layer_types {sorted(set(self.layer_types))} are not all in {LAYER_TYPES}"),
            ("sliding_attention" not in self.layer_types or self.sliding_window,
             "sliding_attention layers need a sliding_window"),
            (self.rotary_dim is None or 0 < self.rotary_dim <= self.head_dim,
             f"rotary_dim {self.rotary_dim} must be in 1..{self.head_dim}"),
            ((self.rotary_dim or self.head_dim) % 2 == 0,
             f"rotary embeddings rotate pairs of dimensions: rotary_dim or head_dim must "
             f"be even, got {self.rotary_dim or self.head_dim}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for layer_type in sorted(set(self.layer_types)):
            problem = check_rope(self.layer_rope(layer_type))
            if problem:
                raise ValueError(f"{problem} ({layer_type} layers)")

    def layer_rope(self, layer_type: str) -> dict[str, Any]:
        """The rotary parameters of ``layer_type`` layers (the full-attention ones where
        the type has none of its own)."""
        return self.rope.get(layer_type) or self.rope.get("full_attention") or {}

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def read_rope(hf: dict, *, default_theta: float = 10000.0) -> dict[str, Any]:
    """One rotary parameter dict from an HF config: v5 ``rope_parameters`` or v4
    ``rope_theta`` + ``rope_scaling`` (``type`` read as ``rope_type``)."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", default_theta)))
    kind = rope.pop("type", None) or rope.get("rope_type", "default")
    rope["rope_type"] = kind
    rope.pop("partial_rotary_factor", None)
    if kind == "llama3":
        rope.setdefault("original_max_position_embeddings",
                        hf.get("max_position_embeddings", 2048))
    return rope


def sliding_layers(hf: dict) -> list[str] | None:
    """``layer_types`` from the config, else Qwen's rule: with ``use_sliding_window``,
    layers from ``max_window_layers`` on slide (as transformers' Qwen2/3 configs)."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    n = hf["num_hidden_layers"]
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return None
    first = hf.get("max_window_layers", n)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


def shared_fields(hf: dict, *, tie_default: bool = False) -> dict[str, Any]:
    """The fields every decoder's config.json gives, the required ones checked; the
    source config kept for export. Keys headlab does not use are ignored."""
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"{hf.get('model_type', 'decoder')} config.json lacks {missing}")
    heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", tie_default),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"), hf_config=dict(hf),
    )


def build(cls: type[Decoder], cfg: DecoderConfig, hf_state: dict[str, torch.Tensor], *,
          prefixes: tuple[str, ...]) -> Decoder:
    """``cls`` with the checkpoint's weights, every key used once (`convert_state_dict`)."""
    model = cls(cfg)
    state = convert_state_dict(hf_state, cls.weight_map(cfg), cfg.num_hidden_layers,
                               prefixes=prefixes)
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["embed_tokens.weight"])
    load_into(model, state, what=f"{cls.family} checkpoint")
    return model


# ---------------------------------------------------------------------- modules
class DecoderBlock(nn.Module):
    def __init__(self, cfg: DecoderConfig, kv_index: list[int] | None) -> None:
        super().__init__()
        if kv_index is None:
            n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        else:  # a pruned layer: its heads and groups come from the saved layout
            n_heads, n_kv = len(kv_index), (max(kv_index) + 1 if kv_index else 0)
        E, D = cfg.hidden_size, cfg.head_dim

        def norm(dim: int) -> nn.Module:
            return make_norm(cfg.norm, dim, cfg.norm_eps)

        q_norm = k_norm = None
        if cfg.qk_norm == "head":
            q_norm, k_norm = norm(D), norm(D)
        elif cfg.qk_norm == "projection":
            q_norm, k_norm = norm(n_heads * D), norm(n_kv * D)
        scalar = cfg.query_pre_attn_scalar
        self.attn_norm = norm(E) if cfg.pre_norms else None
        self.attn = MultiHeadAttention(
            d_model=E, n_heads=n_heads, n_kv_heads=n_kv, head_dim=D, bias=cfg.qkv_bias,
            out_bias=cfg.out_bias, scale=scalar**-0.5 if scalar else D**-0.5,
            kv_index=kv_index, q_norm=q_norm, k_norm=k_norm,
            qk_norm_scope=cfg.qk_norm or "head", softcap=cfg.attn_softcap,
        )
        self.attn.n_original_heads = cfg.num_attention_heads
        self.attn_post_norm = norm(E) if cfg.post_norms else None
        self.mlp_norm = norm(E) if cfg.pre_norms else None
        self.mlp = MLP(E, cfg.intermediate_size, gated=cfg.gated_mlp, act=cfg.act,
                       bias=cfg.mlp_bias)
        self.mlp_post_norm = norm(E) if cfg.post_norms else None
        self.parallel = cfg.parallel_residual
        self.resid_pre = HookPoint()  # (B, S, E)
        self.resid_mid = HookPoint()  # (B, S, E); not reached with a parallel residual
        self.resid_post = HookPoint()  # (B, S, E)

    def attention(self, x: torch.Tensor, mask: Mask, rotary, cache=None) -> torch.Tensor:
        """The attention sublayer's output before any post-norm (the ``out`` hook)."""
        h = self.attn_norm(x) if self.attn_norm is not None else x
        return self.attn(h, mask=mask, rotary=rotary, cache=cache)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp(self.mlp_norm(x) if self.mlp_norm is not None else x)
        return self.mlp_post_norm(m) if self.mlp_post_norm is not None else m

    def forward(self, x, mask: Mask, rotary, cache=None) -> torch.Tensor:
        x = run_hook(self.resid_pre, x)
        a = self.attention(x, mask, rotary, cache)
        if self.attn_post_norm is not None:
            a = self.attn_post_norm(a)
        if self.parallel:
            x = self._mlp(x) + a + x
        else:
            x = run_hook(self.resid_mid, x + a)
            x = x + self._mlp(x)
        return run_hook(self.resid_post, x)


class Decoder(DecoderLM):
    """A causal LM built from `DecoderConfig`; family files subclass it to name the
    family, its weight map and its export."""

    family = "decoder"
    config_class = DecoderConfig
    mlp_down: ClassVar[str] = "mlp.down_proj"

    def __init__(self, config: DecoderConfig, layout: list[list[int]] | None = None) -> None:
        """``layout``: each layer's kv_index list, for rebuilding a pruned model."""
        super().__init__(config)
        layout = layout or [None] * config.num_hidden_layers
        if len(layout) != config.num_hidden_layers:
            raise ValueError(
                f"layout has {len(layout)} layers, the config {config.num_hidden_layers}"
            )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        types = sorted(set(config.layer_types))
        dim = config.rotary_dim or config.head_dim
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(dim, config.layer_rope(t))
                                     for t in types})
        self.blocks = nn.ModuleList(DecoderBlock(config, kv) for kv in layout)
        self.norm = make_norm(config.norm, config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last block and ``lm_head``."""
        return self.norm

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def cap_logits(self, logits):
        """``cap * tanh(logits / cap)`` where the config sets ``final_softcap``."""
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def decode(self, input_ids, attention_mask, position_ids, past, cache):
        x, masks, rotary = self._embed(input_ids, attention_mask, position_ids, past)
        for i, block in enumerate(self.blocks):
            layer_cache = cache.layers[i] if cache is not None else None
            x = block(x, masks[self.config.window(i)],
                      rotary[self.config.layer_types[i]], layer_cache)
        return self.norm(x)

    def block_inputs(self, input_ids, attention_mask=None) -> BlockInputs:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x, masks, rotary = self._embed(input_ids, attention_mask, positions, 0)
        blocks, cfg = self.blocks, self.config
        return BlockInputs(
            x,
            block=lambda i, h: blocks[i](h, masks[cfg.window(i)], rotary[cfg.layer_types[i]]),
            attention=lambda i, h: blocks[i].attention(h, masks[cfg.window(i)],
                                                       rotary[cfg.layer_types[i]]),
        )

    def _embed(self, input_ids, attention_mask, position_ids, past):
        """The first block's input (B, S, E), a mask per window (None = full) and the
        rotary (cos, sin) per layer type, built once and shared by the blocks."""
        B, S = input_ids.shape
        x = self.embed_tokens(input_ids)  # (B, S, E)
        if self.config.embed_scale:  # sqrt(E) rounded to the model dtype, as Gemma
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        rotary = {t: rot(position_ids, x.dtype) for t, rot in self.rotary.items()}
        masks = {}
        for window in {self.config.window(i) for i in range(self.n_layers)}:
            # a window as long as every key cuts nothing: leave it out (SDPA's fast path)
            cut = window if window is not None and past + S > window else None
            masks[window] = Mask.build(
                batch=B, q_len=S, k_len=past + S, device=x.device, causal=True,
                key_padding_mask=attention_mask, window=cut,
            )
        return x, masks, rotary

    # ---------------------------------------------------------------- HF export
    hf_prefix: ClassVar[str] = "model."
    _hf_export_unsupported: ClassVar[str | None] = None  # a family without any export

    @property
    def hf_export_unsupported(self) -> str | None:  # type: ignore[override]
        """Why this model has no HF export: the family's reason, or a W_O bias that
        recovery added where the family's HF config has no switch for one."""
        if self._hf_export_unsupported or self.hf_attention_bias_key or self.config.out_bias:
            return self._hf_export_unsupported
        if any(a.o_proj.bias is not None for a in self.attentions):
            model_type = self.config.hf_config.get("model_type", self.family)
            return (f"recovery gave W_O a bias, which the HF {model_type} config cannot "
                    "hold; repair with --recover none or rescale to export")
        return None

    @staticmethod
    def weight_map(cfg: DecoderConfig) -> WeightMap:
        """The family's HF -> headlab names for ``cfg``."""
        raise NotImplementedError

    def to_hf(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """The source config.json with the pruned head counts, and the state dict under
        HF names (fused tensors fused again)."""
        cfg = self.config
        hf = dict(cfg.hf_config)
        # what is written is plain tensors, whatever the source held (a GGUF file's
        # quantisation, which transformers records in the config it reads from GGUF)
        hf.pop("quantization_config", None)
        hf.update(num_attention_heads=self.heads_per_layer[0],
                  num_key_value_heads=self.kv_heads_per_layer[0], head_dim=cfg.head_dim)
        state = {k: v for k, v in self.state_dict().items()
                 if not k.endswith(("head_ids", "kv_head_ids", "kv_index", "head_gate"))}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        if self.hf_export_unsupported:
            raise UserError(f"{self.family}: {self.hf_export_unsupported}")
        if not cfg.out_bias and any(a.o_proj.bias is not None for a in self.attentions):
            # HF turns on all attention biases at once: zeros leave the function as it is
            hf[self.hf_attention_bias_key] = True
            cfg = replace(cfg, qkv_bias=True, out_bias=True)
            for i, a in enumerate(self.attentions):
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    w = getattr(a, name).weight
                    state.setdefault(f"blocks.{i}.attn.{name}.bias", w.new_zeros(w.shape[0]))
        return hf, invert(state, self.weight_map(cfg), cfg.num_hidden_layers,
                          prefix=self.hf_prefix)


def invert(state: dict[str, torch.Tensor], wmap: WeightMap, n_layers: int, *,
           prefix: str) -> dict[str, torch.Tensor]:
    """headlab names back to HF names, split tensors concatenated again along dim 0
    (whatever their pruned sizes); for maps without transforms."""
    if wmap.transforms:
        raise ValueError("this weight map transforms tensors: invert it by hand")

    def hf_name(key: str) -> str:
        return key[1:] if key.startswith("^") else prefix + key

    out: dict[str, torch.Tensor] = {}
    for hf, hl in wmap.single.items():
        if hl in state:
            out[hf_name(hf)] = state[hl]
    for i in range(n_layers):
        for hf, hl in wmap.per_layer.items():
            if hl.format(i) in state:
                out[hf_name(hf.format(i))] = state[hl.format(i)]
        for hf, parts in (wmap.splits or {}).items():
            out[hf_name(hf.format(i))] = torch.cat([state[p.format(i)] for p in parts])
    return out
