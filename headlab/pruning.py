"""Physical pruning by a plan, and trial masks that always come off.

`prune` removes a plan's heads from a model (their weights leave it). `trial` masks a
plan's heads for the length of a ``with`` block, to measure the model as the plan
would leave it, and puts every gate back on leaving: the plan, not the gates, is what
passes from selection to pruning.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from headlab.models.base import HeadModel
from headlab.selection import PrunePlan


def prune(model: HeadModel, plan: PrunePlan, *, inplace: bool = True) -> HeadModel:
    """Physically remove the plan's pruned heads (weights leave the model); the heads
    that stay are whole: every gate is set back to 1."""
    target = model if inplace else copy_model(model)
    target.prune_heads(plan.pruned)
    for attn in target.attentions:
        attn.set_gates(torch.ones(attn.n_heads))
    return target


def copy_model(model: HeadModel) -> HeadModel:
    """A deep copy of the model sharing its tokenizer (tokenizers need not deep-copy)."""
    tok = model.tokenizer
    model.tokenizer = None
    try:
        out = copy.deepcopy(model)
    finally:
        model.tokenizer = tok
    out.tokenizer = tok
    return out


@contextlib.contextmanager
def trial(model: HeadModel, plan: PrunePlan | None = None) -> Iterator[None]:
    """Mask ``plan.pruned`` (when given) for the block; on leaving, exception or not,
    put every head gate back as it was on entering."""
    gates = [g.clone() for g in model.gates()]
    try:
        if plan is not None:
            model.mask_heads(plan.pruned)
        yield
    finally:
        model.set_gates(gates)

