"""HookPoint: an identity module at a stable dotted name (``blocks.3.attn.pattern``).

Models call a hook point only when something is registered on it (`run_hook`), so a
model with hook points and none active runs the same operations as one without them.
`headlab.attention.hooks` builds capture and intervention on top of these modules.

`hooks_disabled` switches every hook point off for a block: none runs its hooks, so a
forward runs as if none were registered. ``headlab bench hooks`` times idle hook points
against that switch; the switch itself costs one global read per hook point.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["HookPoint", "hooks_disabled", "hooks_enabled", "run_hook"]

# read by run_hook and HookPoint on every call: a plain module global, the cheapest read
_enabled = True


class HookPoint(nn.Module):
    """Identity module whose forward hooks see (and may replace) one activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # a model that tests ``point._forward_hooks`` itself and then calls the point
        # must not run its hooks while they are switched off either
        return super().__call__(x) if _enabled else x


def run_hook(point: HookPoint, x: torch.Tensor) -> torch.Tensor:
    """Pass ``x`` through ``point`` only when a hook listens there and hooks are on."""
    return point(x) if _enabled and point._forward_hooks else x


def hooks_enabled() -> bool:
    """False inside `hooks_disabled`."""
    return _enabled


@contextlib.contextmanager
def hooks_disabled() -> Iterator[None]:
    """Inside this block no hook point runs its hooks (they stay registered), in every
    model of the process; on exit the previous state comes back, also after an error."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before
