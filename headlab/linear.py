"""``Linear``: an ``nn.Linear`` whose products over a few rows use every CPU thread.

Decoding multiplies one row per step (per sequence) by every weight matrix. For such
skinny products MKL runs one thread, so the weights, which must come from memory at
every step, are read at one core's share of the memory bandwidth. Measured on 2 AMD
EPYC cores (torch 2.13, MKL): 5-8 GB/s for the SmolLM2 projections, against 16-22 GB/s
for a two-thread read of the same memory.

A CPU product of at most 16 rows therefore takes, in order:

1. headlab's C kernel (``headlab.kernels``) for a row-major float32 weight when no
   gradient is needed: every thread streams its own tiles of the weight. Measured per
   1536 x 576 SmolLM2 product: 0.23 ms at 1 row, 0.50 ms at 16 rows, against 0.39 and
   0.64 ms for ``F.linear``.
2. a split product: the weight's output rows cut into one block per thread and the
   blocks multiplied as one batch (``torch.bmm`` runs batch members on different
   threads). The blocks are views, so nothing is copied. This serves weights stored
   input-major, products that need autograd, and machines without the kernel: 1.4x
   ``F.linear``'s bandwidth on the MLP matrices, 1.6x on the output embedding.

Larger products (prefill, scoring) whose weights need no gradient take headlab's
``kernels.matmul``: torch's own sums in torch's order, so headlab's outputs equal
transformers' bit for bit, about 2x faster on AMD CPUs with AVX-512, where MKL keeps to
AVX2 (a whole SmolLM2 forward at B=4, S=256: 1.8x transformers, against parity with
torch's products; oneDNN, tried as an opt-in before this kernel, was as fast but 4e-4
away from transformers on SmolLM2's logits). Training, other devices and machines where
the kernel is not torch's order take ``F.linear``. ``linear`` is the same choice for a
weight that is not a ``Linear``'s (BERT's tied output embedding).

Parameter names and shapes are nn.Linear's, so checkpoints, hooks and pruning see no
difference. ``store_input_major`` changes only where a weight's numbers lie in memory:
the output embedding of a language model (49152 x 576 in SmolLM2, a fifth of its
bytes) is read 1.5x faster by a split product when stored as its transpose.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from headlab import kernels

__all__ = ["Linear", "linear", "store_input_major"]

# at most this many rows take the kernel or the split; measured on the SmolLM2 shapes,
# both were still faster than one MKL call at 16 rows (kernel 1.3x, split 1.1-1.8x)
MAX_SPLIT_ROWS = 16
# smaller weights (a 192 x 576 key projection: 110k) gained nothing measurable
MIN_SPLIT_WEIGHT = 2**17


class Linear(nn.Linear):
    """nn.Linear; a CPU product of at most 16 rows runs on headlab's C kernel when no
    gradient is needed, else (or without the kernel) is split by rows of a large weight
    across threads; larger ones take `linear` (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.device.type != "cpu" or not 0 < x.numel() <= MAX_SPLIT_ROWS * w.shape[1]:
            return linear(x, w, self.bias)
        if not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            y = kernels.linear_rows(x, w, self.bias)  # row-major float32 weights
            if y is not None:
                return y
        parts = torch.get_num_threads()
        if (
            parts > 1
            and w.numel() >= MIN_SPLIT_WEIGHT
            and (w.is_contiguous() or w.t().is_contiguous())  # row- or input-major
        ):
            return _split_product(x, w, self.bias, parts)
        return F.linear(x, w, self.bias)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), bit for bit, on headlab's matmul kernel where it applies
    (``kernels.matmul``): weights and bias that need no gradient; the input's gradient,
    as in importance scoring, is one more product on the kernel."""
    if torch.is_grad_enabled() and (w.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return F.linear(x, w, bias)
    if torch.is_grad_enabled() and x.requires_grad:
        if x.device.type != "cpu":  # the kernel is CPU's: torch's own autograd elsewhere
            return F.linear(x, w, bias)
        return _KernelLinear.apply(x, w, bias)
    y = kernels.matmul(x, w.t(), bias)
    return F.linear(x, w, bias) if y is None else y


class _KernelLinear(torch.autograd.Function):
    """x (..., K) @ w (N, K)^T + bias by ``kernels.matmul``, differentiable in x only:
    the input's gradient dy (..., N) @ w is the product torch's own backward computes."""

    @staticmethod
    def forward(ctx, x, w, bias):
        ctx.save_for_backward(w)
        y = kernels.matmul(x, w.t(), bias)
        return F.linear(x, w, bias) if y is None else y

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        dx = kernels.matmul(dy, w)
        return dy @ w if dx is None else dx, None, None


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
