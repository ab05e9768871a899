"""The layers around attention that the decoder families share: norms, the MLP, and
rotary position embeddings with every rope type headlab reads (one table); the
activations by their HF names, for the encoders too.

Shapes: B batch, S sequence, E model dim, F MLP width, D rotated head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("rms", "rms1p", "layer")
# by their HF names; "gelu" is the exact (erf) GELU, the others its tanh approximation
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_fast": lambda x: F.gelu(x, approximate="tanh")}
# rope_type -> the keys its parameters must hold besides rope_theta
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}


# ---------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """w * x / rms(x), computed in float32 and cast back, as HF Llama."""

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

    def gain(self) -> torch.Tensor:
        """The elementwise factor applied after x / rms(x) (E,)."""
        return self.weight

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: (1 + w) * x / rms(x), all in float32, cast back at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def gain(self) -> torch.Tensor:
        return 1.0 + self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """A norm of ``kind`` (one of `NORMS`) over the last ``dim`` features."""
    if kind == "rms":
        return RMSNorm(dim, eps)
    if kind == "rms1p":
        return OffsetRMSNorm(dim, eps)
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"norm {kind!r} is not one of {NORMS}")


# ---------------------------------------------------------------------- MLP
class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)) (SwiGLU, GeGLU); plain: down(act(up(x)))."""

    def __init__(self, hidden: int, intermediate: int, *, gated: bool, act: str,
                 bias: bool) -> None:
        super().__init__()
        E, F_ = hidden, intermediate
        self.gate_proj = nn.Linear(E, F_, bias=bias) if gated else None
        self.up_proj = nn.Linear(E, F_, bias=bias)
        self.down_proj = nn.Linear(F_, E, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))  # (B, S, E)
        gate = self.gate_proj(x)  # (B, S, F)
        if gate.requires_grad or self.gate_proj._forward_hooks:
            return self.down_proj(self.act(gate) * self.up_proj(x))
        # no autograd to keep it for and no hook holding it: work in gate's memory, one
        # (B, S, F) tensor fewer to allocate and stream through per layer
        h = F.silu(gate, inplace=True) if self.act is F.silu else self.act(gate)
        return self.down_proj(h.mul_(self.up_proj(x)))


# ---------------------------------------------------------------------- rotary
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
