"""``headlab bench recovery``: how much of what pruning took the default repair gives
back, on the real bundled models, and what it costs against one michel scoring.

Each model is pruned to ``keep`` by the default iterative michel schedule; the pruned
model is measured on held-out data as it is (``none``) and after ``method``. The
quality figure is not a timing; the time ratio is one run of each on the same data."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from headlab.bench._common import BenchResult
from headlab.bench._data import describe, scoring_and_heldout

__all__ = ["RecoverySizes", "bench_recovery"]


@dataclass(frozen=True, kw_only=True)
class RecoverySizes:
    """Each of ``runs`` (bundled model, sequence length, token budget, michel's options)
    pruned to ``keep`` in steps of ``step``, then repaired by ``method``; ``targets``
    bounds the loss kept after the repair as a fraction of the loss without it."""

    runs: tuple[tuple[str, int, int, tuple[tuple[str, bool], ...]], ...] = (
        ("smollm2-135m", 128, 8192, ()), ("gemma3-270m", 128, 8192, ()),
        ("minilm-l6", 128, 8192, (("normalize", False),)))
    data: str | None = "enwiki"  # None: the bundled text
    keep: float = 0.6
    step: float = 0.1
    batch: int = 8
    method: str = "lsq"
    targets: dict[str, float] = field(default_factory=lambda: {"smollm2-135m": 0.25,
                                                               "gemma3-270m": 0.25,
                                                               "minilm-l6": 0.5})
    # distillation after ``method`` on the causal LMs: calibration tokens it trains on
    # (read from the corpus apart from the scoring blocks), its bound on the loss kept
    # (of the loss without repair) and on its seconds
    distill_tokens: int | None = 65536
    distill_target: float = 0.1
    distill_seconds: float = 600.0


def bench_recovery(sizes: RecoverySizes, *, device: str = "cpu", models=None) -> BenchResult:
    """Loss kept after ``sizes.method`` / loss without repair, its time / michel's, and
    that the repair of an unpruned model changes no output."""
    import torch

    import headlab
    from headlab.pruning import copy_model, prune
    from headlab.schedule import prune_to_target
    from headlab.selection import heads_to_keep

    res = BenchResult.of_sizes("recovery", sizes)
    res.method = {
        "data": f"{describe(sizes.data)}; recovery fits on the scoring part only",
        "pruning": f"headlab.prune_to_target(method='michel', keep={sizes.keep}, "
                   f"step={sizes.step}, iterative), then headlab.prune",
        "kept": f"held-out loss kept after headlab.recover(method='{sizes.method}') / "
                "held-out loss with no repair (perplexity increase or fidelity decrease)",
        "time": f"seconds of headlab.recover(method='{sizes.method}') / seconds of one "
                "headlab.score(method='michel') on the same scoring blocks",
    }
    for name, seq_len, max_tokens, options in sizes.runs:
        model = headlab.load(name, device=device)
        scoring, heldout = scoring_and_heldout(model, sizes.data, seq_len=seq_len,
                                               max_tokens=max_tokens, batch_size=sizes.batch)
        score_kw = dict(options)
        before = headlab.evaluate(model, heldout, batch_size=sizes.batch)
        n_keep = heads_to_keep(model.n_layers * model.n_original_heads, keep=sizes.keep)
        plan = prune_to_target(model, scoring, heldout, n_keep=n_keep, step=sizes.step,
                               batch_size=sizes.batch, score_kwargs=score_kw).plan
        t0 = time.perf_counter()
        headlab.score(model, scoring, batch_size=sizes.batch, **score_kw)
        t_michel = time.perf_counter() - t0

        unpruned = copy_model(model)  # keep 1.0: the repair must change nothing
        batch = next(heldout.batches(sizes.batch))
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        with torch.no_grad():
            ref_out = _output(model(ids, attention_mask=mask))
            headlab.recover(unpruned, model, scoring, method=sizes.method,
                            batch_size=sizes.batch)
            same = float((_output(unpruned(ids, attention_mask=mask)) - ref_out).abs().max())
        del unpruned

        pruned = prune(copy_model(model), plan)
        q_pruned = headlab.evaluate(pruned, heldout, batch_size=sizes.batch)
        t0 = time.perf_counter()
        report = headlab.recover(pruned, model, scoring, method=sizes.method,
                                 batch_size=sizes.batch)
        t_recover = time.perf_counter() - t0
        q_after = headlab.evaluate(pruned, heldout, batch_size=sizes.batch)
        sign = -1 if before.higher_is_better else 1
        lost_none = sign * (q_pruned.value - before.value)
        lost_after = sign * (q_after.value - before.value)
        metric = before.metric
        res.checks[f"{name}.keep_1_max_abs_diff"] = same
        res.checks[f"{name}.layers"] = [e.to_json() for e in report.layers]
        res.add(f"{name}.{metric}_before", [before.value], metric)
        res.add(f"{name}.{metric}_pruned", [q_pruned.value], metric)
        res.add(f"{name}.{metric}_recovered", [q_after.value], metric)
        res.add(f"{name}.kept_over_none", [lost_after / lost_none], "x")
        res.add(f"{name}.recover_over_michel", [t_recover / t_michel], "x")
        res.add(f"{name}.keep_1_max_abs_diff", [same], "abs")
        what = (f"{name} {metric} lost at keep {sizes.keep} after {sizes.method} / without "
                f"repair (S={seq_len}, {max_tokens} tokens)")
        res.add_target(f"{name}.kept_over_none", target=sizes.targets.get(name, 0.5),
                       op="<=", what=what)
        res.add_target(f"{name}.recover_over_michel", target=1.0, op="<=",
                       what=f"{name} {sizes.method} time / michel scoring time")
        res.add_target(f"{name}.keep_1_max_abs_diff", target=1e-6, op="<=",
                       what=f"{name} {sizes.method} on the unpruned model: max output change")
        if sizes.distill_tokens and model.kind == "causal-lm":
            _distill_after(res, name, pruned, model, heldout, sizes, seq_len, before,
                           lost_none, sign)
    return res


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
