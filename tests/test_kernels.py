"""headlab.kernels: the C decoding kernel builds here, equals float64, and falls back."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from headlab import kernels
from headlab.linear import Linear, linear, store_input_major

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _forget_kernels() -> None:
    kernels._library.cache_clear()
    kernels._matmul_checked.cache_clear()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A kernel state built from scratch into an empty cache, restored afterwards."""
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path))
    _forget_kernels()
    yield tmp_path
    _forget_kernels()


def reference(x, w, b):
    return (x.double() @ w.double().t() + (0 if b is None else b.double())).float()


@needs_cc
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 1), (16,)])
@pytest.mark.parametrize("n_out,n_in", [(1, 1), (7, 13), (64, 8), (1001, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_float64(lead, n_out, n_in, bias):
    g = torch.Generator().manual_seed(n_out * n_in)
    x = torch.randn(*lead, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g)
    b = torch.randn(n_out, generator=g) if bias else None
    y = kernels.linear_rows(x, w, b)
    assert y is not None, kernels.status()
    assert y.shape == (*lead, n_out)
    assert_close(y, reference(x, w, b), rtol=1e-5, atol=1e-4)


@needs_cc
def test_kernel_result_does_not_depend_on_thread_count():
    """Each output is summed by one thread, so 1 and 2 threads agree bit for bit."""
    x, w = torch.randn(3, 576), torch.randn(1536, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear_rows(x, w, None)
        torch.set_num_threads(2)
        two = kernels.linear_rows(x, w, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_cc
def test_linear_takes_the_kernel_without_grad_and_autograd_with_it(monkeypatch):
    calls = []
    real = kernels.linear_rows
    monkeypatch.setattr(kernels, "linear_rows", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    lin = Linear(576, 1536)
    x = torch.randn(1, 576, requires_grad=True)
    with torch.no_grad():
        assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert calls == [1]
    lin(x).sum().backward()  # needs a gradient: never the kernel
    assert calls == [1] and x.grad is not None
    assert_close(x.grad[0], lin.weight.sum(0).detach(), rtol=1e-5, atol=1e-5)


@needs_cc
@pytest.mark.parametrize(
    "case",
    ["float64", "input-major weight", "float64 bias", "strided bias", "meta weight",
     "wrong input width", "wrong bias length"],
)
def test_kernel_declines_what_it_does_not_compute(case):
    x, w, b = torch.randn(1, 64), torch.randn(32, 64), torch.randn(32)
    if case == "float64":
        x, w = x.double(), w.double()
    elif case == "input-major weight":
        w = w.t().contiguous().t()
    elif case == "float64 bias":
        b = b.double()
    elif case == "strided bias":
        b = torch.randn(64)[::2]
    elif case == "meta weight":
        w = w.to("meta")
    elif case == "wrong input width":
        x = torch.randn(1, 63)
    else:
        b = torch.randn(31)
    assert kernels.linear_rows(x, w, b) is None


@needs_cc
def test_a_wrong_shape_is_torchs_error_not_a_crash():
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot be multiplied"):
        Linear(64, 32)(torch.randn(1, 63))


@needs_cc
def test_built_once_into_the_cache_then_reused(fresh):
    assert kernels.status().startswith("C kernel")
    (built,) = fresh.glob("kernels/*/headlab_kernels.so")
    stamp = built.stat().st_mtime_ns
    _forget_kernels()
    assert kernels.status().startswith("C kernel")
    assert list(fresh.glob("kernels/*/headlab_kernels.so")) == [built]
    assert built.stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    "env,why",
    [
        ({"HEADLAB_KERNELS": "0"}, "HEADLAB_KERNELS=0"),
        ({"CC": "/nonexistent/cc"}, "no C compiler"),
        ({"CC": "false"}, "the kernel did not build"),
    ],
)
def test_without_the_kernel_linear_falls_back(fresh, monkeypatch, caplog, env, why):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert why in kernels.status()
    x, w = torch.randn(1, 576), torch.randn(1536, 576)
    assert kernels.linear_rows(x, w, None) is None
    lin = Linear(576, 1536)
    with torch.no_grad():
        assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    if env.get("HEADLAB_KERNELS") != "0":  # a user who did not opt out is told once
        assert "decoding uses torch's slower products" in caplog.text


# ------------------------------------------------------------------ matmul (gemm.c)
needs_matmul = pytest.mark.skipif(
    not kernels.matmul_available(), reason=kernels.matmul_status()
)


@needs_matmul
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "rows,k,n",
    # K in each case of the blocking (one block, two halves, 192s with a remainder);
    # 320 = a pruned attention output of 5 heads; the SmolLM2 and GPT-2 shapes
    [(17, 3, 16), (33, 64, 17), (100, 192, 77), (64, 194, 130), (40, 320, 576),
     (23, 385, 64), (256, 576, 1536), (130, 1536, 576), (64, 768, 2304), (70, 3072, 768)],
)
def test_matmul_is_torchs_product_bit_for_bit(rows, k, n, threads):
    g = torch.Generator().manual_seed(rows * k + n)
    a = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)  # nn.Linear's layout: b = w.t()
    b_kn = torch.randn(k, n, generator=g)  # row-major (K, N): an input-major weight
    bias = torch.randn(n, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert torch.equal(kernels.matmul(a, w.t(), bias), F.linear(a, w, bias))
        assert torch.equal(kernels.matmul(a, w.t()), F.linear(a, w))
        assert torch.equal(kernels.matmul(a, b_kn, bias), torch.addmm(bias, a, b_kn))
    finally:
        torch.set_num_threads(before)


@needs_matmul
def test_matmul_keeps_leading_dims():
    a, w = torch.randn(2, 3, 9, 64), torch.randn(40, 64)
    y = kernels.matmul(a, w.t())
    assert y.shape == (2, 3, 9, 40) and torch.equal(y, F.linear(a, w))


@needs_matmul
@pytest.mark.parametrize(
    "case",
    ["16 rows", "15 outputs", "odd K of two blocks", "float64", "strided weight",
     "meta input", "wrong width", "wrong bias length", "float64 bias"],
)
def test_matmul_declines_what_torch_computes_another_way(case):
    """Fewer rows or outputs take other MKL paths (another order), so torch keeps them."""
    a, w, bias = torch.randn(40, 64), torch.randn(32, 64), torch.randn(32)
    if case == "16 rows":
        a = a[:16]
    elif case == "15 outputs":
        w, bias = w[:15], bias[:15]
    elif case == "odd K of two blocks":  # MKL splits it in an order not known here
        a, w = torch.randn(40, 201), torch.randn(32, 201)
    elif case == "float64":
        a, w = a.double(), w.double()
    elif case == "strided weight":
        w = torch.randn(32, 128)[:, ::2]
    elif case == "meta input":
        a = a.to("meta")
    elif case == "wrong width":
        a = torch.randn(40, 63)
    elif case == "wrong bias length":
        bias = torch.randn(31)
    else:
        bias = bias.double()
    assert kernels.matmul(a, w.t(), bias) is None


@needs_matmul
def test_matmul_unused_when_it_is_not_torchs_order(fresh, monkeypatch, caplog):
    """A library whose sums differ from torch's in the last bit is not used at all."""
    real = kernels._gemm
    monkeypatch.setattr(kernels, "_gemm", lambda *a: torch.nextafter(real(*a), torch.tensor(1e9)))
    with caplog.at_level("INFO", logger="headlab.kernels"):
        assert "not bit-identical" in kernels.matmul_status()
    assert kernels.matmul(torch.randn(40, 64), torch.randn(64, 32)) is None
    assert "matmul kernel unused" in caplog.text


@needs_matmul
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("input_major", [False, True])
def test_linear_runs_large_products_on_matmul_with_torchs_results_and_gradients(
    matmul_runs, bias, input_major
):
    """Inference and frozen-weight scoring take the kernel; results and the input's
    gradient equal autograd through F.linear bit for bit."""
    ran = matmul_runs
    torch.manual_seed(0)
    lin = Linear(576, 192, bias=bias).requires_grad_(False)
    if input_major:
        store_input_major(lin.weight)
    x = torch.randn(2, 40, 576)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert ran == [True]
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    cot = torch.randn(2, 40, 192)
    (lin(xs[0]) * cot).sum().backward()
    (F.linear(xs[1], lin.weight, lin.bias) * cot).sum().backward()
    assert ran == [True] * 3  # and the forward and the input's gradient
    assert torch.equal(xs[0].grad, xs[1].grad)


@needs_matmul
def test_linear_leaves_trainable_weights_to_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "matmul", lambda *a: calls.append(1))
    lin = Linear(64, 32)  # weights need a gradient
    lin(torch.randn(40, 64)).sum().backward()
    assert calls == [] and lin.weight.grad is not None


def test_products_off_the_cpu_never_build_the_library(fresh):
    """A GPU run (meta tensors here) goes straight to torch, with and without autograd."""
    x, w = torch.randn(40, 64, device="meta"), torch.randn(32, 64, device="meta")
    assert kernels.matmul(x, w.t()) is None
    with torch.no_grad():
        assert linear(x, w).shape == (40, 32)
    grad_fn = linear(x.requires_grad_(), w).grad_fn  # torch's autograd, not headlab's
    assert grad_fn is not None and "KernelLinear" not in type(grad_fn).__name__
    assert kernels._library.cache_info().currsize == 0


def test_without_the_kernels_matmul_is_none(fresh, monkeypatch):
    monkeypatch.setenv("HEADLAB_KERNELS", "0")
    assert kernels.matmul(torch.randn(40, 64), torch.randn(64, 32)) is None
    assert kernels.matmul_status() == "torch (HEADLAB_KERNELS=0)"


def _amd_avx512() -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "AuthenticAMD" in info and " avx512f" in info


@pytest.mark.skipif(not (_amd_avx512() and shutil.which("cc")),
                    reason="the kernel's order is checked against MKL on AMD AVX-512 CPUs")
def test_matmul_is_used_on_amd_avx512_cpus():
    """Where MKL keeps to AVX2 (AMD), headlab's products must match it and be used; a
    kernel that lost torch's order would otherwise only show as a slower bench."""
    assert kernels.matmul_available(), kernels.matmul_status()


@needs_cc
def test_unused_turns_both_kernels_off_for_a_block():
    x, w = torch.randn(40, 64), torch.randn(32, 64)
    with kernels.unused():
        assert kernels.matmul(x, w.t()) is None
        assert kernels.linear_rows(x[:1], w, None) is None
    assert kernels.linear_rows(x[:1], w, None) is not None
    if kernels.matmul_available():
        assert kernels.matmul(x, w.t()) is not None
