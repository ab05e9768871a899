"""Pruning plans, physical pruning, iterative pruning with a held-out curve, HF export.

A `PrunePlan` names, per layer, the original head indices kept and removed. Heads are
ranked globally across layers (default) or within each layer, lowest score removed
first. Under GQA query heads are ranked; a key/value head goes with its last query head.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from headlab import distributed
from headlab.checkpoint import Checkpoint
from headlab.data import Blocks
from headlab.evaluate import Quality, evaluate
from headlab.importance import HeadScores, score
from headlab.models.base import HeadModel


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


def _target(total: int, keep: float | None, prune: int | None) -> int:
    """Number of heads to keep."""
    if (keep is None) == (prune is None):
        raise ValueError("give exactly one of keep (a fraction) or prune (a number of heads)")
    if keep is not None:
        if not 0 < keep <= 1 or math.isnan(keep):
            raise ValueError(f"keep must be in (0, 1], got {keep}")
        n_keep = math.ceil(round(keep * total, 6))
    else:
        if not 0 <= prune < total:
            raise ValueError(
                f"prune must be between 0 and {total - 1} heads (the model has {total}), "
                f"got {prune}"
            )
        n_keep = total - prune
    if n_keep < 1:
        raise ValueError(f"keep={keep} leaves no head of {total}: keep at least one")
    return n_keep


def select(
    scores: HeadScores,
    *,
    keep: float | None = None,
    prune: int | None = None,
    per_layer: bool = False,
    min_heads_per_layer: int = 0,
    of_total: int | None = None,
) -> PrunePlan:
    """Choose the heads to keep: the ``keep`` fraction (or all but ``prune``) of the
    ``of_total`` original heads (default: all original heads), ranked by score.

    Heads with a NaN score (already removed) count as pruned. ``per_layer`` keeps the
    same number in every layer; ``min_heads_per_layer`` protects each layer's best.
    """
    t = scores.tensor()  # (L, H)
    L, H = t.shape
    total = of_total or L * H
    n_keep = _target(total, keep, prune)
    present = ~t.isnan()
    if n_keep > int(present.sum()):
        raise ValueError(
            f"cannot keep {n_keep} heads: only {int(present.sum())} remain unpruned"
        )
    if min_heads_per_layer * L > n_keep:
        raise ValueError(
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
    # absent heads are listed too: a head masked before scoring must still be removed
    pruned = {layer: torch.nonzero(~keep_mask[layer]).flatten().tolist() for layer in range(L)}
    return PrunePlan(kept, pruned)


def _rank(row: torch.Tensor) -> torch.Tensor:
    """Head indices of one layer from most to least important, absent heads last."""
    return torch.nan_to_num(row, nan=-math.inf).argsort(descending=True, stable=True)


def prune(model: HeadModel, plan: PrunePlan, *, inplace: bool = True) -> HeadModel:
    """Physically remove the plan's pruned heads (weights leave the model)."""
    target = model if inplace else _copy(model)
    target.prune_heads(plan.pruned)
    # gates of kept heads go back to 1: masking was only a rehearsal of this
    for attn in target.attentions:
        attn.set_gates(torch.ones(attn.n_heads))
    return target


def _copy(model: HeadModel) -> HeadModel:
    tok = model.tokenizer
    model.tokenizer = None
    try:
        out = copy.deepcopy(model)
    finally:
        model.tokenizer = tok
    out.tokenizer = tok
    return out


@dataclass
class PruneResult:
    """What iterative or one-shot pruning decided and measured."""

    plan: PrunePlan
    scores: HeadScores  # the first scoring (all heads), shown as the importance map
    curve: list[dict] = field(default_factory=list)
    step_scores: list[HeadScores] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"plan": self.plan.to_json(), "scores": self.scores.to_json(),
                "curve": self.curve}


