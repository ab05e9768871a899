"""Head gates that take gradients, for the tests that check a gradient method against
autograd on the gates themselves."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def gate_leaves(model, batch: int | None = None) -> Iterator[list[torch.Tensor]]:
    """Each attention's gate override a fresh leaf that requires grad, at its head gates
    as they are: (H,), or with ``batch`` one row per example, (batch, H). Yields the
    leaves, one per layer; no override is left on exit."""
    leaves = []
    try:
        for a in model.attentions:
            g = a.head_gate.detach()
            g = (g if batch is None else g.expand(batch, -1)).clone().requires_grad_(True)
            a.gate_override = g
            leaves.append(g)
        yield leaves
    finally:
        for a in model.attentions:
            a.gate_override = None
