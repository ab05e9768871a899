"""Whether a repair left weights a model can use: `check_sane`."""

from __future__ import annotations

import math

from headlab.errors import UserError
from headlab.models.base import HeadModel
from headlab.recovery.sharded import is_fsdp

# a repaired weight this many times the unpruned model's largest is a fit gone wrong
# (a ridge of 0 on a singular system, a learning rate that diverged), not a repair
SANE_GROWTH = 1e3


def check_sane(pruned: HeadModel, reference: HeadModel, method: str) -> None:
    """Refuse (one line) a repair that left a weight non-finite or beyond `SANE_GROWTH`
    times the unpruned model's largest; the callers put the model back as it came.
    Sharded (FSDP) models are not checked: their parameters are each rank's rows."""
    if is_fsdp(pruned):
        return
    limit = SANE_GROWTH * max(float(p.detach().abs().max()) for p in reference.parameters()
                              if p.numel())
    for name, p in pruned.named_parameters():
        if not p.numel():
            continue
        top = float(p.detach().abs().max())
        if not math.isfinite(top) or top > limit:
            found = "non-finite" if not math.isfinite(top) else (
                f"at {top:.3g}, over {SANE_GROWTH:g} times the unpruned model's largest weight")
            raise UserError(f"recovery {method} left {name} {found}; the model is left as it "
                            "came and nothing is saved: try a larger --recover-ridge, a "
                            "smaller --recover-lr or --recover none")
