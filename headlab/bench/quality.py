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
from functools import partial

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
    methods: tuple[str, ...] = ("michel_unnormalised", "michel", "taylor", "gates", "gates_token",
                                "flap")
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
    "gates_token": ("gates", {"gate_sample": "token"},
                    "learned hard-concrete gates drawn per token"),
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
    for name, seq_len, max_tokens in sizes.runs:
        inputs = _Inputs(name, seq_len, max_tokens, sizes, device)
        # the timings in one part, each ratio's two sides in the same run of the machine,
        # then one part per method and seed: (part, check it writes, what computes it)
        each = [(f"{name}:timing", f"{name}.timing", partial(_timing, inputs, sizes))]
        each += [(f"{name}:{run.key}", f"{name}.run:{run.key}", partial(_run, inputs, sizes, run))
                 for run in _runs(sizes)]
        for key, check, compute in each:
            measure_part(parts, res, key, lambda check=check, compute=compute:
                         res.checks.update({check: compute()}))
        res.checks[f"{name}.grid"] = _grid(res.checks, name, sizes)
    for name, seq_len, max_tokens in sizes.runs:  # judged from the grids as the bars are now,
        # so that a part kept from an earlier run is held to the same bars as a new one
        _judge(res, name, res.checks[f"{name}.grid"], f"S={seq_len}, {max_tokens} tokens",
               sizes)
    for run in sizes.validate:
        measure_part(parts, res, f"validation:{run[0]}",
                     lambda run=run: _validation(res, *run, sizes, device))
    return res


class _Inputs:
    """One model of the benchmark and its scoring and held-out blocks, loaded when a part
    first needs them (a resumed run whose parts are all kept loads nothing)."""

    def __init__(self, name: str, seq_len: int, max_tokens: int, sizes: QualitySizes,
                 device: str) -> None:
        self.name, self.seq_len, self.max_tokens = name, seq_len, max_tokens
        self.sizes, self.device = sizes, device
        self.loaded: tuple | None = None

    def __call__(self) -> tuple:
        """(model, scoring, heldout)."""
        if self.loaded is None:
            import headlab

            model = headlab.load(self.name, device=self.device)
            scoring, heldout = scoring_and_heldout(
                model, self.sizes.data, seq_len=self.seq_len, max_tokens=self.max_tokens,
                batch_size=self.sizes.batch)
            self.loaded = model, scoring, heldout
        return self.loaded


@dataclass(frozen=True)
class _Run:
    """One method's run: ``label`` (a QualitySizes.methods entry, or ``random``), the
    method and its scoring options, the seed; ``key`` names its part."""

    label: str
    method: str
    options: dict
    seed: int

    @property
    def key(self) -> str:
        return f"{self.label}:{self.seed}" if self.method in SEEDED else self.label


def _runs(sizes: QualitySizes) -> list[_Run]:
    """Every method once, the `SEEDED` ones with each seed, random last."""
    labels = [(label, *QUALITY_VARIANTS[label][:2]) for label in sizes.methods]
    return [_Run(label, method, kw, seed)
            for label, method, kw in [*labels, ("random", "random", {})]
            for seed in (sizes.seeds if method in SEEDED else (0,))]


def _n_keeps(model, sizes: QualitySizes) -> list[int]:
    from headlab.selection import heads_to_keep

    return [heads_to_keep(model.n_layers * model.n_original_heads, keep=k)
            for k in sizes.keeps]


def _scored(loaded: tuple, sizes: QualitySizes, method: str, kw: dict, n_keep: int,
            seed: int = 0):
    """One scoring of the unpruned model, timed: (scores, seconds)."""
    import headlab

    model, scoring, _ = loaded
    t0 = time.perf_counter()
    scores = headlab.score(model, scoring, method=method, batch_size=sizes.batch, **kw,
                           **({"seed": seed} if method in SEEDED else {}),
                           **({"target": n_keep, "gate_steps": sizes.gate_steps,
                               "gate_lr": sizes.gate_lr, "gate_budget": sizes.gate_budget,
                               "gate_batch": sizes.gate_batch}
                              if method in TARGETED else {}))
    return scores, time.perf_counter() - t0


def _pruned(loaded: tuple, plan, repair: str | None, sizes: QualitySizes):
    """The unpruned model less ``plan``'s heads, repaired by ``repair`` if given: (the
    model, the repair's seconds or None)."""
    import headlab
    from headlab.pruning import copy_model

    model, scoring, _ = loaded
    pruned = headlab.prune(copy_model(model), plan)
    if repair is None:
        return pruned, None
    t0 = time.perf_counter()
    headlab.recover(pruned, model, scoring, method=repair, batch_size=sizes.batch)
    return pruned, time.perf_counter() - t0


