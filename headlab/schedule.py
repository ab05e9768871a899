"""Iterative and one-shot pruning to a number of heads, and comparisons with random.

`prune_to_target` scores, selects and masks step by step, measuring held-out quality
at each step (the curve), and returns the final plan with the model's gates as they
were: the caller prunes by the plan (`headlab.pruning.prune`). `versus_random` asks
whether a scorer's choice of heads beats random choices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from headlab._util.checkpoint import Checkpoint
from headlab._util.progress import track
from headlab.data.blocks import Blocks
from headlab.errors import UserError
from headlab.evaluate.quality import evaluate
from headlab.importance import DEFAULT_METHOD, JOINT, TARGETED, HeadScores, score
from headlab.models.base import HeadModel
from headlab.objectives import DEFAULT_BATCH_SIZE
from headlab.parallel import distributed
from headlab.pruning import copy_model, prune, trial
from headlab.recovery import TRAINING_FREE
from headlab.recovery import recover as recover_model
from headlab.selection import PrunePlan, heads_to_keep, kv_groups, select, select_groups

UNITS = ("head", "kv-group")  # what a schedule counts and removes: query heads or GQA groups
SCHEDULES = ("iterative", "one-shot")


def default_schedule(method: str) -> str:
    """The schedule ``method`` runs unless told: one-shot for the methods that choose
    across layers jointly (`headlab.importance.JOINT`: the gates train toward the target
    itself, and re-scoring would train them again at every step), iterative, Michel et
    al.'s protocol, for the scores of one head at a time."""
    return "one-shot" if method in JOINT else "iterative"


@dataclass
class CurvePoint:
    """Held-out quality with ``heads_kept`` heads left (``fraction_pruned`` of all
    original heads gone)."""

    fraction_pruned: float
    quality: float
    loss: float
    heads_kept: int

    def to_json(self) -> dict:
        return {"fraction_pruned": self.fraction_pruned, "quality": self.quality,
                "loss": self.loss, "heads_kept": self.heads_kept}

    @classmethod
    def from_json(cls, d: Mapping) -> CurvePoint:
        """From `to_json` or results.json, where a non-finite figure is written null."""
        def num(v) -> float:
            return math.nan if v is None else v

        return cls(d["fraction_pruned"], num(d["quality"]), num(d["loss"]), d["heads_kept"])


@dataclass
class RemovalScores:
    """The scores that chose each removal, layers x original heads: a pruned head's
    score in the scoring that chose to remove it, a kept head's in the last scoring.
    ``scoring[layer][head]`` is the index of that scoring (0: the unpruned model's),
    None for a kept head or one no scoring saw; ``scorings`` is how many ran."""

    scores: list[list[float]]
    scoring: list[list[int | None]]
    scorings: int

    def to_json(self) -> dict:
        return {"scores": [[None if math.isnan(v) else v for v in row] for row in self.scores],
                "scoring": self.scoring, "scorings": self.scorings}

    @classmethod
    def from_json(cls, d: Mapping) -> RemovalScores:
        """From `to_json`; raises KeyError, TypeError or ValueError when malformed."""
        scores = [[math.nan if v is None else float(v) for v in row] for row in d["scores"]]
        scoring = [[None if k is None else int(k) for k in row] for row in d["scoring"]]
        if [len(r) for r in scores] != [len(r) for r in scoring]:
            raise ValueError("removal scores and their scoring indices differ in shape")
        return cls(scores, scoring, int(d["scorings"]))


@dataclass
class ScheduleResult:
    """What iterative or one-shot pruning decided and measured."""

    plan: PrunePlan
    scores: HeadScores  # the first scoring (all heads)
    curve: list[CurvePoint] = field(default_factory=list)
    step_scores: list[HeadScores] = field(default_factory=list)

    def removal_scores(self) -> RemovalScores:
        """Each head's score where it was decided. A step's plan is chosen on the latest
        scoring, and a head removed by it scores NaN in every later one (iterative), so
        a pruned head was chosen by the last scoring that still saw it."""
        steps = self.step_scores or [self.scores]
        scores, scoring = [], []
        for layer, row in enumerate(steps[0].scores):
            gone = set(self.plan.pruned.get(layer, ()))
            scores.append([])
            scoring.append([])
            for head in range(len(row)):
                seen = [k for k, s in enumerate(steps) if not math.isnan(s.scores[layer][head])]
                k = seen[-1] if seen and head in gone else None
                scores[-1].append(steps[k if k is not None else -1].scores[layer][head])
                scoring[-1].append(k)
        return RemovalScores(scores, scoring, len(steps))

    def plan_at(self, n_keep: int, **select_kw) -> PrunePlan:
        """The plan that the same query-head schedule, stopped at ``n_keep`` heads, would
        have chosen: its steps up to there are this run's, and its last step chooses on
        the last scoring that saw more than ``n_keep`` heads. So one run to the smallest
        size gives every larger size's plan (``select_kw`` as the run's `select`)."""
        if n_keep < self.plan.n_kept:
            raise UserError(f"this schedule went down to {self.plan.n_kept} heads; it holds "
                            f"no plan for fewer ({n_keep})")
        steps = self.step_scores or [self.scores]
        seen = [s for s in steps if int((~s.tensor().isnan()).sum()) > n_keep]
        if not seen:  # as many heads as the first scoring saw: nothing removed
            return select(steps[0], n_keep, **select_kw)
        return select(seen[-1], n_keep, **select_kw)


