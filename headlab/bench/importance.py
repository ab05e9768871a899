"""``headlab bench importance``: Michel scoring tokens/s against a plain forward and
backward with parameter gradients over the same batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headlab._util.timing import rate, ratios, time_interleaved
from headlab.bench._common import BenchResult, Timing
from headlab.bench._models import GPT2_SMALL, ModelCache, ModelSpec, model_cache, random_ids

__all__ = ["ImportanceSizes", "bench_importance"]


@dataclass(frozen=True, kw_only=True)
class ImportanceSizes(Timing):
    """Scoring and forward+backward over ``n_batches`` batches of ``batch`` x ``seq``
    random tokens."""

    model: ModelSpec = GPT2_SMALL
    batch: int = 2
    seq: int = 128
    n_batches: int = 1


def bench_importance(sizes: ImportanceSizes, *, device: str = "cpu",
                     models: ModelCache | None = None) -> BenchResult:
    """Michel scoring tokens/s vs forward + backward with parameter gradients."""
    from headlab.data.blocks import Blocks
    from headlab.importance import score
    from headlab.objectives import objective_for

    B, S = sizes.batch, sizes.seq
    res = BenchResult.of_sizes("importance", sizes)
    res.method = {
        "michel": "headlab.score(model, blocks, method='michel', batch_size=B): gates "
                  "(B, H) per layer with grad, parameters frozen, loss.sum().backward()",
        "forward_backward": "the same batches: the objective's example_losses (the same loss) then "
                            "loss.sum().backward() with every parameter requiring grad, "
                            "grads set to None after each batch",
        "scoring_over_forward_backward": "Michel tokens/s / forward+backward tokens/s per "
                                         "round (target >= 0.9)",
    }
    with model_cache(models, device) as cache:
        model = cache.headlab(sizes.model)
        objective = objective_for(model)
        rows = B * sizes.n_batches
        ids = random_ids(model.config.vocab_size, rows, S, "cpu", seed=2)
        blocks = Blocks(ids, torch.ones_like(ids), spec="random tokens")
        tokens = rows * S
        requires = [p.requires_grad for p in model.parameters()]

        def forward_backward():
            for batch in blocks.batches(B):
                loss, _, _ = objective.example_losses(model, batch)
                loss.sum().backward()
                model.zero_grad(set_to_none=True)

        try:
            for p in model.parameters():
                p.requires_grad_(True)
            t = time_interleaved(
                {"michel": lambda: score(model, blocks, method="michel", batch_size=B),
                 "fb": forward_backward},
                repeats=sizes.repeats, warmup=sizes.warmup, device=device)
        finally:
            for p, r in zip(model.parameters(), requires, strict=True):
                p.requires_grad_(r)
            model.zero_grad(set_to_none=True)
        res.add("michel_tokens_per_s", rate(tokens, t["michel"]), "tokens/s")
        res.add("forward_backward_tokens_per_s", rate(tokens, t["fb"]), "tokens/s")
        res.add("scoring_over_forward_backward", ratios(t["fb"], t["michel"]), "x")
        res.add_target("scoring_over_forward_backward", target=0.9, op=">=",
                       what=f"Michel scoring tokens/s vs forward+backward (B={B}, S={S})")
    return res
