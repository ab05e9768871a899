"""``headlab bench quality``: held-out quality lost when pruning by each importance method
(michel with and without the layer norm, taylor, learned gates, FLAP's metric) against
random scores, those that depend on a seed averaged over three, at several keeps, each
before and after `lsq` repair, on the
real bundled models; and the validation table (`headlab.analysis.validation`): each
importance method's and detector's Spearman correlation with the true single-head
ablation cost, with its bootstrap interval. Not a timing but for the ratios of scoring
seconds: random weights have no heads worth keeping."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from headlab.bench._common import BenchResult
from headlab.bench._data import describe, scoring_and_heldout
from headlab.bench._parts import Parts, measure_part
from headlab.importance import JOINT, TARGETED
from headlab.importance.gates import DEFAULT_BATCH, DEFAULT_BUDGET, DEFAULT_LR, DEFAULT_STEPS
from headlab.runs.config import DEFAULT_METHOD, RunConfig

log = logging.getLogger(__name__)

__all__ = ["QUALITY_TARGETED", "QUALITY_VARIANTS", "QualitySizes", "bench_quality"]


@dataclass(frozen=True, kw_only=True)
class QualitySizes:
    """Each of ``runs`` pruned to each of ``keeps`` with each of ``methods`` and with
    random scores, measured pruned and after ``recover``; the targets are judged at
    ``keep`` (one of ``keeps``)."""

    # (bundled model, sequence length, token budget): real models only; the longest part
    # first, so that a run split over sessions with --resume splits it least
    runs: tuple[tuple[str, int, int], ...] = (("gemma3-270m", 128, 4096),
                                               ("smollm2-135m", 128, 4096),
                                               ("minilm-l6", 128, 8192))
    data: str | None = "enwiki"  # None: the bundled text
    keeps: tuple[float, ...] = (0.8, 0.6, 0.4)
    keep: float = 0.6
    # the iterative schedule's step (michel, taylor, random): headlab prune's, so the
    # default method is timed and judged as a user runs it
    step: float = RunConfig.step
    batch: int = 4
    methods: tuple[str, ...] = ("michel_unnormalised", "michel", "taylor", "gates", "flap")
    recover: str = "lsq"
    gate_steps: int = DEFAULT_STEPS  # the gates' training, as `headlab prune` trains them
    gate_lr: float = DEFAULT_LR
    gate_budget: str = DEFAULT_BUDGET
    gate_batch: int = DEFAULT_BATCH
    # the seeds of every method whose choice depends on one (`SEEDED`): its figures are
    # the mean over them, as the bar's baseline, random, is
    seeds: tuple[int, ...] = (0, 1, 2)
    # score validation: (bundled model, sequence length, token budget) per run
    validate: tuple[tuple[str, int, int], ...] = (("smollm2-135m", 64, 1024),
                                                   ("minilm-l6", 64, 2048))
    n_boot: int = 1000


# the labels of QualitySizes.methods: (method, scoring options, as the bench's table says
# it). Michel et al. divide each layer's scores by their l2 norm (headlab's default for
# michel); the bar against random is held for michel with and without it, and for taylor
QUALITY_VARIANTS = {
    "michel": ("michel", {}, "michel with the layer l2 norm (the paper's)"),
    "michel_unnormalised": ("michel", {"normalize": False}, "michel without the layer norm"),
    "taylor": ("taylor", {}, "taylor"),
    "gates": ("gates", {}, "learned hard-concrete gates"),
    "flap": ("flap", {}, "FLAP's WIFV metric, adaptive across layers"),
}
# held to the bar against random: on every model, and on the causal LMs besides
QUALITY_TARGETED, DECODER_TARGETED = "michel_unnormalised", ("michel", "taylor")
GATES_BAR = ("michel", "michel_unnormalised", "taylor")  # gates are held against the best
# the methods whose heads depend on a seed (random scores, taylor's curvature probes, the
# gates' noise, which a last-bit change of the arithmetic can move to other heads): each is
# run with every one of QualitySizes.seeds, its row the mean, timed on the first seed
SEEDED = ("random", "taylor", "gates")
FLAP_REPAIR = "bias"  # FLAP's own bias compensation, `headlab.recover(method="bias")`


def bench_quality(sizes: QualitySizes, *, device: str = "cpu", models=None,
                  parts: Parts | None = None) -> BenchResult:
    """Held-out quality lost with each method vs random scores (``sizes.seeds``) at each keep,
    pruned and repaired, real models; gate training and FLAP's calibration seconds. Each
    model's grid, and each validation, is one of ``parts`` (`headlab.bench._parts`)."""
    if sizes.keep not in sizes.keeps:
        raise ValueError(f"the judged keep {sizes.keep} must be one of keeps {sizes.keeps}")
    res = BenchResult.of_sizes("quality", sizes)
    res.method = {
        "data": describe(sizes.data),
        "pruning": f"at each keep of {', '.join(map(str, sizes.keeps))}, from the unpruned "
                   f"model, each of {', '.join(SEEDED)} with each of the seeds {sizes.seeds} "
                   "(its figures the means over them) and the others once: michel, taylor "
                   f"and random by headlab.prune_to_target(method, schedule='iterative', "
                   f"step={sizes.step}) run "
                   "once to the smallest keep, each keep's plan the one that schedule "
                   "stopped there chooses (ScheduleResult.plan_at); "
                   f"{' and '.join(JOINT)}, which choose across layers jointly, scored once "
                   "(gates trained toward that keep's number of heads, "
                   f"{sizes.gate_steps} steps of {sizes.gate_batch} blocks at lr "
                   f"{sizes.gate_lr}, {sizes.gate_budget} budget) and the top heads kept "
                   "(headlab.select); "
                   "the chosen heads removed (headlab.prune) and measured, then repaired "
                   f"from the same pruned model by headlab.recover(method='{sizes.recover}') "
                   f"on the scoring blocks (flap also by '{FLAP_REPAIR}', FLAP's bias "
                   "compensation) and measured again",
        "lost": "held-out perplexity increase (causal LM) or fidelity decrease (sentence "
                "embeddings) after pruning",
        "ratio": f"at keep {sizes.keep}: lost with the method / mean lost with random "
                 "(target <= 0.5, for michel without the layer l2 norm, and on causal "
                 "LMs for michel and taylor too; the others reported beside it); gates' "
                 "lost / the least lost by "
                 f"{', '.join(GATES_BAR)} (target <= 0.7, causal LMs, pruned and after "
                 f"{sizes.recover}); {DEFAULT_METHOD} + {sizes.recover}'s lost / flap + "
                 f"{FLAP_REPAIR}'s (target <= 0.7, causal LMs)",
        "time": "seconds of headlab.score on the unpruned model's scoring blocks: gates "
                f"(trained toward keep {sizes.keep}) / michel (target <= 5); "
                f"{DEFAULT_METHOD}'s scorings in its schedule (each timed as one on the "
                f"unpruned model) + {sizes.recover} / flap's scoring + {FLAP_REPAIR} "
                "(target <= 3)",
    }
    for run in sizes.runs:
        measure_part(parts, res, run[0], lambda run=run: _measure(res, sizes, device, *run))
    for name, seq_len, max_tokens in sizes.runs:  # judged from the grids as the bars are now,
        # so that a part kept from an earlier run is held to the same bars as a new one
        _judge(res, name, res.checks[f"{name}.grid"], f"S={seq_len}, {max_tokens} tokens",
               sizes)
    for run in sizes.validate:
        measure_part(parts, res, f"validation:{run[0]}",
                     lambda run=run: _validation(res, *run, sizes, device))
    return res


