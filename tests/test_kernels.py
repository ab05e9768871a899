"""headlab.kernels: the C decoding kernel builds here, equals float64, and falls back."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from headlab import kernels
from headlab.linear import Linear

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A kernel state built from scratch into an empty cache, restored afterwards."""
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path))
    kernels._kernel.cache_clear()
    yield tmp_path
    kernels._kernel.cache_clear()


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
    (built,) = fresh.glob("kernels/*/linear_rows.so")
    stamp = built.stat().st_mtime_ns
    kernels._kernel.cache_clear()
    assert kernels.status().startswith("C kernel")
    assert list(fresh.glob("kernels/*/linear_rows.so")) == [built]
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
