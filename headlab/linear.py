"""``Linear``: an ``nn.Linear`` whose products over a few rows use every CPU thread.

Decoding multiplies one row per step (per sequence) by every weight matrix. For such
skinny products MKL runs one thread, so the weights, which must come from memory at
every step, are read at one core's share of the memory bandwidth. Measured on 2 AMD
EPYC cores (torch 2.13, MKL): 5-8 GB/s for the SmolLM2 projections, against 16-22 GB/s
for a two-thread read of the same memory.

Here such a product is cut into one block of output rows per thread and the blocks are
multiplied as one batch: ``torch.bmm`` runs batch members on different threads, so
each core streams its own half of the weight. No weight is copied: the blocks are a view
of the weight. Measured the same way: 1.4x the bandwidth on the MLP matrices, 1.6x on
the 49152 x 576 output embedding. Larger products (prefill, scoring, training) and
other devices take ``F.linear`` unchanged.

Parameter names and shapes are nn.Linear's, so checkpoints, hooks and pruning see no
difference. ``store_input_major`` changes only where a weight's numbers lie in memory:
the output embedding of a language model (49152 x 576 in SmolLM2, a fifth of its
bytes) is read 1.5x faster by a split product when stored as its transpose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "store_input_major"]

# at most this many rows take the split path; measured on the SmolLM2 shapes, the split
# still read 1.3-1.8x faster than one MKL call at 16 rows
MAX_SPLIT_ROWS = 16
# smaller weights (a 192 x 576 key projection: 110k) gained nothing measurable
MIN_SPLIT_WEIGHT = 2**17


class Linear(nn.Linear):
    """nn.Linear; a CPU product of at most 16 rows by a large weight is split by rows
    of the weight across threads (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        parts = torch.get_num_threads()
        if (
            parts > 1
            and x.device.type == "cpu"
            and 0 < x.numel() <= MAX_SPLIT_ROWS * w.shape[1]
            and w.numel() >= MIN_SPLIT_WEIGHT
            and (w.is_contiguous() or w.t().is_contiguous())  # row- or input-major
        ):
            return _split_product(x, w, self.bias, parts)
        return F.linear(x, w, self.bias)


def store_input_major(weight: nn.Parameter) -> None:
    """Lay ``weight`` (N, K) out in memory as its transpose (K, N); shape unchanged.

    For a wide output (N >> K), a split product then reads each thread's block of
    columns as K long runs: measured 16.7 vs 10.7 GB/s on the 49152 x 576 SmolLM2
    output embedding. Loading copies into the parameter and keeps this layout; an
    embedding lookup through it gathers strided values (10 ms per 1024 tokens, once per
    forward).
    """
    weight.data = weight.data.t().contiguous().t()


def _split_product(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, parts: int
) -> torch.Tensor:
    """x (..., K) @ w (N, K)^T with w's N rows in ``parts`` blocks, one per thread.

    ``w`` is row-major or stored input-major (`store_input_major`); the blocks are
    views either way. When ``parts`` does not divide N (GPT-2's 50257 words), the last
    N % parts rows are multiplied on their own and appended.
    """
    N, K = w.shape
    block = N // parts
    rows = x.reshape(1, -1, K).expand(parts, -1, K)  # (P, M, K), no copy
    blocks = w[: parts * block].unflatten(0, (parts, block)).transpose(1, 2)  # (P, K, N/P)
    y = torch.bmm(rows, blocks)  # (P, M, N/P)
    y = y.transpose(0, 1).reshape(*x.shape[:-1], parts * block)  # (..., P * N/P)
    if parts * block < N:
        y = torch.cat([y, F.linear(x, w[parts * block :])], dim=-1)  # (..., N)
    return y if bias is None else y + bias
