"""HookPoint: an identity module at a stable dotted name (``blocks.3.attn.pattern``).

Models call a hook point only when something is registered on it, so a model with
hook points and none active runs the same operations as one without them.
`headlab.hooks` builds capture and intervention on top of these modules.
"""

from __future__ import annotations

import torch
from torch import nn


class HookPoint(nn.Module):
    """Identity module whose forward hooks see (and may replace) one activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @property
    def active(self) -> bool:
        """True when at least one forward hook is registered."""
        return bool(self._forward_hooks)


def run_hook(point: HookPoint, x: torch.Tensor) -> torch.Tensor:
    """Pass ``x`` through ``point`` only when a hook listens there (zero cost otherwise)."""
    return point(x) if point._forward_hooks else x
