"""How far each importance method and each head-type detector predicts what removing a
head really costs.

The ground truth is each head's single-head ablation cost on held-out blocks: per
example, the objective's loss with that head's gate at 0 minus the loss with every head
on (``cost[x, head]``). For every method (scored on the scoring blocks) and every
detector the table gives:

    spearman   the rank correlation between the method's scores and the mean cost over
               held-out examples, across the present heads
    ci         its 95% percentile bootstrap interval, resampling the held-out examples
               (a method's scores stay fixed; random's are drawn afresh per resample, so
               its interval holds the spread of a random scorer too)
    auc_ratio  the area under the method's one-shot pruning curve (held-out loss
               increase, heads removed lowest score first, at each fraction of
               `fractions`), divided by the mean area of random scores over the seeds:
               under 1 the method prunes better than chance

Detectors are read as importance too: a head with a higher score is kept longer.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from headlab._util.progress import track
from headlab.data.blocks import Blocks
from headlab.detectors import detect, kinds_for
from headlab.importance import METHODS, TARGETED, HeadScores, score
from headlab.models.base import HeadModel
from headlab.objectives import DEFAULT_BATCH_SIZE, objective_for

__all__ = ["MethodCheck", "Validation", "ablation_costs", "spearman", "validate"]

FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5)


@dataclass
class MethodCheck:
    """One row of the table: a method or detector against the true ablation cost."""

    name: str
    family: str  # "importance" or "detector"
    spearman: float
    ci: tuple[float, float]
    auc_ratio: float
    curve: list[float] = field(default_factory=list)  # loss increase at each fraction


@dataclass
class Validation:
    """Every method's and detector's agreement with the true single-head ablation cost."""

    model: str
    metric: str
    n_examples: int
    n_boot: int
    fractions: list[float]
    true_cost: list[list[float]]  # layers x original heads, mean over held-out examples
    rows: list[MethodCheck]
    random_curve: list[float]

    def row(self, name: str) -> MethodCheck:
        return next(r for r in self.rows if r.name == name)

    def to_json(self) -> dict:
        """A JSON-ready dict; NaN (a pruned head, a ratio without a random area) as null."""
        return _nan_to_none(asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> Validation:
        d = _none_to_nan(dict(d))
        d["rows"] = [MethodCheck(**{**r, "ci": tuple(r["ci"])}) for r in d["rows"]]
        return cls(**d)

    def table(self) -> str:
        """A Markdown table, methods first, then detectors."""
        lines = ["| method | kind | Spearman vs ablation cost | 95% CI | pruning AUC / random |",
                 "|---|---|---:|---|---:|"]
        for r in self.rows:
            lines.append(f"| {r.name} | {r.family} | {r.spearman:+.3f} | "
                         f"[{r.ci[0]:+.3f}, {r.ci[1]:+.3f}] | {r.auc_ratio:.3f} |")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><td>{html.escape(r.name)}</td><td>{r.family}</td><td>{r.spearman:+.3f}</td>"
            f"<td>[{r.ci[0]:+.3f}, {r.ci[1]:+.3f}]</td><td>{r.auc_ratio:.3f}</td></tr>"
            for r in self.rows)
        return (f"<div><b>score validation</b> on {html.escape(self.model)}: "
                f"{self.n_examples} held-out examples, {self.n_boot} bootstrap draws<table>"
                "<tr><th>method</th><th>kind</th><th>Spearman</th><th>95% CI</th>"
                f"<th>AUC / random</th></tr>{body}</table></div>")


def _nan_to_none(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_nan_to_none(v) for v in x]
    return x


def _none_to_nan(x):
    if x is None:
        return math.nan
    if isinstance(x, dict):
        return {k: _none_to_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_none_to_nan(v) for v in x]
    return x


def spearman(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Spearman's rank correlation over the last dim (average ranks for ties); y may
    carry leading batch dims. x (N,), y (..., N) -> (...)."""
    rx, ry = _ranks(x.double()), _ranks(y.double())
    rx = rx - rx.mean(-1, keepdim=True)
    ry = ry - ry.mean(-1, keepdim=True)
    return (rx * ry).sum(-1) / (rx.pow(2).sum(-1) * ry.pow(2).sum(-1)).sqrt()


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (1-based) along the last dim: (..., N) -> (..., N)."""
    less = (x[..., None, :] < x[..., :, None]).sum(-1)  # (..., N): how many are below
    same = (x[..., None, :] == x[..., :, None]).sum(-1)
    return less.double() + (same.double() + 1) / 2


@torch.no_grad()
def ablation_costs(model: HeadModel, blocks: Blocks, *,
                   batch_size: int = DEFAULT_BATCH_SIZE) -> tuple[torch.Tensor, list]:
    """Per held-out example and present head, the loss with that head gated off minus
    the loss with all heads on: (N, number of present heads) and the heads as
    (layer, original id) in column order."""
    objective = objective_for(model)

    def losses() -> torch.Tensor:
        return torch.cat([objective.example_losses(model, b)[0].double().cpu()
                          for b in blocks.batches(batch_size)])

    base = losses()
    heads = [(i, p, h) for i, a in enumerate(model.attentions)
             for p, h in enumerate(a.head_ids.tolist()) if a.head_gate[p] != 0]
    cols = []
    for i, p, _ in track(heads, total=len(heads), description="ablating heads"):
        attn = model.attentions[i]
        old = attn.head_gate.clone()
        gates = old.clone()
        gates[p] = 0
        attn.set_gates(gates)
        try:
            cols.append(losses() - base)
        finally:
            attn.set_gates(old)
    return torch.stack(cols, 1), [(i, h) for i, _, h in heads]


@torch.no_grad()
def _curve(model: HeadModel, blocks: Blocks, ranked: Sequence[tuple[int, int]],
           fractions: Sequence[float], base: float, batch_size: int) -> list[float]:
    """Held-out loss increase with the first ``fraction`` of ``ranked`` heads masked."""
    objective = objective_for(model)
    total = len(ranked)
    out = []
    saved = [a.head_gate.clone() for a in model.attentions]
    try:
        for f in track(fractions, total=len(fractions),
                       description="held-out loss with the ranked heads masked"):
            for a, g in zip(model.attentions, saved, strict=True):
                a.set_gates(g)
            chosen: dict[int, list[int]] = {}
            for layer, head in ranked[:round(f * total)]:
                chosen.setdefault(layer, []).append(head)
            model.mask_heads(chosen)
            loss, count = 0.0, 0.0
            for b in blocks.batches(batch_size):
                per, c, _ = objective.example_losses(model, b)
                loss += float((per.double() * c).sum())
                count += float(c.sum())
            out.append(loss / max(count, 1.0) - base)
    finally:
        for a, g in zip(model.attentions, saved, strict=True):
            a.set_gates(g)
    return out


def validate(model: HeadModel, scoring: Blocks, heldout: Blocks, *,
             methods: Sequence[str] = METHODS, detectors: Sequence[str] | None = None,
             fractions: Sequence[float] = FRACTIONS, random_seeds: Sequence[int] = (0, 1, 2),
             batch_size: int = DEFAULT_BATCH_SIZE, n_boot: int = 1000, seed: int = 0,
             name: str = "") -> Validation:
    """The table of the module docstring for ``methods`` and ``detectors`` (default:
    every detector that applies; ``()`` for none). Both block sets must be prepared."""
    costs, heads = ablation_costs(model, heldout, batch_size=batch_size)
    mean_cost = costs.mean(0)  # (n_heads,)
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(costs.shape[0], (n_boot, costs.shape[0]), generator=gen)
    boot_cost = costs[draws].mean(1)  # (n_boot, n_heads)
    objective = objective_for(model)
    base = 0.0
    count = 0.0
    with torch.no_grad():
        for b in heldout.batches(batch_size):
            per, c, _ = objective.example_losses(model, b)
            base += float((per.double() * c).sum())
            count += float(c.sum())
    base /= max(count, 1.0)

    def area(curve: list[float]) -> float:
        xs, ys = [0.0, *fractions], [0.0, *curve]
        return sum((xs[k + 1] - xs[k]) * (ys[k + 1] + ys[k]) / 2 for k in range(len(curve)))

    def check(scores: HeadScores, family: str) -> MethodCheck:
        values = torch.tensor([scores.scores[layer][head] for layer, head in heads],
                              dtype=torch.float64)
        values = torch.nan_to_num(values, nan=-math.inf)
        order = sorted(range(len(heads)), key=lambda k: float(values[k]))
        curve = _curve(model, heldout, [heads[k] for k in order], fractions, base, batch_size)
        rho = float(spearman(values, mean_cost))
        if scores.method == "random":  # a fresh random scorer per draw: (n_boot, n_heads)
            fresh = torch.rand(boot_cost.shape, generator=gen, dtype=torch.float64)
            boot = torch.stack([spearman(fresh[k], boot_cost[k]) for k in range(n_boot)])
        else:
            boot = spearman(values, boot_cost)
        lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        return MethodCheck(scores.method, family, rho, (lo, hi), area(curve), curve)

    rows = []
    random_curves = []
    for s in random_seeds:
        r = score(model, scoring, method="random", seed=s, batch_size=batch_size)
        values = [r.scores[layer][head] for layer, head in heads]
        order = sorted(range(len(heads)), key=lambda k: values[k])
        random_curves.append(_curve(model, heldout, [heads[k] for k in order], fractions,
                                    base, batch_size))
    random_curve = [sum(c[k] for c in random_curves) / len(random_curves)
                    for k in range(len(fractions))]
    random_area = area(random_curve)
    for method in methods:
        # a method that trains toward a count (gates) aims at half the heads
        target = {"target": max(1, len(heads) // 2)} if method in TARGETED else {}
        rows.append(check(score(model, scoring, method=method, batch_size=batch_size,
                                seed=seed, **target), "importance"))
    for kind in kinds_for(model) if detectors is None else detectors:
        rows.append(check(detect(model, kind, seed=seed), "detector"))
    for r in rows:
        r.auc_ratio = r.auc_ratio / random_area if random_area > 0 else math.nan
    true = torch.full((model.n_layers, model.n_original_heads), math.nan, dtype=torch.float64)
    for k, (layer, head) in enumerate(heads):
        true[layer, head] = mean_cost[k]
    return Validation(name or getattr(model, "family", ""), objective.metric, costs.shape[0],
                      n_boot, list(fractions), true.tolist(), rows, random_curve)