def prune_to_target(
    model: HeadModel,
    scoring: Blocks,
    heldout: Blocks,
    *,
    method: str = "michel",
    keep: float | None = None,
    prune: int | None = None,
    schedule: str = "iterative",
    step: float = 0.1,
    per_layer: bool = False,
    min_heads_per_layer: int = 0,
    batch_size: int = 8,
    seed: int = 0,
    score_kwargs: Mapping | None = None,
    on_step: Callable[[dict], None] | None = None,
    checkpoint: Checkpoint | None = None,
) -> PruneResult:
    """Score, mask and re-score until the target; record held-out quality per step.

    ``iterative``: remove ``step`` of the original heads per step, re-scoring with the
    current mask (gates at 0 for removed heads) each time. ``one-shot``: score once and
    remove down to the target, still recording the curve at each step's size. The
    model is left masked at the final plan; call `prune` to remove the weights.
    With a ``checkpoint`` each finished step (and each scoring's progress) is saved,
    and a call with the same checkpoint resumes where the last one stopped.
    """
    if schedule not in ("iterative", "one-shot"):
        raise ValueError(f"schedule must be 'iterative' or 'one-shot', got {schedule!r}")
    if not 0 < step <= 1:
        raise ValueError(f"step must be in (0, 1], got {step}")
    total = model.n_layers * model.n_original_heads
    present = sum(model.heads_per_layer)
    n_keep = _target(total, keep, prune)
    kw = dict(score_kwargs or {})

    def quality_point(n_kept: int) -> dict:
        q: Quality = evaluate(model, heldout, batch_size=batch_size)
        point = {"fraction_pruned": round(1 - n_kept / total, 6), "quality": q.value,
                 "loss": q.loss, "heads_kept": n_kept}
        if on_step:
            on_step(point)
        return point

    per_step = max(1, round(step * total))
    key = f"prune/{method}"
    saved = checkpoint.get(key) if checkpoint is not None else None
    if saved is not None:  # resume: the mask, curve and scores of the last finished step
        model.mask_heads({int(k): v for k, v in saved["masked"].items()})
        curve = saved["curve"]
        step_scores = [HeadScores.from_json(j) for j in saved["step_scores"]]
        n_now = saved["n_now"]
    else:
        curve = [quality_point(present)]
        step_scores = [score(model, scoring, method=method, batch_size=batch_size, seed=seed,
                             checkpoint=checkpoint, checkpoint_key=f"{key}/score0", **kw)]
        n_now = present

    def save_step() -> None:
        if checkpoint is not None:
            masked = {str(k): v for k, v in current_plan(model).pruned.items()}
            checkpoint.put(key, {"masked": masked, "curve": curve, "n_now": n_now,
                                 "step_scores": [sc.to_json() for sc in step_scores]})

    save_step()
    while n_now > n_keep:
        n_next = max(n_keep, n_now - per_step)
        plan = select(step_scores[-1], keep=None, prune=total - n_next, per_layer=per_layer,
                      min_heads_per_layer=min_heads_per_layer, of_total=total)
        plan = distributed.broadcast(plan)  # decided once, applied on every rank
        model.mask_heads(plan.pruned)
        n_now = n_next
        curve.append(quality_point(n_now))
        if schedule == "iterative" and n_now > n_keep:
            step_scores.append(score(
                model, scoring, method=method, batch_size=batch_size,
                seed=seed + len(step_scores), checkpoint=checkpoint,
                checkpoint_key=f"{key}/score{len(step_scores)}", **kw))
        save_step()
    return PruneResult(current_plan(model), step_scores[0], curve, step_scores)


