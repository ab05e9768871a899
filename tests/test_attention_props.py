"""Property tests for headlab.attention: torch.nn.MultiheadAttention as reference, and no
NaN ever leaving the module.

Tensors come from a seed that hypothesis draws, so examples stay small and fast; the
sizes, mask kinds and layouts are drawn directly so that they shrink well.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing import assert_close

from headlab.attention import MultiHeadAttention

FAST = settings(max_examples=40, deadline=None)


# ---------------------------------------------------------------------------- torch reference
@st.composite
def torch_cases(draw):
    """Sizes, masks and layouts with at least one key left in every query row (torch
    gives NaN on fully masked rows)."""
    return {
        "B": draw(st.integers(1, 3)),
        "S": draw(st.integers(1, 6)),
        "H": draw(st.integers(1, 4)),
        "D": draw(st.integers(1, 4)),
        "bias": draw(st.booleans()),
        "batch_first": draw(st.booleans()),
        "padding": draw(st.booleans()),
        "attn": draw(st.sampled_from([None, "bool_2d", "bool_bh", "float_2d", "float_bh"])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@FAST
@given(case=torch_cases())
def test_matches_torch_multihead_attention(case):
    B, S, H, D = case["B"], case["S"], case["H"], case["D"]
    E = H * D
    g = torch.Generator().manual_seed(case["seed"])
    torch.manual_seed(case["seed"])
    ref = nn.MultiheadAttention(E, H, bias=case["bias"], batch_first=case["batch_first"])
    ref.eval()
    if case["bias"]:  # torch initialises the biases to zero: make them count
        with torch.no_grad():
            ref.in_proj_bias.normal_(generator=g)
            ref.out_proj.bias.normal_(generator=g)
    m = MultiHeadAttention.from_torch(ref).eval()
    x = torch.randn(B, S, E, generator=g)
    keep = int(torch.randint(S, (1,), generator=g))  # a key every row may attend to

    ours: dict = {}
    theirs: dict = {}
    if case["padding"]:
        real = torch.rand(B, S, generator=g) > 0.4
        real[:, keep] = True
        ours["key_padding_mask"] = real
        theirs["key_padding_mask"] = ~real  # torch: True = masked out
    if case["attn"] is not None:
        per_head = case["attn"].endswith("_bh")
        shape = (B, H, S, S) if per_head else (S, S)
        if case["attn"].startswith("bool"):
            allowed = torch.rand(shape, generator=g) > 0.5
            allowed[..., keep] = True
            ours["attn_mask"] = allowed
            their_mask = ~allowed
        else:
            additive = torch.randn(shape, generator=g)
            additive[torch.rand(shape, generator=g) < 0.4] = float("-inf")
            additive[..., keep] = torch.randn(shape[:-1], generator=g)
            ours["attn_mask"] = additive
            their_mask = additive
            if "key_padding_mask" in theirs:  # same mask types on the torch side
                pad = theirs["key_padding_mask"]
                theirs["key_padding_mask"] = torch.zeros(B, S).masked_fill(pad, float("-inf"))
        # torch takes a 3-D mask as (B * H, S, T)
        theirs["attn_mask"] = their_mask.reshape(B * H, S, S) if per_head else their_mask

    xt = x if case["batch_first"] else x.transpose(0, 1)  # (S, B, E) for batch_first=False
    with torch.no_grad():
        want, want_w = ref(xt, xt, xt, need_weights=True, average_attn_weights=False, **theirs)
        if not case["batch_first"]:
            want = want.transpose(0, 1)
        fast = m(x, **ours)
        eager, w = m(x, need_weights=True, **ours)
    assert torch.isfinite(want).all()  # the case really has no fully masked row
    assert_close(fast, want, rtol=1e-5, atol=1e-5)
    assert_close(eager, want, rtol=1e-5, atol=1e-5)
    assert_close(w, want_w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- no NaN
@st.composite
def nan_cases(draw):
    h_kv = draw(st.integers(1, 3))
    causal = draw(st.booleans())
    return {
        "B": draw(st.integers(1, 3)),
        "S": draw(st.integers(1, 6)),
        "H_kv": h_kv,
        "group": draw(st.integers(1, 3)),
        "D": draw(st.sampled_from([1, 2, 3])),
        "E": draw(st.sampled_from([3, 8])),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "causal": causal,
        "window": draw(st.sampled_from([None, 1, 2])) if causal else None,
        # fraction of keys masked: 1.0 masks every key of every row
        "padding": draw(st.sampled_from([None, 0.5, 1.0])),
        "attn": draw(st.sampled_from([None, "bool", "float"])),
        "attn_density": draw(st.sampled_from([0.3, 0.8, 1.0])),
        "attn_dims": draw(st.sampled_from([2, 3, 4])),
        "scale": draw(st.sampled_from([1e-3, 1.0, 30.0])),
        "eager": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@FAST
@given(case=nan_cases())
def test_no_nan_ever_leaves_the_module(case):
    B, S, dtype = case["B"], case["S"], case["dtype"]
    H = case["H_kv"] * case["group"]
    g = torch.Generator().manual_seed(case["seed"])
    torch.manual_seed(case["seed"])
    m = MultiHeadAttention(
        d_model=case["E"], n_heads=H, n_kv_heads=case["H_kv"], head_dim=case["D"]
    ).to(dtype)
    x = (torch.randn(B, S, case["E"], generator=g) * case["scale"]).to(dtype)
    x.requires_grad_(True)

    kw: dict = {"causal": case["causal"], "window": case["window"]}
    if case["padding"] is not None:
        kw["key_padding_mask"] = torch.rand(B, S, generator=g) >= case["padding"]
    if case["attn"] is not None:
        shape = {2: (S, S), 3: (B, S, S), 4: (B, H, S, S)}[case["attn_dims"]]
        masked = torch.rand(shape, generator=g) < case["attn_density"]
        if case["attn"] == "bool":
            kw["attn_mask"] = ~masked
        else:
            values = torch.randn(shape, generator=g, dtype=dtype) * 10
            values[torch.rand(shape, generator=g) < 0.2] = torch.finfo(dtype).min
            kw["attn_mask"] = values.masked_fill(masked, float("-inf"))

    if case["eager"]:
        out, w = m(x, need_weights=True, **kw)
        assert not torch.isnan(w).any()
    else:
        out, w = m(x, **kw), None
    assert out.shape == (B, S, case["E"])
    assert not torch.isnan(out).any()
    loss = out.square().sum() + (0 if w is None else w.sum())
    loss.backward()
    assert not torch.isnan(x.grad).any()
    for name, p in m.named_parameters():
        assert not torch.isnan(p.grad).any(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_key_masked_gives_bias_only(dtype):
    """The extreme the property draws only sometimes: every row of every example masked."""
    m = MultiHeadAttention(d_model=6, n_heads=3, n_kv_heads=1).to(dtype)
    x = torch.randn(2, 4, 6, dtype=dtype)
    kpm = torch.zeros(2, 4, dtype=torch.bool)
    want = m.o_proj.bias.detach().expand(2, 4, 6)
    for need_weights in (False, True):
        got = m(x, key_padding_mask=kpm, need_weights=need_weights)
        out = got[0] if need_weights else got
        assert_close(out, want, rtol=0, atol=0)