def prune_to_target(
    model: HeadModel,
    scoring: Blocks,
    heldout: Blocks,
    *,
    method: str = DEFAULT_METHOD,
    n_keep: int,
    schedule: str | None = None,
    step: float = 0.1,
    per_layer: bool = False,
    min_heads_per_layer: int = 0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seed: int = 0,
    score_kwargs: Mapping | None = None,
    on_step: Callable[[CurvePoint], None] | None = None,
    checkpoint: Checkpoint | None = None,
    unit: str = "head",
    group_score: str = "sum",
    recover: str | None = None,
    recover_kwargs: Mapping | None = None,
    scores: HeadScores | None = None,
) -> ScheduleResult:
    """Score, mask and re-score down to ``n_keep`` heads; record held-out quality per step.

    ``iterative``: remove ``step`` of the original heads per step, re-scoring with the
    current mask (gates at 0 for removed heads) each time. ``one-shot``: score once and
    remove down to the target, still recording the curve at each step's size. None:
    `default_schedule` of ``method`` (one-shot where ``scores`` are given). Masks
    are trials: the model's gates are as they were when this returns; call `prune`
    with the result's plan to remove the weights. With a ``checkpoint`` each finished
    step (and each scoring's progress) is saved, and a call with the same checkpoint
    resumes where the last one stopped.

    ``unit="kv-group"`` counts and removes whole GQA groups (`select_groups`, scored by
    ``group_score``): ``n_keep`` and ``step`` are then in groups, and the curve's
    fraction pruned is the fraction of groups (of key/value heads) gone.

    ``recover`` (a training-free `headlab.recover` method, with ``recover_kwargs``):
    after each step the heads chosen so far are removed from a copy of ``model`` and
    the copy repaired toward ``model`` on ``scoring``; the step's quality is that of
    the repaired copy, and the next scoring scores it. Each step's copy starts again
    from ``model``, so the last step's is what `prune` then ``recover`` of the plan give.

    ``scores``: heads (or groups) chosen by these, computed elsewhere (a detector's, or
    DuoAttention's gates), instead of by scoring; ``method`` then names them in the
    checkpoint. Nothing re-scores them, so the schedule must be ``one-shot``.
    """
    if schedule is None:
        schedule = "one-shot" if scores is not None else default_schedule(method)
    if schedule not in SCHEDULES:
        raise UserError(f"schedule must be 'iterative' or 'one-shot', got {schedule!r}")
    if not 0 < step <= 1:
        raise UserError(f"step must be in (0, 1], got {step}")
    if unit not in UNITS:
        raise UserError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    groups = kv_groups(model) if unit == "kv-group" else None
    total = (sum(len(g) for g in groups) if groups is not None
             else model.n_layers * model.n_original_heads)
    what = "groups" if groups is not None else "heads"
    if not 1 <= n_keep <= total:
        raise UserError(f"n_keep must be between 1 and {total} {what} (the model has "
                        f"{total}), got {n_keep}")
    if scores is not None and schedule != "one-shot":
        raise UserError("scores given to prune_to_target are not re-scored: use "
                        "schedule='one-shot'")
    if recover is not None and recover not in TRAINING_FREE:
        raise UserError(f"recovery after each step takes a method that needs no training "
                        f"({', '.join(TRAINING_FREE)}), got {recover!r}")
    kw = dict(score_kwargs or {})
    per_step = max(1, round(step * total))
    key = (f"prune/{method}" + ("/kv-group" if groups is not None else "")
           + (f"/recover-{recover}" if recover is not None else ""))
    current = model  # what is measured and scored: the masked model, or its repaired copy

    def choose(scores: HeadScores, n: int) -> PrunePlan:
        if groups is None:
            return select(scores, n, per_layer=per_layer,
                          min_heads_per_layer=min_heads_per_layer)
        return select_groups(scores, groups, n, per_layer=per_layer, group_score=group_score)

    def measure(n_kept: int) -> CurvePoint:
        q = evaluate(current, heldout, batch_size=batch_size)
        heads = n_kept if groups is None else sum(int((g != 0).sum()) for g in current.gates())
        point = CurvePoint(round(1 - n_kept / total, 6), q.value, q.loss, heads)
        if on_step:
            on_step(point)
        return point

    def scored(i: int) -> HeadScores:  # the i-th scoring, under the current mask
        if scores is not None:
            return scores
        return score(current, scoring, method=method, batch_size=batch_size, seed=seed + i,
                     checkpoint=checkpoint, checkpoint_key=f"{key}/score{i}",
                     **({"target": n_keep, "unit": unit} if method in TARGETED else {}), **kw)

    def repaired(plan: PrunePlan) -> HeadModel:
        if not any(plan.pruned.values()):
            return model
        copy = prune(copy_model(model), plan)
        recover_model(copy, model, scoring, method=recover, batch_size=batch_size,
               **dict(recover_kwargs or {}))
        return copy

    def save(plan: PrunePlan) -> None:
        if checkpoint is not None:
            masked = {str(k): v for k, v in plan.pruned.items()}
            checkpoint.put(key, {"masked": masked, "curve": [p.to_json() for p in curve],
                                 "n_now": n_now,
                                 "step_scores": [sc.to_json() for sc in step_scores]})

    with trial(model):
        saved = checkpoint.get(key) if checkpoint is not None else None
        if saved is not None:  # resume: the mask, curve and scores of the last finished step
            masked = {int(k): list(v) for k, v in saved["masked"].items()}
            model.mask_heads(masked)
            curve = [CurvePoint.from_json(p) for p in saved["curve"]]
            step_scores = [HeadScores.from_json(j) for j in saved["step_scores"]]
            n_now = saved["n_now"]
            if recover is not None and n_now > n_keep:  # the step's repaired copy, again
                current = repaired(_plan_of(step_scores[0], masked))
        else:
            masked = {}
            n_now = total if groups is not None else sum(model.heads_per_layer)
            curve = [measure(n_now)]
            step_scores = [scored(0)]
        plan = _plan_of(step_scores[0], masked)
        save(plan)
        while n_now > n_keep:
            n_now = max(n_keep, n_now - per_step)
            # each step's plan lists every head pruned so far: they score NaN (iterative)
            # or rank lower (one-shot); decided once, applied on every rank
            plan = distributed.broadcast(choose(step_scores[-1], n_now))
            if recover is None:
                model.mask_heads(plan.pruned)
            else:
                current = repaired(plan)
            curve.append(measure(n_now))
            if schedule == "iterative" and n_now > n_keep:
                step_scores.append(scored(len(step_scores)))
            save(plan)
    return ScheduleResult(plan, step_scores[0], curve, step_scores)


