"""Attention rollout (Abnar & Zuidema 2020): the layers' attention composed into flows.

Attention of one layer says where a position reads from in the layer below; multiplying
the layers, with the residual stream added, says how much of each output position comes
from each input token. Shapes use the notation of headlab.analysis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from ._checks import _as_layers, _check_square

__all__ = ["rollout"]


def rollout(
    patterns: Sequence[Tensor] | Tensor,
    *,
    add_residual: bool = True,
    head_fusion: Literal["mean", "max", "min"] = "mean",
    valid: Tensor | None = None,
) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020): (B, S, S) flow from input tokens.

    Per layer the heads are fused (mean, max or min over heads), the residual stream is
    added as A' = 0.5 * A + 0.5 * I, rows are renormalised, and the layers are multiplied
    in order: R = A'_L @ ... @ A'_1. Row i of R says how much of output position i comes
    from each input token. With ``valid`` (B, S), padding gets no flow and its rows are 0.
    Computed in float64, returned in the patterns' dtype (at least float32).
    """
    if head_fusion not in ("mean", "max", "min"):
        raise ValueError(f"head_fusion must be 'mean', 'max' or 'min'; got {head_fusion!r}.")
    layers = _as_layers(patterns)
    first = layers[0]
    for layer, pattern in enumerate(layers):
        _check_square(pattern, f"patterns[{layer}]")
        if (pattern.shape[0], pattern.shape[2]) != (first.shape[0], first.shape[2]):
            raise ValueError(
                f"patterns[{layer}] has shape {tuple(pattern.shape)} but patterns[0] has "
                f"{tuple(first.shape)}; every layer must cover the same (B, S)."
            )
    n_batch, length = first.shape[0], first.shape[2]
    pair = None
    if valid is not None:
        mask = torch.as_tensor(valid, dtype=torch.bool, device=first.device)
        if mask.shape != (n_batch, length):
            raise ValueError(
                f"valid has shape {tuple(mask.shape)}; expected (B, S) = {(n_batch, length)}."
            )
        pair = mask[:, :, None] & mask[:, None, :]  # (B, S, S)
    eye = torch.eye(length, dtype=torch.float64, device=first.device)  # (S, S)
    flow = None
    for pattern in layers:
        p = pattern.to(torch.float64)  # (B, H, S, S)
        if head_fusion == "mean":
            a = p.mean(dim=1)  # (B, S, S)
        elif head_fusion == "max":
            a = p.amax(dim=1)
        else:
            a = p.amin(dim=1)
        if pair is not None:
            a = a.masked_fill(~pair, 0.0)
        if add_residual:
            a = 0.5 * a + 0.5 * eye
        total = a.sum(dim=-1, keepdim=True)  # (B, S, 1)
        a = a / torch.where(total > 0, total, 1.0)  # rows with no weight stay 0, not NaN
        flow = a if flow is None else a @ flow
    if pair is not None:
        flow = flow.masked_fill(~pair, 0.0)
    return flow.to(torch.promote_types(first.dtype, torch.float32))
