"""Head scores -> a pruning plan: which heads each layer keeps.

`heads_to_keep` turns a keep fraction or a prune count into a number of heads, once;
`select` keeps that many, ranked globally across layers (default) or within each
layer, lowest score removed first. Under GQA query heads are ranked; a key/value head
goes with its last query head (see `MultiHeadAttention.prune_heads`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from headlab.errors import UserError
from headlab.importance import HeadScores


@dataclass
class PrunePlan:
    """{layer: original head indices} kept and pruned."""

    kept: dict[int, list[int]]
    pruned: dict[int, list[int]]

    @property
    def n_kept(self) -> int:
        return sum(len(v) for v in self.kept.values())

    @property
    def n_pruned(self) -> int:
        return sum(len(v) for v in self.pruned.values())

    def to_json(self) -> dict:
        return {"kept": {str(k): v for k, v in self.kept.items()},
                "pruned": {str(k): v for k, v in self.pruned.items()}}

    @classmethod
    def from_json(cls, d: Mapping) -> PrunePlan:
        return cls({int(k): list(v) for k, v in d["kept"].items()},
                   {int(k): list(v) for k, v in d["pruned"].items()})


def heads_to_keep(total: int, *, keep: float | None = None, prune: int | None = None) -> int:
    """The number of the ``total`` heads to keep: the ``keep`` fraction, rounded up, or
    all but ``prune``. Give exactly one; at least one head must remain."""
    if (keep is None) == (prune is None):
        raise UserError("give exactly one of keep (a fraction) or prune (a number of heads)")
    if keep is not None:
        if not 0 < keep <= 1 or math.isnan(keep):
            raise UserError(f"keep must be in (0, 1], got {keep}")
        # rounded first: keep=0.07 of 100 heads is 7, not 8 from 7.000000000000001
        n_keep = math.ceil(round(keep * total, 6))
    else:
        if not 0 <= prune < total:
            raise UserError(
                f"prune must be between 0 and {total - 1} heads (the model has {total}), "
                f"got {prune}"
            )
        n_keep = total - prune
    if n_keep < 1:
        raise UserError(f"keep={keep} leaves no head of {total}: keep at least one")
    return n_keep


def select(
    scores: HeadScores,
    n_keep: int,
    *,
    per_layer: bool = False,
    min_heads_per_layer: int = 0,
) -> PrunePlan:
    """Keep the ``n_keep`` heads with the highest scores; prune the rest.

    Heads with a NaN score (already removed or masked) count as pruned and are listed
    in ``pruned``, so that a plan made on a masked model still removes them.
    ``per_layer`` keeps the same number in every layer (the remainder going to the
    layers whose best head is best); ``min_heads_per_layer`` protects each layer's best.
    """
    t = scores.tensor()  # (L, H)
    L, H = t.shape
    present = ~t.isnan()
    n_present = int(present.sum())
    if n_keep < 1:
        raise UserError(f"n_keep must be at least 1 head, got {n_keep}")
    if n_keep > n_present:
        raise UserError(f"cannot keep {n_keep} heads: only {n_present} remain unpruned")
    if min_heads_per_layer * L > n_keep:
        raise UserError(
            f"min_heads_per_layer={min_heads_per_layer} x {L} layers exceeds the "
            f"{n_keep} heads to keep"
        )
    keep_mask = torch.zeros(L, H, dtype=torch.bool)
    if per_layer:
        per = n_keep // L
        extra = n_keep - per * L
        # layers ranked by their best remaining head take the remainder
        best = torch.nan_to_num(t, nan=-math.inf).max(1).values
        bonus = set(best.argsort(descending=True)[:extra].tolist())
        for layer in range(L):
            k = per + (layer in bonus)
            order = _rank(t[layer])
            keep_mask[layer, order[:k]] = True
    else:
        for layer in range(L):
            order = _rank(t[layer])
            keep_mask[layer, order[:min_heads_per_layer]] = True
        rest = n_keep - int(keep_mask.sum())
        flat = torch.where(keep_mask | ~present, -math.inf, t).flatten()
        flat = torch.nan_to_num(flat, nan=-math.inf)
        if rest > 0:
            idx = flat.argsort(descending=True, stable=True)[:rest]
            keep_mask.view(-1)[idx] = True
    keep_mask &= present
    kept = {layer: torch.nonzero(keep_mask[layer]).flatten().tolist() for layer in range(L)}
    pruned = {layer: torch.nonzero(~keep_mask[layer]).flatten().tolist() for layer in range(L)}
    return PrunePlan(kept, pruned)


def _rank(row: torch.Tensor) -> torch.Tensor:
    """Head indices of one layer from most to least important, absent heads last."""
    return torch.nan_to_num(row, nan=-math.inf).argsort(descending=True, stable=True)