def _plan_of(first: HeadScores, masked: Mapping[int, list[int]]) -> PrunePlan:
    """The plan a schedule holds once ``masked`` is masked: the heads its first scoring
    saw (not NaN) less ``masked`` are kept, in the form `select` gives."""
    kept, pruned = {}, {}
    for layer, row in enumerate(first.scores):
        gone = set(masked.get(layer, ()))
        kept[layer] = [h for h, v in enumerate(row) if not math.isnan(v) and h not in gone]
        pruned[layer] = [h for h in range(len(row)) if h not in set(kept[layer])]
    return PrunePlan(kept, pruned)


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
    and once per random seed, all from the unpruned model, which is left as it was;
    random takes no scoring options. A loss is the change in the model's metric in
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
    n_keep = heads_to_keep(model.n_layers * model.n_original_heads, keep=keep)
    shared = dict(prune_kw.pop("score_kwargs", None) or {})
    batch_size = prune_kw.get("batch_size", DEFAULT_BATCH_SIZE)
    before = evaluate(model, heldout, batch_size=batch_size)
    sign = -1 if before.higher_is_better else 1
    runs = [(label, name, 0, {**shared, **kw}) for label, (name, kw) in trials.items()]
    runs += [(f"random:{seed}", "random", seed, {}) for seed in seeds]
    lost: dict[str, float] = {}
    for label, name, seed, kw in track(runs, total=len(runs),
                                       description="pruning by each method and at random"):
        res = prune_to_target(model, scoring, heldout, method=name, n_keep=n_keep, seed=seed,
                              score_kwargs=kw, **prune_kw)
        # the curve's last point is the held-out quality at the final plan
        lost[label] = sign * (res.curve[-1].quality - before.value)
    random_mean = sum(lost[f"random:{s}"] for s in seeds) / len(seeds)
    ratios = {m: lost[m] / random_mean if random_mean > 0 else math.nan for m in trials}
    return {"metric": before.metric, "before": before.value, "lost": lost,
            "random_mean": random_mean, "ratios": ratios, "ratio": ratios[next(iter(trials))]}
