"""headlab.models.kernels: the C decoding kernel builds here, equals float64, declines what it
does not compute, and falls back to torch without a compiler."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.testing import assert_close

from headlab.models import kernels

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _forget_kernels() -> None:
    kernels._library.cache_clear()


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
    if case not in ("wrong input width", "wrong bias length"):
        assert not kernels.fits(w, b)  # what generation asks before switching a layer


def test_fits_accepts_nn_linear_weights():
    lin = torch.nn.Linear(64, 32)
    assert kernels.fits(lin.weight, lin.bias) and kernels.fits(lin.weight, None)


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
def test_without_the_kernel_linear_rows_declines(fresh, monkeypatch, caplog, env, why):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert why in kernels.status()
    x, w = torch.randn(1, 576), torch.randn(1536, 576)
    assert kernels.linear_rows(x, w, None) is None
    assert not kernels.available()
    if env.get("HEADLAB_KERNELS") != "0":  # a user who did not opt out is told once
        assert "decoding uses torch's products" in caplog.text