def versus_random(
    model: HeadModel,
    scoring: Blocks,
    heldout: Blocks,
    *,
    method: str | Sequence[str] | Mapping[str, tuple[str, Mapping]] = "michel",
    keep: float = 0.6,
    seeds: tuple[int, ...] = (0, 1, 2),
    **prune_kw,
) -> dict:
    """Held-out quality lost by pruning with ``method`` (one or several) vs with random
    scores.

    ``method`` is a method's name, several names, or named variants ``{label: (method,
    score_kwargs)}``, e.g. ``{"michel": ("michel", {}), "michel_unnormalised":
    ("michel", {"normalize": False})}``. Prunes (by masking) to ``keep`` once per method
    and once per random seed, all from the unpruned model, and restores the model after
    each; random takes no scoring options. A loss is the change in the model's metric in
    its bad direction (perplexity up, fidelity or accuracy down).
    Returns ``{"metric", "before", "lost": {<label>, "random:<seed>": ...},
    "random_mean", "ratios": {<label>: ...}, "ratio"}``: a ratio is lost by the method
    / mean lost by random, ``ratio`` the first method's; under 1 the scorer beats
    chance, and Michel et al.'s claim is that it does by far.
    """
    if isinstance(method, str):
        trials = {method: (method, {})}
    elif isinstance(method, Mapping):
        trials = {label: (name, dict(kw)) for label, (name, kw) in method.items()}
    else:
        trials = {name: (name, {}) for name in method}
    shared = dict(prune_kw.pop("score_kwargs", None) or {})
    batch_size = prune_kw.get("batch_size", 8)
    before = evaluate(model, heldout, batch_size=batch_size)
    sign = -1 if before.higher_is_better else 1
    runs = [(label, name, 0, {**shared, **kw}) for label, (name, kw) in trials.items()]
    runs += [(f"random:{seed}", "random", seed, {}) for seed in seeds]
    lost: dict[str, float] = {}
    for label, name, seed, kw in runs:
        with gates_restored(model):
            prune_to_target(model, scoring, heldout, method=name, keep=keep, seed=seed,
                            score_kwargs=kw, **prune_kw)
            after = evaluate(model, heldout, batch_size=batch_size)
        lost[label] = sign * (after.value - before.value)
    random_mean = sum(lost[f"random:{s}"] for s in seeds) / len(seeds)
    ratios = {m: lost[m] / random_mean if random_mean > 0 else math.nan for m in trials}
    return {"metric": before.metric, "before": before.value, "lost": lost,
            "random_mean": random_mean, "ratios": ratios, "ratio": ratios[next(iter(trials))]}


@contextlib.contextmanager
def gates_restored(model: HeadModel) -> Iterator[None]:
    """Put the model's head gates back on leaving, e.g. after a trial `prune_to_target`,
    which masks heads and changes nothing else."""
    gates = [g.clone() for g in model.gates()]
    try:
        yield
    finally:
        model.set_gates(gates)


def current_plan(model: HeadModel) -> PrunePlan:
    """The plan a model's gates describe: present heads with gate 0 are to be pruned."""
    kept, pruned = {}, {}
    for i, a in enumerate(model.attentions):
        ids = a.head_ids.tolist()
        on = (a.head_gate != 0).tolist()
        kept[i] = sorted(h for h, o in zip(ids, on, strict=True) if o)
        pruned[i] = sorted(h for h, o in zip(ids, on, strict=True) if not o)
    return PrunePlan(kept, pruned)


# ---------------------------------------------------------------------- HF export
def hf_expressible(model: HeadModel) -> str | None:
    """None when the pruned shape fits the family's HF config; else the reason."""
    import importlib

    family = importlib.import_module(type(model).__module__)
    unsupported = getattr(family, "HF_EXPORT_UNSUPPORTED", None)
    if unsupported:
        return unsupported
    heads = set(model.heads_per_layer)
    if len(heads) != 1 or 0 in heads:
        return (f"layers keep different numbers of heads ({model.heads_per_layer}); HF configs "
                "hold one count for all layers: prune with --per-layer")
    kv = set(model.kv_heads_per_layer)
    if len(kv) != 1:
        return f"layers keep different numbers of key/value heads ({model.kv_heads_per_layer})"
    for a in model.attentions:
        if not a._kv_regular:
            return "a GQA group lost only some of its query heads: groups are uneven"
    return None


def export_hf(model: HeadModel, directory: str | Path) -> Path:
    """Write a directory that plain transformers ``from_pretrained`` loads.

    Only for shapes the HF config can express (see `hf_expressible`); the family file
    provides ``to_hf(model) -> (config dict, state dict)``.
    """
    import importlib

    from safetensors.torch import save_file

    reason = hf_expressible(model)
    if reason is not None:
        raise ValueError(f"cannot export to Hugging Face format: {reason}")
    config, state = importlib.import_module(type(model).__module__).to_hf(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(directory))
    return directory

