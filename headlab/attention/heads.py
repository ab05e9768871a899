"""A layer's heads: which key/value head each query head reads, and the cutting of its
projections down to the heads it keeps (the feature indices of head positions, Linear
layers and projection-wide norms sliced to them, for `MultiHeadAttention.prune_heads`)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.utils import skip_init


def group_index(n_heads: int, n_kv_heads: int, kv_index: Iterable[int] | None
                ) -> torch.Tensor:
    """The key/value head of each query head (H,): equal contiguous groups by default,
    or ``kv_index`` checked (a layout left uneven by pruning)."""
    if kv_index is None:
        if n_heads < 1 or n_kv_heads < 1:
            raise ValueError(
                f"n_heads ({n_heads}) and n_kv_heads ({n_kv_heads}) must be >= 1"
            )
        if n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})"
            )
        return torch.arange(n_kv_heads).repeat_interleave(n_heads // n_kv_heads)
    index = torch.as_tensor(kv_index, dtype=torch.long)
    if index.shape != (n_heads,) or (n_heads and set(index.tolist()) != set(range(n_kv_heads))):
        raise ValueError(
            f"kv_index must map each of the {n_heads} query heads to one of the "
            f"{n_kv_heads} key/value heads, each used at least once; got {index.tolist()}"
        )
    return index


def head_rows(heads: list[int], head_dim: int, device) -> torch.Tensor:
    """Feature indices of the given head positions: [h*D, ..., h*D + D-1] each."""
    if not heads:
        return torch.zeros(0, dtype=torch.long, device=device)
    h = torch.tensor(heads, dtype=torch.long, device=device)
    return (h[:, None] * head_dim + torch.arange(head_dim, device=device)).reshape(-1)


def linear(in_features: int, out_features: int, *, bias: bool, init: bool = True,
           cls: type[nn.Linear] = nn.Linear, **factory) -> nn.Linear:
    """A ``cls`` (nn.Linear); ``init=False`` leaves its weight uninitialised, to be copied
    into. Quiet where a layer has no heads left: torch warns that initialising a
    zero-size weight does nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*zero-element tensors.*")
        if init:
            return cls(in_features, out_features, bias=bias, **factory)
        return skip_init(cls, in_features, out_features, bias=bias, **factory)


def slice_linear(lin: nn.Linear, index: torch.Tensor, *, dim: int) -> nn.Linear:
    """A new Linear keeping ``index`` of the output (dim=0) or input (dim=1) features."""
    w = lin.weight.detach().index_select(dim, index)
    bias = lin.bias
    new_bias = None
    if bias is not None:
        new_bias = bias.detach().index_select(0, index) if dim == 0 else bias.detach()
    new = linear(w.shape[1], w.shape[0], bias=bias is not None, init=False, cls=type(lin),
                 device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if new_bias is not None:
            new.bias.copy_(new_bias)
    new.weight.requires_grad_(lin.weight.requires_grad)
    return new


def slice_norm(norm: nn.Module | None, index: torch.Tensor) -> None:
    """Keep ``index`` of a projection-wide norm's weight (and bias), in place."""
    if norm is None:
        return
    for name in ("weight", "bias"):
        p = getattr(norm, name, None)
        if isinstance(p, nn.Parameter):
            setattr(norm, name, nn.Parameter(p.detach().index_select(0, index),
                                             requires_grad=p.requires_grad))
