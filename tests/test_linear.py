"""headlab.linear.Linear: the split few-row product equals nn.Linear's, and is taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import headlab.linear as hl_linear
from headlab.linear import Linear, store_input_major


@pytest.fixture
def threads():
    """Run with the given number of torch threads, restoring the old count after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def make(n_out: int, n_in: int, bias: bool, input_major: bool = False) -> Linear:
    torch.manual_seed(0)
    lin = Linear(n_in, n_out, bias=bias)
    if input_major:
        store_input_major(lin.weight)
    return lin


@pytest.mark.parametrize("input_major", [False, True], ids=["out-major", "in-major"])
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("n_out", [768, 1001])  # 1001: no thread count divides it
@pytest.mark.parametrize("lead", [(1, 1), (3,), (2, 4, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_split_product_equals_f_linear(threads, spy, bias, lead, n_out, parts, input_major):
    threads(parts)
    lin = make(n_out, 256, bias, input_major)
    x = torch.randn(*lead, 256)
    out = lin(x)
    assert spy.calls == 1  # the split path ran
    assert out.shape == (*lead, n_out)
    assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_split_product_gradients_equal_f_linear(threads, spy):
    threads(2)
    lin = make(1002, 256, True)
    x = torch.randn(2, 256, requires_grad=True)
    lin(x).square().sum().backward()
    assert spy.calls == 1
    got = (x.grad, lin.weight.grad, lin.bias.grad)
    x2 = x.detach().clone().requires_grad_()
    ref = make(1002, 256, True)
    F.linear(x2, ref.weight, ref.bias).square().sum().backward()
    for a, b in zip(got, (x2.grad, ref.weight.grad, ref.bias.grad), strict=True):
        assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    ["one thread", "many rows", "small weight", "strided weight"],
)
def test_other_products_take_f_linear(threads, spy, case):
    threads(1 if case == "one thread" else 2)
    lin = make(64 if case == "small weight" else 768, 256, True)
    if case == "strided weight":
        lin.weight.data = torch.randn(768, 512)[:, ::2]  # neither row- nor column-major
    rows = 17 if case == "many rows" else 1
    x = torch.randn(rows, 256)
    assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
    assert spy.calls == 0


def test_input_major_keeps_values_and_survives_load_state_dict():
    lin = make(768, 256, False)
    before = lin.weight.detach().clone()
    store_input_major(lin.weight)
    assert lin.weight.shape == (768, 256) and lin.weight.stride() == (1, 768)
    assert torch.equal(lin.weight, before)
    lin.load_state_dict({"weight": before * 2})
    assert lin.weight.stride() == (1, 768)
    assert torch.equal(lin.weight, before * 2)


@pytest.fixture
def spy(monkeypatch):
    """Count calls of the split path."""

    class Spy:
        calls = 0

    def wrap(fn):
        def counted(*args, **kwargs):
            Spy.calls += 1
            return fn(*args, **kwargs)

        return counted

    monkeypatch.setattr(hl_linear, "_split_product", wrap(hl_linear._split_product))
    return Spy
