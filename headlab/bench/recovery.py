"""``headlab bench recovery``: how much of what pruning took the default repair gives
back, on the real bundled models, and what it costs against one michel scoring; and the
trade-off table: quality, parameters, key/value cache and latency at each of ``keeps``.

Each model is pruned by `headlab prune`'s default method in its default schedule, as
`headlab prune --keep` would at each of ``keeps`` (`_plans`): a score of one head at a
time runs its schedule once, down to the smallest of ``keeps``, each size's plan the one
that schedule stopped there would choose (`ScheduleResult.plan_at`); the gates train
toward each size. Each pruned model is
measured on held-out data as it is (``none``) and after ``method``; the targets are
judged at ``keep``. The quality figures are not timings; the time ratio is one run of
each on the same data, and the latency a median of interleaved rounds against the
unpruned model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from headlab.bench._common import BenchResult
from headlab.bench._data import describe, scoring_and_heldout
from headlab.bench._parts import Parts, measure_part
from headlab.importance import TARGETED
from headlab.runs.config import DEFAULT_METHOD, RunConfig
from headlab.schedule import default_schedule

__all__ = ["RecoverySizes", "bench_recovery"]


@dataclass(frozen=True, kw_only=True)
class RecoverySizes:
    """Each of ``runs`` (bundled model, sequence length, token budget, scoring options)
    pruned by ``prune_method`` to ``keep`` in steps of ``step``, then repaired by
    ``method``; ``targets`` bounds the loss kept after the repair as a fraction of the
    loss without it."""

    runs: tuple[tuple[str, int, int, tuple[tuple[str, bool], ...]], ...] = (
        ("smollm2-135m", 128, 8192, ()), ("gemma3-270m", 128, 8192, ()),
        ("minilm-l6", 128, 8192, (("normalize", False),)))
    data: str | None = "enwiki"  # None: the bundled text
    keep: float = 0.6  # the targets' size; one of ``keeps``
    keeps: tuple[float, ...] = (0.8, 0.6, 0.4)  # the trade-off table's sizes
    step: float = RunConfig.step
    batch: int = 8
    prune_method: str = DEFAULT_METHOD  # what `headlab prune` chooses heads with
    method: str = "lsq"
    targets: dict[str, float] = field(default_factory=lambda: {"smollm2-135m": 0.25,
                                                               "gemma3-270m": 0.25,
                                                               "minilm-l6": 0.5})
    # other repairs measured at ``keep`` on the same pruned model, each with its bound on
    # the loss kept (of the loss without repair): Kwon et al.'s rescale no worse than none
    also: dict[str, float] = field(default_factory=lambda: {"rescale": 1.0})
    # distillation after ``method`` on the causal LMs: calibration tokens it trains on
    # (read from the corpus apart from the scoring blocks), its bound on the loss kept
    # (of the loss without repair) and on its seconds
    distill_tokens: int | None = 32768
    distill_target: float = 0.1
    distill_seconds: float = 600.0
    # the trade-off table's latency: one forward of batch 1 at this many tokens (capped by
    # the model's positions), the median of ``latency_rounds`` interleaved rounds
    latency_length: int = 2048
    latency_rounds: int = 3

    def __post_init__(self) -> None:
        if self.keep not in self.keeps:
            raise ValueError(f"keep {self.keep} must be one of keeps {self.keeps}")


def bench_recovery(sizes: RecoverySizes, *, device: str = "cpu", models=None,
                   parts: Parts | None = None) -> BenchResult:
    """Loss kept after ``sizes.method`` / loss without repair, its time / michel's, that
    the repair of an unpruned model changes no output, and the trade-off table
    (``checks["tradeoff"]``: one row per model and size, the unpruned model's first).
    Each model is one of ``parts`` (`headlab.bench._parts`)."""
    res = BenchResult.of_sizes("recovery", sizes)
    res.method = {
        "data": f"{describe(sizes.data)}; recovery fits on the scoring part only",
        "pruning": _pruning(sizes),
        "kept": f"held-out loss kept after headlab.recover(method='{sizes.method}') / "
                "held-out loss with no repair (perplexity increase or fidelity decrease)",
        "time": f"seconds of headlab.recover(method='{sizes.method}') / seconds of one "
                "headlab.score(method='michel') on the same scoring blocks",
        "tradeoff": "per model and keep: query heads, parameters, key/value cache bytes per "
                    f"token, held-out quality with no repair and after {sizes.method}, and "
                    f"the median forward time (batch 1, min({sizes.latency_length}, "
                    f"positions) tokens, {sizes.latency_rounds} rounds interleaved with the "
                    f"unpruned model's) of the model after {sizes.method}",
    }
    res.checks["tradeoff"] = []
    for run in sizes.runs:
        measure_part(parts, res, run[0], lambda run=run: _measure(res, sizes, device, *run))
    return res


def _measure(res: BenchResult, sizes: RecoverySizes, device: str, name: str, seq_len: int,
             max_tokens: int, options) -> None:
    """One model of the benchmark: its figures, targets, checks and trade-off rows."""
    import headlab
    from headlab.selection import heads_to_keep

    model = headlab.load(name, device=device)
    scoring, heldout = scoring_and_heldout(model, sizes.data, seq_len=seq_len,
                                           max_tokens=max_tokens, batch_size=sizes.batch)
    score_kw = dict(options)
    before = headlab.evaluate(model, heldout, batch_size=sizes.batch)
    total = model.n_layers * model.n_original_heads
    n_keeps = {keep: heads_to_keep(total, keep=keep) for keep in sizes.keeps}
    plans = _plans(model, scoring, heldout, n_keeps, sizes, score_kw)
    t0 = time.perf_counter()
    headlab.score(model, scoring, method="michel", batch_size=sizes.batch, **score_kw)
    t_michel = time.perf_counter() - t0
    _repair_of_unpruned(res, name, model, scoring, heldout, sizes, device)
    metric = before.metric
    res.add(f"{name}.{metric}_before", [before.value], metric)
    rows = [_row(name, 1.0, model, before.value, before.value, None, sizes)]
    for keep in sorted(sizes.keeps, reverse=True):
        measured = _prune_and_repair(model, plans[keep], scoring, heldout, sizes)
        rows.append(_row(name, keep, measured.model, measured.pruned, measured.repaired,
                         measured.latency, sizes))
        if keep != sizes.keep:
            continue
        sign = -1 if before.higher_is_better else 1
        lost_none = sign * (measured.pruned - before.value)
        lost_after = sign * (measured.repaired - before.value)
        res.checks[f"{name}.layers"] = [e.to_json() for e in measured.report.layers]
        res.add(f"{name}.{metric}_pruned", [measured.pruned], metric)
        res.add(f"{name}.{metric}_recovered", [measured.repaired], metric)
        res.add(f"{name}.kept_over_none", [lost_after / lost_none], "x")
        res.add(f"{name}.recover_over_michel", [measured.seconds / t_michel], "x")
        what = (f"{name} {metric} lost at keep {keep} after {sizes.method} / without "
                f"repair (S={seq_len}, {max_tokens} tokens)")
        res.add_target(f"{name}.kept_over_none", target=sizes.targets.get(name, 0.5),
                       op="<=", what=what)
        res.add_target(f"{name}.recover_over_michel", target=1.0, op="<=",
                       what=f"{name} {sizes.method} time / michel scoring time")
        for other, bound in sizes.also.items():
            _other_repair(res, name, other, bound, model, plans[keep], scoring, heldout,
                          sizes, before.value, lost_none, sign)
        if sizes.distill_tokens and model.kind == "causal-lm":
            _distill_after(res, name, measured.model, model, heldout, sizes, seq_len,
                           before, lost_none, sign)
    rows[0]["latency_ms"] = rows[1]["latency_before_ms"]
    res.checks["tradeoff"] += [{**row, "metric": metric} for row in rows]


def _pruning(sizes: RecoverySizes) -> str:
    """How each keep's plan is chosen, in words (`_plans`)."""
    call = (f"headlab.prune_to_target(method='{sizes.prune_method}', step={sizes.step}, "
            f"{default_schedule(sizes.prune_method)}")
    if sizes.prune_method in TARGETED:
        return f"{call}) toward each of keeps {sizes.keeps}, then headlab.prune"
    return (f"{call}, keep={min(sizes.keeps)}); each of keeps {sizes.keeps} is the plan that "
            "schedule stopped there chooses (ScheduleResult.plan_at), then headlab.prune")


def _plans(model, scoring, heldout, n_keeps: dict[float, int], sizes: RecoverySizes,
           score_kw: dict) -> dict:
    """Each keep's plan, as `headlab prune --keep` chooses it: the scores of one head at a
    time run one schedule down to the smallest keep, stopped at each size; a method that
    trains toward its target (the gates) trains toward each size."""
    from headlab.schedule import prune_to_target

    def schedule(n_keep: int):
        return prune_to_target(model, scoring, heldout, n_keep=n_keep, step=sizes.step,
                               method=sizes.prune_method, batch_size=sizes.batch,
                               score_kwargs=score_kw)

    if sizes.prune_method in TARGETED:
        return {keep: schedule(n).plan for keep, n in n_keeps.items()}
    once = schedule(min(n_keeps.values()))
    return {keep: once.plan_at(n) for keep, n in n_keeps.items()}


@dataclass
class _Measured:
    """A pruned and repaired copy, its held-out quality before and after the repair,
    the repair's report and seconds, and its latency against the unpruned model's."""

    model: object
    pruned: float
    repaired: float
    report: object
    seconds: float
    latency: tuple[float, float]  # (unpruned, this) ms


def _prune_and_repair(model, plan, scoring, heldout, sizes: RecoverySizes) -> _Measured:
    import headlab
    from headlab.evaluate.latency import compare_latency
    from headlab.pruning import copy_model, prune

    pruned = prune(copy_model(model), plan)
    q_pruned = headlab.evaluate(pruned, heldout, batch_size=sizes.batch).value
    t0 = time.perf_counter()
    report = headlab.recover(pruned, model, scoring, method=sizes.method,
                             batch_size=sizes.batch)
    seconds = time.perf_counter() - t0
    q_after = headlab.evaluate(pruned, heldout, batch_size=sizes.batch).value
    latency = compare_latency(model, pruned, 1, sizes.latency_length,
                              rounds=sizes.latency_rounds)
    return _Measured(pruned, q_pruned, q_after, report, seconds, latency)


def _row(name: str, keep: float, model, pruned: float, repaired: float,
         latency: tuple[float, float] | None, sizes: RecoverySizes) -> dict:
    """One line of the trade-off table (the unpruned model's latency is filled from its
    first comparison)."""
    from headlab.objectives import objective_for

    return {"model": name, "keep": keep, "heads": sum(model.heads_per_layer),
            "params": model.num_parameters(),
            "kv_bytes_per_token": (model.kv_cache_bytes_per_token()
                                   if objective_for(model).generates else None),  # no cache
            "pruned": pruned, "repaired": repaired,
            "latency_ms": None if latency is None else latency[1],
            "latency_before_ms": None if latency is None else latency[0],
            "latency_tokens": min(sizes.latency_length, model.max_positions)}


def _repair_of_unpruned(res: BenchResult, name: str, model, scoring, heldout,
                        sizes: RecoverySizes, device: str) -> None:
    """The repair of a copy with every head kept must change no output."""
    import torch

    import headlab
    from headlab.pruning import copy_model

    unpruned = copy_model(model)
    batch = next(heldout.batches(sizes.batch))
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    with torch.no_grad():
        ref_out = _output(model(ids, attention_mask=mask))
        headlab.recover(unpruned, model, scoring, method=sizes.method, batch_size=sizes.batch)
        same = float((_output(unpruned(ids, attention_mask=mask)) - ref_out).abs().max())
    res.checks[f"{name}.keep_1_max_abs_diff"] = same
    res.add(f"{name}.keep_1_max_abs_diff", [same], "abs")
    res.add_target(f"{name}.keep_1_max_abs_diff", target=1e-6, op="<=",
                   what=f"{name} {sizes.method} on the unpruned model: max output change")


def _other_repair(res: BenchResult, name: str, method: str, bound: float, model, plan,
                  scoring, heldout, sizes: RecoverySizes, before: float, lost_none: float,
                  sign: int) -> None:
    """``method`` in place of ``sizes.method`` on a fresh copy pruned by the same plan: the
    loss it keeps (of none's), held to ``bound``."""
    import headlab
    from headlab.pruning import copy_model, prune

    pruned = prune(copy_model(model), plan)
    headlab.recover(pruned, model, scoring, method=method, batch_size=sizes.batch)
    q = headlab.evaluate(pruned, heldout, batch_size=sizes.batch)
    res.add(f"{name}.{method}_kept_over_none", [sign * (q.value - before) / lost_none], "x")
    res.add_target(f"{name}.{method}_kept_over_none", target=bound, op="<=",
                   what=f"{name} {q.metric} lost at keep {sizes.keep} after {method} / "
                        "without repair")


def _distill_after(res: BenchResult, name: str, pruned, model, heldout, sizes: RecoverySizes,
                   seq_len: int, before, lost_none: float, sign: int) -> None:
    """Distil the repaired ``pruned`` toward ``model`` on ``sizes.distill_tokens`` of
    calibration text (from the same calibration articles as the scoring blocks); the
    loss it keeps on the same held-out blocks (of none's) and its seconds, against their
    bounds."""
    import headlab

    train, _ = scoring_and_heldout(model, sizes.data, seq_len=seq_len,
                                   max_tokens=sizes.distill_tokens, batch_size=sizes.batch)
    t0 = time.perf_counter()
    report = headlab.recover(pruned, model, train, method="distill", start="none",
                             batch_size=sizes.batch, tokens=sizes.distill_tokens)
    seconds = time.perf_counter() - t0
    q = headlab.evaluate(pruned, heldout, batch_size=sizes.batch)
    lost = sign * (q.value - before.value)
    res.checks[f"{name}.distill"] = report.to_json()
    res.add(f"{name}.{before.metric}_distilled", [q.value], before.metric)
    res.add(f"{name}.distill_kept_over_none", [lost / lost_none], "x")
    res.add(f"{name}.distill_seconds", [seconds], "s")
    res.add_target(f"{name}.distill_kept_over_none", target=sizes.distill_target, op="<=",
                   what=f"{name} {before.metric} lost at keep {sizes.keep} after "
                        f"{sizes.method} + distill ({sizes.distill_tokens} calibration "
                        "tokens) / without repair")
    res.add_target(f"{name}.distill_seconds", target=sizes.distill_seconds, op="<=",
                   what=f"{name} distill seconds on this machine")


def _output(out):
    """The tensor a model's output is judged by: logits, else the sentence embedding."""
    return out.logits if out.logits is not None else out.embeddings
