"""Forward latency of a model before and after pruning, timed so that a shared machine's
slow spells fall on both: the same random tokens, alternating rounds after a warm-up of
each (`headlab._util.timing.time_interleaved`), the median of each."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

from headlab._util.timing import time_interleaved

if TYPE_CHECKING:
    from headlab.models.base import HeadModel


@torch.inference_mode()
def compare_latency(before: HeadModel, after: HeadModel, batch: int, seq_len: int,
                    rounds: int = 7) -> tuple[float, float]:
    """Median forward times (ms) of two models on the same random tokens (batch,
    seq_len), timed in alternating rounds after a warm-up of each, so that a slow spell
    of a shared machine falls on both."""
    seq_len = min(seq_len, before.max_positions)
    vocab = before.tokenizer.vocab_size if before.tokenizer is not None else 100
    ids = torch.randint(0, max(2, min(vocab, 1000)), (batch, seq_len),
                        generator=torch.Generator().manual_seed(0)).to(before.device)
    t = time_interleaved({"before": lambda: before(ids), "after": lambda: after(ids)},
                         repeats=rounds, warmup=1, device=before.device.type)
    return (1000 * statistics.median(t["before"]), 1000 * statistics.median(t["after"]))
