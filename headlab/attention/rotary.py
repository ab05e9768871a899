"""Rotary position embeddings: the inverse frequencies of every rope type headlab reads
(one table), the (cos, sin) of given positions, and their application to queries and keys.

Shapes: B batch, H heads, S sequence, D (rotated) head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# rope_type -> the keys its parameters must hold besides rope_theta
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotary position embedding, half-split convention (as HF Llama after conversion).

    x: (B, H, S, D); cos, sin: (B|1, S, D_rot). With D_rot < D (partial rotary, as
    GPT-NeoX's ``rotary_pct`` and Phi's ``partial_rotary_factor``) the first D_rot dims
    of each head turn and the rest pass through.
    """
    D_rot = cos.shape[-1]
    if D_rot < x.shape[-1]:  # partial rotary: only the first D_rot dims turn
        return torch.cat((apply_rotary(x[..., :D_rot], cos, sin), x[..., D_rot:]), dim=-1)
    cos = cos[:, None]  # (B|1, 1, S, D)
    sin = sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # in rotated's own memory: autograd keeps neither it nor x for these products
    # (cos and sin are constants), and a + b == b + a bit for bit
    return rotated.mul_(sin).add_(x * cos)


def check_rope(rope: dict[str, Any]) -> str | None:
    """Why headlab cannot rotate with these parameters (None: it can)."""
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        return f"rope_type {kind!r} is not supported; headlab supports {sorted(ROPE_TYPES)}"
    missing = [k for k in ROPE_TYPES[kind] if k not in rope]
    return f"rope of type {kind!r} lacks {missing}: got {rope}" if missing else None


def rope_inv_freq(dim: int, rope: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies (D/2,) in float32 for ``dim`` = D rotated dimensions, as
    transformers' rope init functions; ``rope``: ``rope_theta``, ``rope_type`` and its
    keys (`ROPE_TYPES`)."""
    theta = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    # llama3: long wavelengths slowed by `factor`, short kept, the middle interpolated
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
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

    def __init__(self, dim: int, rope: dict[str, Any]) -> None:
        super().__init__()
        problem = check_rope(rope)
        if problem:
            raise ValueError(problem)
        self._inv_freq = rope_inv_freq(dim, rope)  # (D/2,) float32

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B|1, S) -> cos, sin each (B|1, S, D) in ``dtype``."""
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self._inv_freq  # (B|1, S, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B|1, S, D), half-split convention
        return emb.cos().to(dtype), emb.sin().to(dtype)
