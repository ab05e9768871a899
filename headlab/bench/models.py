"""``headlab bench models``: forward tokens/s of headlab's models against transformers
(sdpa) on the same weights.

Both run every product on torch's own ``F.linear``, so the forward speed is at parity
by construction: the target checks that headlab's own attention, masks and hook points
cost nothing measurable, i.e. that headlab stays within the noise of transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from headlab._util.timing import rate, ratios, time_interleaved
from headlab.bench._common import BenchResult, Timing, max_diff
from headlab.bench._models import (
    BERT_BASE,
    GPT2_SMALL,
    SMOLLM2,
    ModelCache,
    ModelSpec,
    model_cache,
    random_ids,
)

__all__ = ["PARITY", "ModelsSizes", "bench_models"]

# parity within noise: a 10% margin for the round-to-round noise of shared machines
PARITY = 0.9


@dataclass(frozen=True, kw_only=True)
class ModelsSizes(Timing):
    """One forward of ``batch`` x ``seq`` random tokens through each of ``models``."""

    models: tuple[ModelSpec, ...] = (GPT2_SMALL, BERT_BASE, SMOLLM2)
    batch: int = 4
    seq: int = 256


def _hf_output(hf: nn.Module, ids: torch.Tensor, family: str) -> torch.Tensor:
    if family == "bert":
        return hf(input_ids=ids).last_hidden_state
    return hf(input_ids=ids, use_cache=False).logits


def _headlab_output(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.logits if out.logits is not None else out.last_hidden_state


def bench_models(sizes: ModelsSizes, *, device: str = "cpu",
                 models: ModelCache | None = None) -> BenchResult:
    """Forward tokens/s of headlab vs transformers (sdpa) on the same weights."""
    B, S = sizes.batch, sizes.seq
    res = BenchResult.of_sizes("models", sizes)
    res.method = {
        "headlab": "model(input_ids) in eval + inference_mode",
        "transformers": "the transformers model (attn_implementation='sdpa') with the same "
                        "weights, called with use_cache=False (headlab's forward keeps no "
                        "cache either) in eval + inference_mode; BERT is BertModel",
        "speed_vs_transformers": "transformers time / headlab time per round (> 1: headlab "
                                 "faster); tokens/s = B*S / time. Both use torch's products, "
                                 f"so the target is parity within noise (>= {PARITY})",
    }
    with model_cache(models, device) as cache:
        for spec in sizes.models:
            model, hf, source = cache.pair(spec)
            ids = random_ids(model.config.vocab_size, B, S, device)
            with torch.inference_mode():
                res.checks[f"{spec.name}.max_abs_diff"] = max_diff(
                    _headlab_output(model, ids), _hf_output(hf, ids, spec.family))
                t = time_interleaved(
                    {"headlab": lambda m=model, i=ids: m(i),
                     "transformers": lambda h=hf, i=ids, f=spec.family: _hf_output(h, i, f)},
                    repeats=sizes.repeats, warmup=sizes.warmup, device=device)
            res.checks[f"{spec.name}.weights"] = source
            res.checks[f"{spec.name}.transformers"] = (
                f"{type(hf).__name__}, attention {hf.config._attn_implementation}")
            res.add(f"{spec.name}.headlab_tokens_per_s", rate(B * S, t["headlab"]), "tokens/s")
            res.add(f"{spec.name}.transformers_tokens_per_s", rate(B * S, t["transformers"]),
                    "tokens/s")
            res.add(f"{spec.name}.speed_vs_transformers",
                    ratios(t["transformers"], t["headlab"]), "x")
            res.add_target(f"{spec.name}.speed_vs_transformers", target=PARITY, op=">=",
                           what=f"{spec.name} forward tokens/s vs transformers sdpa, parity "
                                f"within noise (B={B}, S={S})")
    return res
