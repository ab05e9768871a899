"""Head scores -> a pruning plan: which heads each layer keeps.

`heads_to_keep` turns a keep fraction or a prune count into a number of heads, once;
`select` keeps that many, ranked globally across layers (default) or within each
layer, lowest score removed first. Under GQA query heads are ranked; a key/value head
goes with its last query head (see `MultiHeadAttention.prune_heads`).

`select_groups` ranks whole GQA groups instead (one key/value head and its query heads,
`kv_groups`), so that every removal shrinks the key/value cache: a group scores the sum
of its query heads' scores (or their max), and goes whole. A plan may also demote heads
(`PrunePlan.demoted`): they stay, with a sink-plus-window cache (`headlab.attention.streaming`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from headlab._util.checks import check_fraction, check_instance, check_int
from headlab.errors import UserError
from headlab.importance import HeadScores
from headlab.models.base import HeadModel

GROUP_SCORES = ("sum", "max")  # how a GQA group's score comes from its query heads'


@dataclass
class PrunePlan:
    """{layer: original head indices} kept and pruned; ``demoted`` lists, per layer,
    kept heads that keep only a sink-plus-window cache (whole GQA groups)."""

    kept: dict[int, list[int]]
    pruned: dict[int, list[int]]
    demoted: dict[int, list[int]] = field(default_factory=dict)

    @property
    def n_kept(self) -> int:
        return sum(len(v) for v in self.kept.values())

    @property
    def n_pruned(self) -> int:
        return sum(len(v) for v in self.pruned.values())

    @property
    def n_demoted(self) -> int:
        return sum(len(v) for v in self.demoted.values())

    def as_demotion(self) -> PrunePlan:
        """The same choice with the pruned heads demoted instead: every head is kept."""
        kept = {layer: sorted([*self.kept.get(layer, []), *self.pruned.get(layer, [])])
                for layer in sorted(set(self.kept) | set(self.pruned))}
        return PrunePlan(kept, {layer: [] for layer in kept},
                         {layer: list(v) for layer, v in self.pruned.items() if v})

    def to_json(self) -> dict:
        d = {"kept": {str(k): v for k, v in self.kept.items()},
             "pruned": {str(k): v for k, v in self.pruned.items()}}
        if self.demoted:
            d["demoted"] = {str(k): v for k, v in self.demoted.items()}
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> PrunePlan:
        check_instance(d, "a plan's JSON", Mapping, "as PrunePlan.to_json writes it")
        if "kept" not in d or "pruned" not in d:
            raise UserError(f"a plan's JSON needs 'kept' and 'pruned' ({{layer: [heads]}}), "
                            f"got the keys {sorted(d)}")
        return cls({int(k): list(v) for k, v in d["kept"].items()},
                   {int(k): list(v) for k, v in d["pruned"].items()},
                   {int(k): list(v) for k, v in d.get("demoted", {}).items()})


def heads_to_keep(total: int, *, keep: float | None = None, prune: int | None = None) -> int:
    """The number of the ``total`` heads to keep: the ``keep`` fraction, rounded up, or
    all but ``prune``. Give exactly one; at least one head must remain."""
    if (keep is None) == (prune is None):
        raise UserError("give exactly one of keep (a fraction) or prune (a number of heads)")
    total = check_int(total, "total", low=1)
    if keep is not None:
        keep = check_fraction(keep, "keep")
        # rounded first: keep=0.07 of 100 heads is 7, not 8 from 7.000000000000001
        n_keep = math.ceil(round(keep * total, 6))
    else:
        if not 0 <= check_int(prune, "prune") < total:
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
    check_instance(scores, "scores", HeadScores, "from headlab.score or headlab.detect")
    n_keep = check_int(n_keep, "n_keep")
    min_heads_per_layer = check_int(min_heads_per_layer, "min_heads_per_layer", low=0)
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


def kv_groups(model: HeadModel) -> list[list[list[int]]]:
    """Each layer's GQA groups: per key/value head still present, the original indices
    of its query heads (one head per group on a model without GQA)."""
    out = []
    for attn in model.attentions:
        groups: dict[int, list[int]] = {}
        for pos, head in enumerate(attn.head_ids.tolist()):
            kv = int(attn.kv_head_ids[attn.kv_index[pos]])
            groups.setdefault(kv, []).append(head)
        out.append([groups[kv] for kv in sorted(groups)])
    return out


def select_groups(
    scores: HeadScores,
    groups: list[list[list[int]]],
    n_keep: int,
    *,
    per_layer: bool = False,
    group_score: str = "sum",
) -> PrunePlan:
    """Keep the ``n_keep`` GQA groups with the highest scores; prune the rest whole.

    ``groups`` is `kv_groups` of the model scored; a group scores the ``sum`` (or the
    ``max``) of its query heads' scores, heads with a NaN score (already masked) left
    out, and a group whose heads are all NaN counts as pruned. ``per_layer`` keeps the
    same number of groups in every layer (the remainder going to the layers whose best
    group is best), so the pruned model keeps one key/value head count for all layers.
    """
    if group_score not in GROUP_SCORES:
        raise UserError(f"group score must be one of {', '.join(GROUP_SCORES)}, "
                        f"got {group_score!r}")
    t = scores.tensor()  # (L, H)
    if len(groups) != t.shape[0]:
        raise UserError(f"groups cover {len(groups)} layers, the scores {t.shape[0]}")
    # (L, G) group scores, NaN for a group with no head left; G = most groups in a layer
    G = max((len(g) for g in groups), default=0)
    table = torch.full((len(groups), G), math.nan, dtype=torch.float64)
    for layer, layer_groups in enumerate(groups):
        for g, heads in enumerate(layer_groups):
            vals = t[layer, heads]
            vals = vals[~vals.isnan()]
            if vals.numel():
                table[layer, g] = vals.sum() if group_score == "sum" else vals.max()
    plan = select(HeadScores(table.tolist(), scores.method), n_keep, per_layer=per_layer)
    kept, pruned = {}, {}
    for layer, layer_groups in enumerate(groups):
        keep_g = set(plan.kept[layer])
        kept[layer] = sorted(h for g, heads in enumerate(layer_groups) if g in keep_g
                             for h in heads if not math.isnan(float(t[layer, h])))
        pruned[layer] = [h for h in range(t.shape[1]) if h not in set(kept[layer])]
    return PrunePlan(kept, pruned)
