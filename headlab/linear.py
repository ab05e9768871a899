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
transformers' bit for bit, about 2x faster on AMD CPUs with AVX-512 (where MKL keeps to
AVX2). Training, other devices and machines where the kernel is not torch's order take
``F.linear``. ``set_products("onednn")`` (or ``HEADLAB_PRODUCTS=onednn``) sends the large
products whose weights need no gradient (inference, importance scoring) to oneDNN
instead: on AMD CPUs with AVX-512, where MKL keeps to AVX2, they run 2-2.4x faster
(measured on 2 Zen 5 cores: 500 vs 210 GFLOP/s for SmolLM2's MLP products, a whole
SmolLM2 forward 0.75 vs 1.42 s). The sums are the same float32 sums in another order:
as close to float64 as MKL's (8.1e-5 vs 5.8e-5 on SmolLM2's logits), but 4e-4 away
from transformers' on logits of magnitude 36, which is why it is not the default.

Parameter names and shapes are nn.Linear's, so checkpoints, hooks and pruning see no
difference. ``store_input_major`` changes only where a weight's numbers lie in memory:
the output embedding of a language model (49152 x 576 in SmolLM2, a fifth of its
bytes) is read 1.5x faster by a split product when stored as its transpose.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from headlab import kernels

__all__ = ["PRODUCTS", "Linear", "onednn_available", "products", "set_products",
           "store_input_major"]

log = logging.getLogger(__name__)

PRODUCTS = ("exact", "onednn")  # see the module docstring

# at most this many rows take the kernel or the split; measured on the SmolLM2 shapes,
# both were still faster than one MKL call at 16 rows (kernel 1.3x, split 1.1-1.8x)
MAX_SPLIT_ROWS = 16
# smaller weights (a 192 x 576 key projection: 110k) gained nothing measurable
MIN_SPLIT_WEIGHT = 2**17


class Linear(nn.Linear):
    """nn.Linear; a CPU product of at most 16 rows runs on headlab's C kernel when no
    gradient is needed, else (or without the kernel) is split by rows of a large weight
    across threads (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.device.type != "cpu" or not 0 < x.numel() <= MAX_SPLIT_ROWS * w.shape[1]:
            if _products == "onednn" and x.device.type == "cpu" and _onednn_ok(x, w, self.bias):
                return _OneDNNLinear.apply(x, w, self.bias)
            return _large_product(x, w, self.bias)
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


_products = "exact"


def set_products(name: str) -> None:
    """Choose what runs CPU products of more than 16 rows whose weights need no gradient:
    "exact" (F.linear, transformers' bits) or "onednn" (faster where MKL is slow; see
    the module docstring). Where oneDNN is missing or fails its check, "onednn" logs a
    warning once and products stay exact."""
    global _products
    if name not in PRODUCTS:
        raise ValueError(f"products must be one of {', '.join(PRODUCTS)}, got {name!r}")
    _products = name


@contextlib.contextmanager
def products(name: str) -> Iterator[None]:
    """`set_products` for a ``with`` block."""
    before = _products
    set_products(name)
    try:
        yield
    finally:
        set_products(before)


try:
    set_products(os.environ.get("HEADLAB_PRODUCTS", "exact"))
except ValueError as exc:
    raise ValueError(f"HEADLAB_PRODUCTS: {exc}") from None


def _large_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, bias), bit for bit, on headlab's matmul kernel where it applies
    (``kernels.matmul``): weights and bias that need no gradient; the input's gradient,
    as in importance scoring, is one more product on the kernel."""
    if torch.is_grad_enabled() and (w.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return F.linear(x, w, bias)
    if torch.is_grad_enabled() and x.requires_grad:
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


def _onednn_ok(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether this product may go to oneDNN: no gradient for the weight or bias (the
    input's, as in importance scoring, is one more product), float32 throughout (torch
    already sends bfloat16 products there), and a oneDNN that passed its check."""
    if torch.is_grad_enabled() and (w.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        return False
    if bias is not None and bias.dtype != torch.float32:
        return False
    return onednn_available()


class _OneDNNLinear(torch.autograd.Function):
    """x (..., K) @ w (N, K)^T + bias on oneDNN, differentiable in x only: the input's
    gradient is the product dy (..., N) @ w, with w^T as oneDNN's weight (a view)."""

    @staticmethod
    def forward(ctx, x, w, bias):
        ctx.save_for_backward(w)
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        dx = torch.ops.mkldnn._linear_pointwise(dy.contiguous(), w.t(), None, "none", [], "")
        return dx, None, None


@functools.cache
def onednn_available() -> bool:
    """oneDNN's linear exists and agrees with float64 on awkward shapes (odd sizes,
    bias, 3-D input, an input-major weight) as closely as float32 allows."""
    reason = None
    try:
        if not torch.backends.mkldnn.is_available():
            reason = "this torch build has no oneDNN"
        else:
            gen = torch.Generator().manual_seed(0)
            for lead, n, k, input_major in (((37,), 61, 29, False), ((3, 7), 130, 67, True)):
                x = torch.randn(*lead, k, generator=gen)
                w = torch.randn(n, k, generator=gen)
                b = torch.randn(n, generator=gen)
                if input_major:
                    w = w.t().contiguous().t()
                got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
                want = F.linear(x.double(), w.double(), b.double())
                if got.shape != want.shape or not torch.allclose(got.double(), want,
                                                                rtol=1e-4, atol=1e-4):
                    reason = "oneDNN's linear disagreed with float64"
    except (AttributeError, RuntimeError) as exc:
        reason = f"oneDNN's linear is unavailable ({exc})"
    if reason is not None:
        log.warning("%s; products stay exact", reason)
    return reason is None


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