def _measure(res: BenchResult, sizes: QualitySizes, device: str, name: str, seq_len: int,
             max_tokens: int) -> None:
    """One model of the benchmark: its grid, token counts, figures and targets."""
    import headlab

    model = headlab.load(name, device=device)
    scoring, heldout = scoring_and_heldout(model, sizes.data, seq_len=seq_len,
                                           max_tokens=max_tokens, batch_size=sizes.batch)
    grid = _grid(model, scoring, heldout, sizes)
    res.checks[f"{name}.grid"] = grid
    res.checks[f"{name}.tokens"] = {"scoring": int(scoring.attention_mask.sum()),
                                    "heldout": int(heldout.attention_mask.sum())}


def _grid(model, scoring, heldout, sizes: QualitySizes) -> dict:
    """Every method's held-out quality at each keep, pruned and repaired, with the
    seconds the targets compare. Rows: ``{"method", "repair", "quality": [per keep],
    "lost": [per keep]}``; the `SEEDED` methods' rows hold the means over
    ``sizes.seeds`` and ``samples`` (per keep, per seed). ``gates_ended``: each gate
    training's target and the expected number of gates open at its end."""
    import headlab
    from headlab.pruning import copy_model
    from headlab.selection import heads_to_keep

    total = model.n_layers * model.n_original_heads
    n_keeps = [heads_to_keep(total, keep=k) for k in sizes.keeps]
    judged = sizes.keeps.index(sizes.keep)
    before = headlab.evaluate(model, heldout, batch_size=sizes.batch)
    sign = -1 if before.higher_is_better else 1
    seconds: dict[str, float] = {}
    scorings: dict[str, int] = {}
    trained: list[dict] = []  # per gate training: its target and where it ended

    def scored(name: str, kw: dict, n_keep: int, seed: int = 0):  # one scoring, timed
        t0 = time.perf_counter()
        scores = headlab.score(model, scoring, method=name, batch_size=sizes.batch, **kw,
                               **({"seed": seed} if name in SEEDED else {}),
                               **({"target": n_keep, "gate_steps": sizes.gate_steps,
                                   "gate_lr": sizes.gate_lr, "gate_budget": sizes.gate_budget,
                                   "gate_batch": sizes.gate_batch}
                                  if name in TARGETED else {}))
        if name in TARGETED:
            trained.append({k: scores.extra[k] for k in ("target", "expected_open",
                                                         "target_met")})
        return scores, time.perf_counter() - t0

    def plans(label: str, name: str, kw: dict, seed: int, timing: bool) -> list:
        """One plan per keep."""
        if name not in JOINT:  # one schedule to the smallest keep holds every keep's plan
            r = headlab.prune_to_target(model, scoring, heldout, method=name,
                                        n_keep=min(n_keeps), step=sizes.step,
                                        batch_size=sizes.batch, seed=seed, score_kwargs=kw)
            if timing:
                scorings[label] = sum(int((~s.tensor().isnan()).sum()) > n_keeps[judged]
                                      for s in r.step_scores)  # a run to the judged keep's
            return [r.plan_at(n) for n in n_keeps]
        out, once = [], None
        for i, n_keep in enumerate(n_keeps):
            if once is None or name in TARGETED:
                once, t = scored(name, kw, n_keep, seed)
                if timing and (i == judged or name not in TARGETED):
                    seconds[label] = t
            out.append(headlab.select(once, n_keep))
        return out

    def measured(plan, repair: str | None, label: str, i: int, timing: bool) -> float:
        pruned = headlab.prune(copy_model(model), plan)
        if repair is not None:
            t0 = time.perf_counter()
            headlab.recover(pruned, model, scoring, method=repair, batch_size=sizes.batch)
            if timing and i == judged:
                seconds[f"{label}+{repair}"] = time.perf_counter() - t0
        return headlab.evaluate(pruned, heldout, batch_size=sizes.batch).value

    labels = [(label, *QUALITY_VARIANTS[label][:2]) for label in sizes.methods]
    runs = [(label, name, kw, seed) for label, name, kw in [*labels, ("random", "random", {})]
            for seed in (sizes.seeds if name in SEEDED else (0,))]
    quality: dict[tuple[str, str], list[float]] = {}  # (label, repair) -> per keep
    seeded: dict[str, list[str]] = {}  # a seeded method's label -> its runs' labels
    for label, name, kw, seed in runs:
        repairs = [None, sizes.recover] + ([FLAP_REPAIR] if name == "flap" else [])
        run = label
        if name in SEEDED:
            run = f"{label}:{seed}"
            seeded.setdefault(label, []).append(run)
        timing = run == label or seed == sizes.seeds[0]  # a seeded method's first seed
        log.info("%s at keep %s, pruned and after %s", run,
                 ", ".join(map(str, sizes.keeps)), ", ".join(r for r in repairs if r))
        chosen = plans(label, name, dict(kw), seed, timing)
        for repair in repairs:
            quality[run, repair or "none"] = [measured(p, repair, label, i, timing)
                                              for i, p in enumerate(chosen)]
    for method in dict.fromkeys(("michel", DEFAULT_METHOD)):  # one scoring of each, timed
        if method not in seconds:
            _, seconds[method] = scored(method, {}, n_keeps[judged])

    def row(label: str, repair: str) -> dict:
        q = quality[label, repair]
        return {"method": label, "repair": repair, "quality": q,
                "lost": [sign * (v - before.value) for v in q]}

    def mean(xs) -> float:
        return sum(xs) / len(xs)

    rows = []
    for label in [*sizes.methods, "random"]:
        runs = seeded.get(label, [label])
        for repair in dict.fromkeys(r for run, r in quality if run == runs[0]):
            each = [row(run, repair) for run in runs]
            if label not in seeded:
                rows.extend(each)
                continue
            samples = [[s["lost"][i] for s in each] for i in range(len(n_keeps))]  # keep x seed
            rows.append({"method": label, "repair": repair,
                         "quality": [mean([s["quality"][i] for s in each])
                                     for i in range(len(n_keeps))],
                         "lost": [mean(x) for x in samples], "samples": samples})
    return {"metric": before.metric, "before": before.value, "keeps": list(sizes.keeps),
            "heads_kept": n_keeps, "total_heads": total, "rows": rows, "seconds": seconds,
            "scorings": scorings, "gates_ended": trained}