def _timing(inputs: _Inputs, sizes: QualitySizes) -> dict:
    """The quality before pruning, the heads at each keep, the tokens, and the seconds
    the targets compare, at the judged keep: one michel scoring, the default method's
    scoring and its repair, FLAP's scoring and its bias compensation."""
    import headlab

    model, scoring, heldout = loaded = inputs()
    before = headlab.evaluate(model, heldout, batch_size=sizes.batch)
    n_keeps = _n_keeps(model, sizes)
    n_keep = n_keeps[sizes.keeps.index(sizes.keep)]
    seconds = {}
    for method, repair in {"michel": None, DEFAULT_METHOD: sizes.recover,
                           "flap": FLAP_REPAIR}.items():
        scores, seconds[method] = _scored(loaded, sizes, method, {}, n_keep)
        if repair is not None:
            _, seconds[f"{method}+{repair}"] = _pruned(
                loaded, headlab.select(scores, n_keep), repair, sizes)
    return {"metric": before.metric, "before": before.value,
            "higher_is_better": before.higher_is_better, "heads_kept": n_keeps,
            "total_heads": model.n_layers * model.n_original_heads,
            "tokens": {"scoring": int(scoring.attention_mask.sum()),
                       "heldout": int(heldout.attention_mask.sum())},
            "seconds": seconds}


def _run(inputs: _Inputs, sizes: QualitySizes, run: _Run) -> dict:
    """One run's held-out quality at each keep, pruned and after each repair:
    ``{"quality": {repair: [per keep]}, "scorings", "gates_ended"}``; ``scorings``: for
    a schedule, how many scorings it took to reach the judged keep; ``gates_ended``: per
    gate training, its target and the expected number of gates open at its end."""
    import headlab

    model, scoring, heldout = loaded = inputs()
    n_keeps = _n_keeps(model, sizes)
    judged = sizes.keeps.index(sizes.keep)
    repairs = [None, sizes.recover] + ([FLAP_REPAIR] if run.method == "flap" else [])
    log.info("%s at keep %s, pruned and after %s", run.key,
             ", ".join(map(str, sizes.keeps)), ", ".join(r for r in repairs if r))
    scorings, trained = None, []
    if run.method not in JOINT:  # one schedule to the smallest keep holds every keep's plan
        r = headlab.prune_to_target(model, scoring, heldout, method=run.method,
                                    n_keep=min(n_keeps), step=sizes.step,
                                    batch_size=sizes.batch, seed=run.seed,
                                    score_kwargs=dict(run.options))
        scorings = sum(int((~s.tensor().isnan()).sum()) > n_keeps[judged]
                       for s in r.step_scores)  # a run to the judged keep's
        chosen = [r.plan_at(n) for n in n_keeps]
    else:
        chosen, once = [], None
        for n_keep in n_keeps:
            if once is None or run.method in TARGETED:
                once, _ = _scored(loaded, sizes, run.method, dict(run.options), n_keep,
                                  run.seed)
                if run.method in TARGETED:
                    trained.append({k: once.extra[k] for k in ("target", "expected_open",
                                                               "target_met")})
            chosen.append(headlab.select(once, n_keep))
    quality = {repair or "none": [headlab.evaluate(_pruned(loaded, plan, repair, sizes)[0],
                                                   heldout, batch_size=sizes.batch).value
                                  for plan in chosen]
               for repair in repairs}
    return {"quality": quality, "scorings": scorings, "gates_ended": trained}


def _grid(checks: dict, name: str, sizes: QualitySizes) -> dict:
    """One model's grid from its parts (which it takes out of ``checks``): every
    method's held-out quality at each keep, pruned and repaired, with the seconds the
    targets compare. Rows: ``{"method", "repair", "quality": [per keep], "lost": [per
    keep]}``; the `SEEDED` methods' rows hold the means over ``sizes.seeds`` and
    ``samples`` (per keep, per seed). ``scorings``: the schedules' scorings to the judged
    keep (first seed); ``gates_ended``: each gate training's target and where it
    ended. The model's token counts go back into ``checks``."""
    timing = checks.pop(f"{name}.timing")
    runs = {run.key: (run, checks.pop(f"{name}.run:{run.key}")) for run in _runs(sizes)}
    sign = -1 if timing["higher_is_better"] else 1

    def mean(xs) -> float:
        return sum(xs) / len(xs)

    rows = []
    for label in [*sizes.methods, "random"]:
        mine = [(run, got) for run, got in runs.values() if run.label == label]
        for repair in mine[0][1]["quality"]:
            quality = [got["quality"][repair] for _, got in mine]  # seed x keep
            lost = [[sign * (v - timing["before"]) for v in q] for q in quality]
            row = {"method": label, "repair": repair,
                   "quality": [mean(q) for q in zip(*quality, strict=True)],
                   "lost": [mean(x) for x in zip(*lost, strict=True)]}
            if mine[0][0].method in SEEDED:
                row["samples"] = [list(x) for x in zip(*lost, strict=True)]  # keep x seed
            rows.append(row)
    first = {run.label: got for run, got in runs.values()
             if run.method not in SEEDED or run.seed == sizes.seeds[0]}
    checks[f"{name}.tokens"] = timing["tokens"]
    return {"metric": timing["metric"], "before": timing["before"],
            "keeps": list(sizes.keeps), "heads_kept": timing["heads_kept"],
            "total_heads": timing["total_heads"], "rows": rows,
            "seconds": timing["seconds"],
            "scorings": {label: got["scorings"] for label, got in first.items()
                         if got["scorings"] is not None},
            "gates_ended": [t for _, got in runs.values() for t in got["gates_ended"]]}


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
