"""``headlab bench pruning``: the latency drop of a model physically pruned to keep half
of its heads, against the drop its FLOPs predict (`headlab.models.flops.count_flops`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from headlab._util.timing import ms, time_interleaved
from headlab.bench._common import BenchResult, Timing
from headlab.bench._models import GPT2_SMALL, ModelCache, ModelSpec, model_cache, random_ids
from headlab.models.flops import count_flops

__all__ = ["PruningSizes", "bench_pruning", "count_flops"]


@dataclass(frozen=True, kw_only=True)
class PruningSizes(Timing):
    """``model`` pruned to keep ``keep`` of its heads, timed at each of ``shapes``."""

    model: ModelSpec = GPT2_SMALL
    shapes: tuple[tuple[int, int], ...] = ((16, 128), (1, 128))  # (B, S); the first is judged
    keep: float = 0.5
    repeats: int = 15  # a ~12% effect under run-to-run noise of about as much


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
    return res