def _judge(res: BenchResult, name: str, grid: dict, setting: str, sizes: QualitySizes) -> None:
    """The figures, targets and reported ratios of one model's grid at the judged keep."""
    metric, j = grid["metric"], grid["keeps"].index(sizes.keep)
    decoder = metric == "perplexity"  # the causal LMs' metric alone
    lost = {(r["method"], r["repair"]): r["lost"][j] for r in grid["rows"]}
    samples = {(r["method"], r["repair"]): r["samples"][j] if "samples" in r else [r["lost"][j]]
               for r in grid["rows"]}  # per seed where the method is seeded

    def named(method: str) -> str:  # as the figures' lines say it
        n = len(samples[method, "none"])
        return QUALITY_VARIANTS[method][2] + (f" (mean of {n} seeds)" if n > 1 else "")

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else float("nan")

    def report(figure: str, value: float, unit: str, what: str, bar: float | None) -> None:
        res.add(f"{name}.{figure}", [value], unit)
        what = f"{name} {what} ({setting})"
        if bar is None:
            res.info.append((f"{name}.{figure}", what))
        else:
            res.add_target(f"{name}.{figure}", target=bar, op="<=", what=what)

    res.add(f"{name}.{metric}_before", [grid["before"]], metric)
    res.add(f"{name}.random_lost", samples["random", "none"], metric)
    at = f"at keep {sizes.keep}"
    for method in sizes.methods:
        res.add(f"{name}.{method}_lost", samples[method, "none"], metric)
        report(f"{method}_over_random", ratio(lost[method, "none"], lost["random", "none"]), "x",
               f"{metric} lost {at}, {named(method)} / mean of "
               f"{len(samples['random', 'none'])} random seed(s)",
               0.5 if method == QUALITY_TARGETED or decoder and method in DECODER_TARGETED
               else None)
    bar = [m for m in GATES_BAR if m in sizes.methods]
    if "gates" in sizes.methods and bar:
        for repair in ("none", sizes.recover):
            best = min(lost[m, repair] for m in bar)
            after = "" if repair == "none" else f"_{repair}"
            report(f"gates{after}_over_best", ratio(lost["gates", repair], best), "x",
                   f"{metric} lost {at}" + ("" if repair == "none" else f" after {repair}")
                   + f", {named('gates')} / the least of {', '.join(bar)}",
                   0.7 if decoder else None)
        report("gates_seconds_over_michel",
               grid["seconds"]["gates"] / grid["seconds"]["michel"], "x",
               f"gate training seconds (toward keep {sizes.keep}) / one michel scoring", 5.0)
    if "flap" in sizes.methods and DEFAULT_METHOD in sizes.methods:
        report(f"default_{sizes.recover}_over_flap_{FLAP_REPAIR}",
               ratio(lost[DEFAULT_METHOD, sizes.recover], lost["flap", FLAP_REPAIR]), "x",
               f"{metric} lost {at}, {DEFAULT_METHOD} + {sizes.recover} / flap + "
               f"{FLAP_REPAIR} (FLAP as published)", 0.7 if decoder else None)
        s = grid["seconds"]
        n = grid["scorings"].get(DEFAULT_METHOD, 1)  # each timed as one on the unpruned model
        own = s[DEFAULT_METHOD] * n + s[f"{DEFAULT_METHOD}+{sizes.recover}"]
        report("default_seconds_over_flap", own / (s["flap"] + s[f"flap+{FLAP_REPAIR}"]), "x",
               f"{DEFAULT_METHOD} ({n} scoring{'' if n == 1 else 's'} in its schedule) + "
               f"{sizes.recover} seconds / flap's scoring + {FLAP_REPAIR} seconds", 3.0)


