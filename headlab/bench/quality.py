"""``headlab bench quality``: held-out quality lost when pruning by michel (with and
without the layer norm) and taylor scores, against random scores (3 seeds), on the real
bundled models; and the validation table (`headlab.analysis.validation`): each importance
method's and detector's Spearman correlation with the true single-head ablation cost,
with its bootstrap interval. Not a timing: random weights have no heads worth keeping."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from headlab.bench._common import BenchResult
from headlab.bench._data import describe, scoring_and_heldout

log = logging.getLogger(__name__)

__all__ = ["QUALITY_TARGETED", "QUALITY_VARIANTS", "QualitySizes", "bench_quality"]


@dataclass(frozen=True, kw_only=True)
class QualitySizes:
    """Each of ``runs`` pruned to ``keep`` in steps of ``step`` with each of ``methods``
    and with random scores; not timed, so no `Timing`."""

    # (bundled model, sequence length, token budget): real models only
    runs: tuple[tuple[str, int, int], ...] = (("smollm2-135m", 128, 4096),
                                               ("gemma3-270m", 128, 4096),
                                               ("minilm-l6", 128, 8192))
    data: str | None = "enwiki"  # None: the bundled text
    keep: float = 0.6
    step: float = 0.2
    batch: int = 4
    methods: tuple[str, ...] = ("michel_unnormalised", "michel", "taylor")
    # score validation: (bundled model, sequence length, token budget) per run
    validate: tuple[tuple[str, int, int], ...] = (("smollm2-135m", 64, 1024),
                                                   ("minilm-l6", 64, 2048))
    n_boot: int = 1000


# the labels of QualitySizes.methods: (method, scoring options, as the bench's table says
# it). Michel et al. divide each layer's scores by their l2 norm (headlab's default); the
# bar is held against michel without it, and the paper's setting is shown beside it
QUALITY_VARIANTS = {
    "michel": ("michel", {}, "michel with the layer l2 norm (the paper's)"),
    "michel_unnormalised": ("michel", {"normalize": False}, "michel without the layer norm"),
    "taylor": ("taylor", {}, "taylor"),
}
QUALITY_TARGETED = "michel_unnormalised"


def bench_quality(sizes: QualitySizes, *, device: str = "cpu", models=None) -> BenchResult:
    """Held-out quality lost with each method vs random scores (3 seeds), real models."""
    import headlab
    from headlab.schedule import versus_random

    res = BenchResult.of_sizes("quality", sizes)
    res.method = {
        "data": describe(sizes.data),
        "pruning": f"headlab.prune_to_target(method, keep={sizes.keep}, schedule="
                   f"'iterative', step={sizes.step}) from the unpruned model, for "
                   f"{', '.join(sizes.methods)} and for random with seeds 0, 1, 2 "
                   "(headlab.schedule.versus_random)",
        "lost": "held-out perplexity increase (causal LM) or fidelity decrease (sentence "
                "embeddings) after pruning",
        "ratio": "lost with the method / mean lost with random (target <= 0.5, the "
                 "issue's bar, for michel without the layer l2 norm; michel with it, the "
                 "paper's default, and taylor are reported beside it)",
    }
    for name, seq_len, max_tokens in sizes.runs:
        model = headlab.load(name, device=device)
        scoring, heldout = scoring_and_heldout(model, sizes.data, seq_len=seq_len,
                                               max_tokens=max_tokens, batch_size=sizes.batch)
        result = versus_random(model, scoring, heldout,
                               method={m: QUALITY_VARIANTS[m][:2] for m in sizes.methods},
                               keep=sizes.keep, step=sizes.step, batch_size=sizes.batch)
        res.checks[f"{name}.result"] = result
        res.checks[f"{name}.tokens"] = {"scoring": int(scoring.attention_mask.sum()),
                                        "heldout": int(heldout.attention_mask.sum())}
        res.add(f"{name}.{result['metric']}_before", [result["before"]], result["metric"])
        res.add(f"{name}.random_lost", [v for k, v in result["lost"].items()
                                        if k.startswith("random:")], result["metric"])
        for method in sizes.methods:
            res.add(f"{name}.{method}_lost", [result["lost"][method]], result["metric"])
            res.add(f"{name}.{method}_over_random", [result["ratios"][method]], "x")
            what = (f"{name} {result['metric']} lost at keep {sizes.keep}, "
                    f"{QUALITY_VARIANTS[method][2]} / mean of 3 random seeds (S={seq_len}, "
                    f"{max_tokens} tokens)")
            if method == QUALITY_TARGETED:
                res.add_target(f"{name}.{method}_over_random", target=0.5, op="<=", what=what)
            else:
                res.info.append((f"{name}.{method}_over_random", what))
    for name, seq_len, max_tokens in sizes.validate:
        _validation(res, name, seq_len, max_tokens, sizes, device)
    return res


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
