"""``headlab bench pruning``: the latency drop of a model physically pruned to keep half
of its heads, against the drop its FLOPs predict (`headlab.models.flops.count_flops`);
and across prompt lengths, batch 1, where attention's S^2 terms grow to dominate: a GQA
model with ``length_keep`` of its query heads kept, and with ``kv_keep`` of its key/value
groups kept (the prune command's ``--unit kv-group --kv-keep``), each against its FLOPs.
Decoding speed at long contexts after kv-group pruning and demotion is measured by
``headlab bench generate`` (`headlab.bench.long_context`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from headlab._util.timing import ms, time_interleaved
from headlab.bench._common import BenchResult, Timing
from headlab.bench._models import (
    GPT2_SMALL,
    SMOLLM2,
    ModelCache,
    ModelSpec,
    model_cache,
    random_ids,
)
from headlab.models.flops import count_flops

__all__ = ["PruningSizes", "bench_pruning", "count_flops"]


@dataclass(frozen=True, kw_only=True)
class PruningSizes(Timing):
    """``model`` pruned to keep ``keep`` of its heads, timed at each of ``shapes``."""

    model: ModelSpec = GPT2_SMALL
    shapes: tuple[tuple[int, int], ...] = ((16, 128), (1, 128))  # (B, S); the first is judged
    keep: float = 0.5
    repeats: int = 15  # a ~12% effect under run-to-run noise of about as much
    # the sweep over prompt lengths (batch 1; lengths past the model's positions left out)
    length_model: ModelSpec = SMOLLM2
    lengths: tuple[int, ...] = (128, 512, 2048, 8192)
    length_keep: float = 0.6
    kv_keep: float = 0.5
    length_repeats: int = 5
    judged_length: int = 2048  # the query-head pruning's drop / predicted drop is judged here


def bench_pruning(sizes: PruningSizes, *, device: str = "cpu",
                  models: ModelCache | None = None) -> BenchResult:
    """Latency drop of a model pruned to ``keep`` heads vs the FLOP-predicted drop."""
    from headlab.importance import HeadScores
    from headlab.pruning import prune
    from headlab.selection import heads_to_keep, select

    res = BenchResult.of_sizes("pruning", sizes)
    res.method = {
        "plan": f"keep {sizes.keep} of all heads, ranked globally by seeded random scores "
                "(layers keep uneven numbers of heads), physically pruned with "
                "headlab.prune(..., inplace=False)",
        "latency": "forward time of the unpruned and the pruned model, interleaved, eval + "
                   "inference_mode",
        "drop": "1 - latency_after / latency_before per round",
        "predicted_drop": "1 - flops_after / flops_before from count_flops (projections, "
                          "attention, MLP, LM head matmuls)",
        "drop_over_predicted": "measured drop / predicted drop per round (target >= 0.8 at "
                               "the first shape)",
    }
    with model_cache(models, device) as cache:
        model = cache.headlab(sizes.model)
        gen = torch.Generator().manual_seed(0)
        scores = torch.rand(model.n_layers, model.n_original_heads, generator=gen)
        n_keep = heads_to_keep(model.n_layers * model.n_original_heads, keep=sizes.keep)
        plan = select(HeadScores(scores.tolist(), "random"), n_keep)
        pruned = prune(model, plan, inplace=False)
        res.checks["heads_per_layer_after"] = pruned.heads_per_layer
        res.checks["params_before"] = model.num_parameters()
        res.checks["params_after"] = pruned.num_parameters()
        flops: dict[str, Any] = {}
        for i, (B, S) in enumerate(sizes.shapes):
            key = f"B{B}_S{S}"
            before, after = count_flops(model, B, S), count_flops(pruned, B, S)
            predicted = 1 - after["total"] / before["total"]
            flops[key] = {"before": before, "after": after, "predicted_drop": predicted}
            ids = random_ids(model.config.vocab_size, B, S, device)
            with torch.inference_mode():
                t = time_interleaved({"before": lambda i=ids: model(i),
                                       "after": lambda i=ids: pruned(i)},
                                      repeats=sizes.repeats, warmup=sizes.warmup,
                                      device=device)
            drops = [1 - a / b for a, b in zip(t["after"], t["before"], strict=True)]
            res.add(f"{key}.before_ms", ms(t["before"]), "ms")
            res.add(f"{key}.after_ms", ms(t["after"]), "ms")
            res.add(f"{key}.drop", drops, "fraction")
            res.add(f"{key}.predicted_drop", [predicted], "fraction")
            res.add(f"{key}.drop_over_predicted",
                    [d / predicted if predicted else math.nan for d in drops], "x")
            what = (f"latency drop at keep {sizes.keep} / FLOP-predicted drop "
                    f"({predicted:.1%}) (B={B}, S={S})")
            if i == 0:
                res.add_target(f"{key}.drop_over_predicted", target=0.8, op=">=", what=what)
            else:
                res.info.append((f"{key}.drop_over_predicted", what))
        res.checks["flops"] = flops
        _by_length(res, cache.headlab(sizes.length_model), sizes, device)
    return res


def _random_plans(model, sizes: PruningSizes):
    """The two prunings the length sweep times, from seeded random scores: query heads
    kept by ``length_keep`` over all heads, and whole GQA groups by ``kv_keep``."""
    from headlab.importance import HeadScores
    from headlab.selection import heads_to_keep, kv_groups, select, select_groups

    gen = torch.Generator().manual_seed(0)
    scores = HeadScores(torch.rand(model.n_layers, model.n_original_heads,
                                   generator=gen).tolist(), "random")
    heads = heads_to_keep(model.n_layers * model.n_original_heads, keep=sizes.length_keep)
    groups = kv_groups(model)
    n_groups = sum(len(g) for g in groups)
    return {"heads": select(scores, heads),
            "kv_groups": select_groups(scores, groups,
                                       heads_to_keep(n_groups, keep=sizes.kv_keep))}


def _by_length(res: BenchResult, model, sizes: PruningSizes, device: str) -> None:
    """Prefill latency at each of ``sizes.lengths`` (batch 1) of ``model`` as it came and
    pruned both ways, beside the drop the FLOPs predict; rows ``S{n}.{unit}.*``, the
    table in ``checks["by_length"]``."""
    from headlab.pruning import prune

    pruned = {unit: prune(model, plan, inplace=False)
              for unit, plan in _random_plans(model, sizes).items()}
    table: dict[str, Any] = {}
    for S in [n for n in sizes.lengths if n <= model.max_positions]:
        ids = random_ids(model.config.vocab_size, 1, S, device)
        flops = count_flops(model, 1, S)
        with torch.inference_mode():
            t = time_interleaved({"before": lambda i=ids: model(i),
                                  **{u: (lambda i=ids, m=m: m(i)) for u, m in pruned.items()}},
                                 repeats=sizes.length_repeats, warmup=sizes.warmup,
                                 device=device)
        row: dict[str, Any] = {"flops_before": flops,
                               "before_ms": 1000 * statistics.median(t["before"])}
        res.add(f"S{S}.before_ms", ms(t["before"]), "ms")
        for unit, m in pruned.items():
            after = count_flops(m, 1, S)
            predicted = 1 - after["total"] / flops["total"]
            drops = [1 - a / b for a, b in zip(t[unit], t["before"], strict=True)]
            res.add(f"S{S}.{unit}.after_ms", ms(t[unit]), "ms")
            res.add(f"S{S}.{unit}.drop", drops, "fraction")
            res.add(f"S{S}.{unit}.predicted_drop", [predicted], "fraction")
            res.add(f"S{S}.{unit}.drop_over_predicted",
                    [d / predicted if predicted else math.nan for d in drops], "x")
            row[unit] = {"flops": after, "after_ms": 1000 * statistics.median(t[unit]),
                         "predicted_drop": predicted}
            what = (f"{sizes.length_model} prefill latency drop / FLOP-predicted drop "
                    f"({predicted:.1%}), {unit} pruned, B=1, S={S}")
            if unit == "heads" and sizes.judged_length == S:
                res.add_target(f"S{S}.{unit}.drop_over_predicted", target=0.8, op=">=",
                               what=what)
            else:
                res.info.append((f"S{S}.{unit}.drop_over_predicted", what))
        table[str(S)] = row
    res.checks["by_length"] = table
    res.checks["by_length_heads"] = {u: m.heads_per_layer for u, m in pruned.items()}