def _validation(res: BenchResult, name: str, seq_len: int, max_tokens: int,
                sizes: QualitySizes, device: str) -> None:
    """Every method's and detector's Spearman correlation with the true ablation cost;
    random's 95% interval must contain 0 (its low end <= 0 <= its high end)."""
    import headlab
    from headlab.analysis.validation import validate

    model = headlab.load(name, device=device)
    scoring, heldout = scoring_and_heldout(model, sizes.data, seq_len=seq_len,
                                           max_tokens=max_tokens, batch_size=sizes.batch)
    found = validate(model, scoring, heldout, batch_size=sizes.batch,
                     n_boot=sizes.n_boot, name=name)
    res.method["validation"] = (
        "headlab.analysis.validation.validate: true cost = held-out loss with one head gated off "
        "minus with none, per example; Spearman of each method's scores (scoring split) "
        "with its mean, 95% percentile bootstrap over held-out examples; AUC = area under "
        "the one-shot pruning curve (fractions 0.1..0.5) / random's (3 seeds)")
    res.checks[f"{name}.validation"] = found.to_json()
    log.info("%s: Spearman with the true single-head ablation cost (S=%d, %d tokens)\n%s",
             name, seq_len, max_tokens, found.table())
    for row in found.rows:
        res.add(f"{name}.spearman.{row.name}", [row.spearman], "rho")
        res.info.append((f"{name}.spearman.{row.name}",
                         f"{name} Spearman of {row.name} ({row.family}) with the true ablation "
                         f"cost, 95% CI [{row.ci[0]:+.3f}, {row.ci[1]:+.3f}]"))
    lo, hi = found.row("random").ci
    res.add(f"{name}.random_spearman_ci_low", [lo], "rho")
    res.add(f"{name}.random_spearman_ci_high", [hi], "rho")
    res.add_target(f"{name}.random_spearman_ci_low", target=0.0, op="<=",
                   what=f"{name} random scores' Spearman 95% interval, low end (contains 0)")
    res.add_target(f"{name}.random_spearman_ci_high", target=0.0, op=">=",
                   what=f"{name} random scores' Spearman 95% interval, high end (contains 0)")
