"""Physical pruning by a plan, demotion, and trial masks that always come off.

`prune` removes a plan's heads from a model (their weights leave it). `demote` keeps
them with a sink + window cache instead, and `demotion_scores` are what can choose
those groups besides an importance method. `trial` masks a plan's heads for the length
of a ``with`` block, to measure the model as the plan would leave it, and puts every
gate back on leaving: the plan, not the gates, is what passes from selection to pruning.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from headlab._util.checkpoint import Checkpoint
from headlab._util.checks import check_instance
from headlab.attention.streaming import Streaming
from headlab.data.blocks import Blocks
from headlab.detectors import detect
from headlab.errors import UserError
from headlab.importance import HeadScores
from headlab.importance.duo import streaming_gates
from headlab.models.base import HeadModel
from headlab.selection import PrunePlan, kv_groups


def prune(model: HeadModel, plan: PrunePlan, *, inplace: bool = True) -> HeadModel:
    """Physically remove the plan's pruned heads (weights leave the model); the heads
    that stay are whole: every gate is set back to 1."""
    check_plan(model, plan)
    target = model if inplace else copy_model(model)
    target.prune_heads(plan.pruned)
    for attn in target.attentions:
        attn.set_gates(torch.ones(attn.n_heads))
    return target


def demote(model: HeadModel, plan: PrunePlan, *, sinks: int = 4, window: int = 256,
           inplace: bool = True) -> HeadModel:
    """Make the plan's demoted heads streaming heads: they attend to the first ``sinks``
    and the last ``window`` positions only, and their key/value cache keeps just those.

    A key/value head serves every query head of its group, so whole GQA groups are
    demoted (`headlab.selection.select_groups` chooses such plans); a plan that demotes
    part of a group is refused. The plan's pruned heads are removed first.
    """
    check_plan(model, plan)
    if not model.causal:
        raise UserError(f"demotion keeps the first and the last positions of a causal "
                        f"model's past; {model.family} ({model.kind}) attends both ways: "
                        "prune its heads instead (without --demote)")
    target = model if inplace else copy_model(model)
    if any(plan.pruned.values()):
        prune(target, plan)
    for layer, groups in enumerate(kv_groups(target)):
        heads = set(plan.demoted.get(layer, ()))
        attn = target.attentions[layer]
        whole = [g for g in groups if heads & set(g)]
        partial = [g for g in whole if not set(g) <= heads]
        if partial:
            raise UserError(
                f"layer {layer}: demoting heads {sorted(heads)} splits the GQA group(s) "
                f"{partial}; a key/value head serves its whole group, so demote whole groups "
                "(--unit kv-group)")
        if whole:
            kv = {int(attn.kv_head_ids[attn.kv_index[pos]])
                  for pos, h in enumerate(attn.head_ids.tolist()) if h in heads}
            attn.streaming = Streaming(tuple(sorted(kv)), sinks=sinks, window=window)
        else:
            attn.streaming = None
    return target


def demotion_scores(model: HeadModel, by: str, blocks: Blocks, *, sinks: int, window: int,
                    seed: int = 0, checkpoint: Checkpoint | None = None,
                    **gate_options) -> HeadScores:
    """Scores that choose the groups to demote, the highest keeping their full cache: a
    decoder head-type detector's (``by`` a kind, e.g. ``"retrieval"``, on the model's own
    probes of up to 128 tokens), or DuoAttention's gates (``by="gates"``) trained on
    passkey prompts from ``blocks`` (`headlab.importance.duo.streaming_gates`, with
    ``gate_options``); group them by `demotion_group_score`."""
    if by == "gates":
        return streaming_gates(model, blocks, sinks=sinks, window=window, seed=seed,
                               checkpoint=checkpoint, **gate_options)
    return detect(model, by, seq_len=min(128, model.max_positions), seed=seed)


def demotion_group_score(by: str, group_score: str) -> str:
    """How `demotion_scores` by ``by`` score a group: a gate is its group's (each of its
    heads carries it), so its max; a detector's per-head scores by ``group_score``."""
    return "max" if by == "gates" else group_score


def check_plan(model: HeadModel, plan: PrunePlan) -> None:
    """Refuse a plan that is no PrunePlan or names a layer or head ``model`` never had:
    applying it would leave the model silently as it was."""
    check_instance(model, "model", HeadModel, "from headlab.load")
    check_instance(plan, "plan", PrunePlan, "from headlab.select")
    H = model.n_original_heads
    for part in ("kept", "pruned", "demoted"):
        for layer, heads in getattr(plan, part).items():
            if not 0 <= int(layer) < model.n_layers:
                raise UserError(f"plan: layer {layer} is beyond the model's {model.n_layers} "
                                f"layers (0..{model.n_layers - 1})")
            bad = sorted(int(h) for h in heads if not 0 <= int(h) < H)
            if bad:
                verb = {"kept": "keeps", "pruned": "prunes", "demoted": "demotes"}[part]
                raise UserError(f"plan: layer {layer} {verb} head {', '.join(map(str, bad))}, "
                                f"but the model's layers have heads 0..{H - 1}")


def demoted_heads(model: HeadModel) -> dict[int, list[int]]:
    """{layer: original query heads} that are streaming heads (empty layers left out)."""
    out = {}
    for layer, attn in enumerate(model.attentions):
        if attn.streaming is not None:
            kv = set(attn.streaming.kv_heads)
            heads = [h for pos, h in enumerate(attn.head_ids.tolist())
                     if int(attn.kv_head_ids[attn.kv_index[pos]]) in kv]
            if heads:
                out[layer] = heads
    return out


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

