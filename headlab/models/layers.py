"""The layers around attention that the decoder families share: norms and the MLP; the
activations by their HF names, for the encoders too (rotary position embeddings are in
`headlab.attention.rotary`).

Shapes: B batch, S sequence, E model dim, F MLP width, D rotated head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("rms", "rms1p", "layer")
# by their HF names; "gelu" is the exact (erf) GELU, the others its tanh approximation
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_fast": lambda x: F.gelu(x, approximate="tanh")}


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
