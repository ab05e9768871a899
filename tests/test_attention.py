"""Tests for headlab.attention.MultiHeadAttention, in layers.

Invariants (rows sum to 1, causal triangle, no NaN on fully masked rows), equivalences
(fast path == eager path, GQA == MHA with repeated K/V, cache == full recompute, gated
head == pruned head, head permutation) and references (a float64 per-head loop written
here, the worked example by hand). The comparison with torch.nn.MultiheadAttention and
the NaN property live in test_attention_props.py.

Shape notation as in the module: B batch, S query length, T key length, H query heads,
H_kv key/value heads, D head dim, E model dim.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from headlab.attention import MultiHeadAttention
from headlab.attention.kv_cache import KVCache
from headlab.attention.masks import Mask
from headlab.attention.rotary import apply_rotary

F64 = torch.float64
F32 = torch.float32
PATHS = ("fast", "eager")
# name -> (H, H_kv)
LAYOUTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
MASK_KINDS = (
    "none",
    "causal",
    "window",
    "key_padding",
    "causal+key_padding",  # left padding: the first query rows see no key at all
    "bool_2d",
    "bool_3d",
    "bool_4d",
    "additive_2d",
    "additive_4d",
    "causal+window+bool+additive+key_padding",
)


# pruning every head builds Linear layers with zero features; torch warns that
# initialising them is a no-op, which is expected here
filter_zero_element_warning = pytest.mark.filterwarnings(
    "ignore:Initializing zero-element tensors is a no-op:UserWarning"
)


# ---------------------------------------------------------------------------- helpers
def make_mha(
    *, layout: str = "mha", d_model: int = 8, head_dim: int | None = None,
    bias: bool = True, out_bias: bool | None = None, dtype: torch.dtype = F32, seed: int = 0,
) -> MultiHeadAttention:
    """A module with random weights and clearly non-zero biases, in eval mode."""
    h, h_kv = LAYOUTS[layout]
    torch.manual_seed(seed)
    m = MultiHeadAttention(
        d_model=d_model, n_heads=h, n_kv_heads=h_kv, head_dim=head_dim,
        bias=bias, out_bias=out_bias,
    )
    with torch.no_grad():
        for lin in (m.q_proj, m.k_proj, m.v_proj, m.o_proj):
            lin.weight.normal_(0.0, 1.0 / math.sqrt(lin.in_features))
            if lin.bias is not None:
                lin.bias.normal_(0.0, 0.5)
    return m.to(dtype).eval()


def call(m: MultiHeadAttention, x: torch.Tensor, path: str, **kw):
    """Run one path; returns (out, weights or None)."""
    if path == "fast":
        return m(x, **kw), None
    return m(x, need_weights=True, **kw)


def mask_case(kind: str, B: int, H: int, S: int, dtype: torch.dtype, seed: int = 1):
    """Module kwargs for a mask kind and, built independently of Mask.build, the
    (B, H, S, S) boolean ``allowed`` and additive ``bias`` a plain reference applies."""
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(S)[:, None]  # query position
    j = torch.arange(S)[None, :]  # key position
    kw: dict = {}
    allowed = torch.ones(B, H, S, S, dtype=torch.bool)
    bias = torch.zeros(B, H, S, S, dtype=dtype)
    if "causal" in kind:
        kw["causal"] = True
        allowed &= j <= i
    if "window" in kind:
        kw["causal"] = True
        kw["window"] = 3
        allowed &= (j <= i) & (j > i - 3)
    if "key_padding" in kind:
        kpm = torch.ones(B, S, dtype=torch.bool)
        kpm[0, :2] = False  # left padding
        kpm[-1, -2:] = False  # right padding
        kw["key_padding_mask"] = kpm
        allowed &= kpm[:, None, None, :]
    if "bool" in kind:
        shape = {"bool_2d": (S, S), "bool_3d": (B, S, S)}.get(kind, (B, H, S, S))
        m = torch.rand(shape, generator=g) > 0.3
        kw["attn_mask"] = m
        allowed &= {2: m[None, None], 3: m[:, None], 4: m}[m.dim()]
    if "additive" in kind:
        shape = (S, S) if kind == "additive_2d" else (1, H, S, S)
        a = torch.randn(shape, generator=g, dtype=dtype)
        a[torch.rand(shape, generator=g) < 0.2] = float("-inf")
        if "bool" in kind:  # both kinds at once: pass the bool part as an additive -inf
            a = a.masked_fill(~kw.pop("attn_mask"), float("-inf"))
        kw["attn_mask"] = a
        bias = bias + (a[None, None] if a.dim() == 2 else a)
    return kw, allowed, bias


def rotary_tables(S: int, D: int, dtype: torch.dtype, offset: int = 0):
    """HF-style (cos, sin), each (1, S, D), and the plain angles (S, D/2)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=F64) / D))
    angles = torch.arange(offset, offset + S, dtype=F64)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return (emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)), angles


def rotate_plain(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (S, D): rotate each pair (x[i], x[i + D/2]) at position p by angles[p, i]."""
    out = x.clone()
    half = x.shape[-1] // 2
    for p in range(x.shape[0]):
        for i in range(half):
            c, s = math.cos(angles[p, i]), math.sin(angles[p, i])
            a, b = x[p, i], x[p, i + half]
            out[p, i] = c * a - s * b
            out[p, i + half] = s * a + c * b
    return out


def reference(m: MultiHeadAttention, x, allowed, bias, angles=None):
    """Float64 attention, one head at a time, from the module's weights only.

    Returns out (B, S, E) and weights (B, H, S, T); a row with no allowed finite key
    gives zero weights and a zero head output.
    """
    x = x.to(F64)
    B, S, _ = x.shape
    H, H_kv, D = m.n_heads, m.n_kv_heads, m.head_dim
    group = H // H_kv

    def wb(lin):
        w = lin.weight.detach().to(F64)
        if lin.bias is None:
            return w, torch.zeros(w.shape[0], dtype=F64)
        return w, lin.bias.detach().to(F64)

    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = map(wb, (m.q_proj, m.k_proj, m.v_proj, m.o_proj))
    z = torch.zeros(B, S, H, D, dtype=F64)
    weights = torch.zeros(B, H, S, S, dtype=F64)
    for b in range(B):
        for h in range(H):
            qs, ks = slice(h * D, (h + 1) * D), slice((h // group) * D, (h // group + 1) * D)
            q = x[b] @ wq[qs].T + bq[qs]  # (S, D)
            k = x[b] @ wk[ks].T + bk[ks]
            v = x[b] @ wv[ks].T + bv[ks]
            if angles is not None:
                q, k = rotate_plain(q, angles), rotate_plain(k, angles)
            s = (q @ k.T) * m.scale + bias[b, h].to(F64)  # (S, T)
            s = s.masked_fill(~allowed[b, h], float("-inf"))
            for i in range(S):
                if torch.isfinite(s[i]).any():
                    weights[b, h, i] = torch.softmax(s[i], dim=0)
            z[b, :, h] = weights[b, h] @ v
    return z.reshape(B, S, H * D) @ wo.T + bo, weights


# ---------------------------------------------------------------------------- validation
def test_n_heads_must_be_a_multiple_of_n_kv_heads():
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be a multiple of n_kv_heads \(4\)"):
        MultiHeadAttention(d_model=12, n_heads=6, n_kv_heads=4)


def test_d_model_not_divisible_asks_for_head_dim():
    with pytest.raises(ValueError, match=r"d_model \(10\).*n_heads \(4\).*head_dim"):
        MultiHeadAttention(d_model=10, n_heads=4)
    assert MultiHeadAttention(d_model=10, n_heads=4, head_dim=3).q_proj.out_features == 12


def test_zero_heads_rejected():
    with pytest.raises(ValueError, match=r"n_heads \(0\)"):
        MultiHeadAttention(d_model=8, n_heads=0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"causal": True, "window": 0}, r"window must be >= 1, got 0"),
        ({"window": 2}, r"sliding window needs causal=True"),
        ({"key_padding_mask": torch.ones(2, 4, dtype=torch.bool)}, r"\(2, 5\), got \(2, 4\)"),
        ({"attn_mask": torch.ones(5, 4, dtype=torch.bool)}, r"\(5, 5\), got \(5, 4\)"),
        ({"attn_mask": torch.ones(1, 2, 1, 5, 5, dtype=torch.bool)}, r"got 5-D"),
    ],
)
def test_bad_mask_arguments_raise(kw, message):
    m = make_mha()
    with pytest.raises(ValueError, match=message):
        m(torch.randn(2, 5, 8), **kw)


def test_causal_query_longer_than_keys_raises():
    with pytest.raises(ValueError, match=r"q_len <= k_len, got 3 > 2"):
        Mask.build(batch=1, q_len=3, k_len=2, causal=True)


# ---------------------------------------------------------------------------- worked example
def test_worked_example_kot_pije_mleko():
    """Keys kot=[4,0], pije=[0,0], mleko=[0,4]; values [1,0], [0,0], [0,1]; D = 2 so the
    scale is 1/sqrt(2). Three heads read the 4th (query) token with queries [1,0], [0,1]
    and [1,1]; the attn_mask lets that token see only the three words."""
    m = MultiHeadAttention(d_model=2, n_heads=3, head_dim=2, bias=False)
    eye = torch.eye(2)
    with torch.no_grad():
        # inputs: kot=[1,0], pije=[0,0], mleko=[0,1], query token=[1,1]
        m.q_proj.weight.copy_(torch.cat([torch.diag(torch.tensor([1.0, 0.0])),
                                         torch.diag(torch.tensor([0.0, 1.0])), eye]))
        m.k_proj.weight.copy_(torch.cat([4 * eye] * 3))  # keys 4 * input
        m.v_proj.weight.copy_(torch.cat([eye] * 3))  # values = input
        m.o_proj.weight.copy_(torch.cat([eye] * 3, dim=1))  # sum of the head outputs
    assert m.scale == pytest.approx(1 / math.sqrt(2))
    x = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])  # (1, 4, 2)
    attn_mask = torch.ones(4, 4, dtype=torch.bool)
    attn_mask[3] = torch.tensor([True, True, True, False])
    zs = []
    m.z.register_forward_hook(lambda mod, inp, out: zs.append(out.detach()))
    _, w = m(x, attn_mask=attn_mask, need_weights=True)
    z = zs[0][0, 3]  # (H, D) at the query token

    expected_w = torch.tensor([[0.89, 0.05, 0.05], [0.05, 0.05, 0.89], [0.49, 0.03, 0.49]])
    expected_z = torch.tensor([[0.89, 0.05], [0.05, 0.89], [0.49, 0.49]])
    assert_close(torch.round(w[0, :, 3, :3], decimals=2), expected_w, rtol=0, atol=1e-6)
    assert_close(w[0, :, 3, 3], torch.zeros(3), rtol=0, atol=0)
    assert_close(torch.round(z, decimals=2), expected_z, rtol=0, atol=1e-6)
    # the block output (W_O sums the heads) on both paths, one head switched on at a time
    for h in range(3):
        m.set_gates([float(h == i) for i in range(3)])
        for path in PATHS:
            out, _ = call(m, x, path, attn_mask=attn_mask)
            assert_close(torch.round(out[0, 3], decimals=2), expected_z[h], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_weights_rows_sum_to_one_and_respect_the_mask(kind):
    B, S = 2, 6
    m = make_mha(layout="gqa")
    kw, allowed, bias = mask_case(kind, B, 4, S, F32)
    allowed = allowed & (bias > float("-inf"))
    _, w = m(torch.randn(B, S, 8), need_weights=True, **kw)
    row_has_key = allowed.any(-1)
    assert_close(w.sum(-1), row_has_key.to(w.dtype), rtol=0, atol=1e-6)
    assert_close(w.masked_fill(allowed, 0.0), torch.zeros_like(w), rtol=0, atol=0)


def test_apply_rotary_matches_plain_rotation():
    B, H, S, D = 2, 3, 5, 6
    x = torch.randn(B, H, S, D, dtype=F64)
    (cos, sin), angles = rotary_tables(S, D, F64, offset=4)
    got = apply_rotary(x, cos, sin)
    want = torch.stack([torch.stack([rotate_plain(x[b, h], angles) for h in range(H)])
                        for b in range(B)])
    assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert_close(got.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)  # a rotation


# ---------------------------------------------------------------------------- references
@pytest.mark.parametrize("head_dim", [None, 6], ids=["D=E/H", "D=6"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_matches_float64_reference(kind, layout, head_dim):
    B, S = 2, 6
    m = make_mha(layout=layout, head_dim=head_dim, dtype=F64)
    x = torch.randn(B, S, 8, dtype=F64)
    kw, allowed, bias = mask_case(kind, B, m.n_heads, S, F64)
    want_out, want_w = reference(m, x, allowed, bias)
    for path in PATHS:
        out, w = call(m, x, path, **kw)
        assert_close(out, want_out, rtol=1e-10, atol=1e-10)
        if w is not None:
            assert_close(w, want_w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("head_dim", [None, 6], ids=["D=E/H", "D=6"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["none", "causal+key_padding"])
def test_rotary_matches_float64_reference(kind, layout, head_dim):
    B, S = 2, 6
    m = make_mha(layout=layout, head_dim=head_dim, dtype=F64)
    x = torch.randn(B, S, 8, dtype=F64)
    kw, allowed, bias = mask_case(kind, B, m.n_heads, S, F64)
    rotary, angles = rotary_tables(S, m.head_dim, F64)
    want_out, want_w = reference(m, x, allowed, bias, angles)
    for path in PATHS:
        out, w = call(m, x, path, rotary=rotary, **kw)
        assert_close(out, want_out, rtol=1e-10, atol=1e-10)
        if w is not None:
            assert_close(w, want_w, rtol=1e-10, atol=1e-10)


def test_prebuilt_mask_equals_mask_arguments():
    B, S = 2, 6
    m = make_mha(layout="gqa")
    x = torch.randn(B, S, 8)
    kw, _, _ = mask_case("causal+window+bool+additive+key_padding", B, 4, S, F32)
    mask = Mask.build(batch=B, q_len=S, k_len=S, **kw)
    for path in PATHS:
        want, want_w = call(m, x, path, **kw)
        got, got_w = call(m, x, path, mask=mask)
        assert_close(got, want, rtol=0, atol=0)
        if want_w is not None:
            assert_close(got_w, want_w, rtol=0, atol=0)


# ---------------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_fast_path_equals_eager_path(kind, layout):
    B, S = 2, 7
    m = make_mha(layout=layout)
    x = torch.randn(B, S, 8)
    kw, _, _ = mask_case(kind, B, m.n_heads, S, F32)
    fast = m(x, **kw)
    eager, _ = m(x, need_weights=True, **kw)
    assert_close(fast, eager, rtol=1e-6, atol=1e-6)


def test_pattern_hook_switches_to_eager_and_sees_the_weights():
    B, S = 2, 5
    m = make_mha(layout="gqa")
    x = torch.randn(B, S, 8)
    seen = {}
    for name in ("q", "k", "v", "scores", "pattern", "z", "out"):
        getattr(m, name).register_forward_hook(
            lambda mod, inp, out, name=name: seen.__setitem__(name, out.detach())
        )
    want_out, want_w = m(x, causal=True, need_weights=True)
    seen_w = seen["pattern"]
    out = m(x, causal=True)  # no need_weights: the hooks alone must run the eager path
    assert_close(out, want_out, rtol=0, atol=0)
    assert_close(seen["pattern"], want_w, rtol=0, atol=0)
    assert_close(seen_w, want_w, rtol=0, atol=0)
    shapes = {name: tuple(t.shape) for name, t in seen.items()}
    assert shapes == {
        "q": (B, S, 4, 2), "k": (B, S, 2, 2), "v": (B, S, 2, 2), "scores": (B, 4, S, S),
        "pattern": (B, 4, S, S), "z": (B, S, 4, 2), "out": (B, S, 8),
    }
    assert seen["scores"].dtype == seen["pattern"].dtype == F32
    assert torch.isinf(seen["scores"][0, 0].triu(1)[0, 1:]).all()  # masked scores are -inf


def test_z_hook_that_zeroes_a_head_equals_gate_zero():
    m = make_mha(layout="gqa")
    x = torch.randn(2, 5, 8)
    gated = copy.deepcopy(m)
    gated.set_gates([1.0, 0.0, 1.0, 1.0])

    def zero_head_1(mod, inp, out):
        out = out.clone()
        out[:, :, 1] = 0
        return out

    m.z.register_forward_hook(zero_head_1)
    assert_close(m(x, causal=True), gated(x, causal=True), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["gqa", "mqa"])
def test_gqa_equals_mha_with_repeated_kv_heads(layout):
    m = make_mha(layout=layout, dtype=F64)
    H, H_kv, D = m.n_heads, m.n_kv_heads, m.head_dim
    full = MultiHeadAttention(d_model=8, n_heads=H).to(F64).eval()
    with torch.no_grad():
        for src, dst in ((m.k_proj, full.k_proj), (m.v_proj, full.v_proj)):
            w = src.weight.view(H_kv, D, 8).repeat_interleave(H // H_kv, dim=0)
            dst.weight.copy_(w.reshape(H * D, 8))
            dst.bias.copy_(src.bias.view(H_kv, D).repeat_interleave(H // H_kv, 0).reshape(-1))
        for src, dst in ((m.q_proj, full.q_proj), (m.o_proj, full.o_proj)):
            dst.load_state_dict(src.state_dict())
    x = torch.randn(2, 6, 8, dtype=F64)
    kw, _, _ = mask_case("causal+window+bool+additive+key_padding", 2, H, 6, F64)
    for path in PATHS:
        got, got_w = call(m, x, path, **kw)
        want, want_w = call(full, x, path, **kw)
        assert_close(got, want, rtol=1e-12, atol=1e-12)
        if got_w is not None:
            assert_close(got_w, want_w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["mha", "gqa"])
@pytest.mark.parametrize("path", PATHS)
def test_causal_change_at_j_leaves_earlier_positions_alone(path, layout):
    """A wrong reshape/transpose (view(B, H, S, D) of a (B, S, H*D) tensor) mixes
    positions; then a later token would leak into earlier outputs."""
    B, S = 2, 8
    m = make_mha(layout=layout)
    x = torch.randn(B, S, 8)
    base, _ = call(m, x, path, causal=True)
    for j in (1, 4, 7):
        x2 = x.clone()
        x2[:, j] += torch.randn(B, 8)
        out, _ = call(m, x2, path, causal=True)
        assert_close(out[:, :j], base[:, :j], rtol=1e-6, atol=1e-6)
        assert (out[:, j] - base[:, j]).abs().amax() > 1e-3


@pytest.mark.parametrize("layout", ["mha", "gqa"])
@pytest.mark.parametrize("path", PATHS)
def test_permuting_heads_permutes_z_and_keeps_output(path, layout):
    h, h_kv = {"mha": (4, 4), "gqa": (6, 2)}[layout]
    torch.manual_seed(0)
    m = MultiHeadAttention(d_model=12, n_heads=h, n_kv_heads=h_kv).eval()
    D, group = m.head_dim, h // h_kv
    kv_perm = torch.randperm(h_kv)
    # query heads move with their group, and are also shuffled inside it
    perm = torch.cat([kv_perm[g] * group + torch.randperm(group) for g in range(h_kv)])

    def rows(p):  # feature indices of heads p, in order
        return (p[:, None] * D + torch.arange(D)).reshape(-1)

    pm = copy.deepcopy(m)
    with torch.no_grad():
        for lin, p in ((pm.q_proj, perm), (pm.k_proj, kv_perm), (pm.v_proj, kv_perm)):
            lin.weight.copy_(lin.weight[rows(p)])
            lin.bias.copy_(lin.bias[rows(p)])
        pm.o_proj.weight.copy_(pm.o_proj.weight[:, rows(perm)])
    zs = {}
    m.z.register_forward_hook(lambda mod, i, o: zs.__setitem__("m", o.detach()))
    pm.z.register_forward_hook(lambda mod, i, o: zs.__setitem__("pm", o.detach()))
    x = torch.randn(2, 6, 12)
    kw, _, _ = mask_case("causal+key_padding", 2, h, 6, F32)
    out, w = call(m, x, path, **kw)
    pout, pw = call(pm, x, path, **kw)
    assert_close(zs["pm"], zs["m"][:, :, perm], rtol=1e-6, atol=1e-6)
    assert_close(pout, out, rtol=1e-5, atol=1e-6)
    if w is not None:
        assert_close(pw, w[:, perm], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- fully masked rows
def fully_masked_case(case: str, S: int):
    """Module kwargs for B = 2 examples, and the (b, s) query rows left with no key."""
    if case == "key_padding":
        kpm = torch.tensor([[True] * S, [False] * S])
        return {"key_padding_mask": kpm}, [(1, s) for s in range(S)]
    if case == "bool":
        allowed = torch.ones(S, S, dtype=torch.bool)
        allowed[2] = False
        return {"attn_mask": allowed}, [(0, 2), (1, 2)]
    if case == "additive":
        additive = torch.zeros(S, S)
        additive[3] = float("-inf")
        return {"attn_mask": additive}, [(0, 3), (1, 3)]
    # causal with left padding: the first two queries of example 0 see only padding
    kpm = torch.ones(2, S, dtype=torch.bool)
    kpm[0, :2] = False
    return {"causal": True, "key_padding_mask": kpm}, [(0, 0), (0, 1)]


@pytest.mark.parametrize("layout", ["mha", "gqa"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["key_padding", "bool", "additive", "causal+left_padding"])
def test_fully_masked_rows_give_zeros_and_finite_grads(case, path, layout):
    S = 5
    m = make_mha(layout=layout, out_bias=False)
    kw, dead = fully_masked_case(case, S)
    x = torch.randn(2, S, 8, requires_grad=True)
    out, w = call(m, x, path, **kw)
    live = torch.ones(2, S, dtype=torch.bool)
    for b, s in dead:
        live[b, s] = False
    assert torch.isfinite(out).all()
    assert_close(out[~live], torch.zeros_like(out[~live]), rtol=0, atol=0)
    assert out[live].abs().amax() > 1e-3  # the other rows are real outputs
    if w is not None:
        assert torch.isfinite(w).all()
        dead_w = w.transpose(1, 2)[~live]  # (n_dead, H, T)
        assert_close(dead_w, torch.zeros_like(dead_w), rtol=0, atol=0)
    loss = (out * torch.randn_like(out)).sum() + (0 if w is None else w.sum())
    loss.backward()
    assert torch.isfinite(x.grad).all()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


# ---------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["causal+key_padding", "additive_4d", "window"])
def test_half_precision_close_to_float32(kind, path, dtype):
    """Against float32 on the same (rounded) weights and inputs: only the arithmetic
    differs, so the gap is the low-precision computation itself."""
    B, S = 2, 7
    low = make_mha(layout="gqa", d_model=16).to(dtype)
    ref = copy.deepcopy(low).float()
    x = torch.randn(B, S, 16).to(dtype)
    kw, _, _ = mask_case(kind, B, 4, S, dtype)
    out, w = call(low, x, path, **kw)
    kw32 = {k: (v.float() if torch.is_floating_point(v) else v) if torch.is_tensor(v) else v
            for k, v in kw.items()}
    want, want_w = call(ref, x.float(), path, **kw32)
    assert out.dtype == dtype
    tol = 1e-2 * want.abs().amax().item()
    assert_close(out.float(), want, rtol=1e-2, atol=tol)
    if w is not None:
        assert w.dtype == F32  # softmax in float32 whatever the input dtype
        assert_close(w, want_w, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------- gates
def _loss(m, x, r, path, **kw):
    out, _ = call(m, x, path, **kw)
    return (out * r).sum()


@pytest.mark.parametrize("layout", ["mha", "gqa"])
@pytest.mark.parametrize("path", PATHS)
def test_gate_gradient_equals_finite_differences(path, layout):
    m = make_mha(layout=layout, dtype=F64)
    x = torch.randn(2, 6, 8, dtype=F64)
    r = torch.randn(2, 6, 8, dtype=F64)
    kw, _, _ = mask_case("causal+key_padding", 2, 4, 6, F64)
    gate = torch.tensor([0.3, 1.0, 0.0, 1.7], dtype=F64)
    m.gate_override = gate.clone().requires_grad_()
    _loss(m, x, r, path, **kw).backward()
    grad = m.gate_override.grad

    eps = 1e-6
    fd = torch.zeros(4, dtype=F64)
    with torch.no_grad():
        for h in range(4):
            up, down = gate.clone(), gate.clone()
            up[h] += eps
            down[h] -= eps
            m.gate_override = up
            lu = _loss(m, x, r, path, **kw)
            m.gate_override = down
            ld = _loss(m, x, r, path, **kw)
            fd[h] = (lu - ld) / (2 * eps)
    assert fd.abs().amin() > 1e-3  # every head matters, so the check is not vacuous
    assert_close(grad, fd, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("layout", ["mha", "gqa"])
@pytest.mark.parametrize("path", PATHS)
def test_per_example_gates_give_per_example_gradients(path, layout):
    B, S = 3, 5
    m = make_mha(layout=layout, dtype=F64)
    x = torch.randn(B, S, 8, dtype=F64)
    r = torch.randn(B, S, 8, dtype=F64)
    kpm = torch.ones(B, S, dtype=torch.bool)
    kpm[1, -2:] = False
    gates = torch.rand(B, 4, dtype=F64) + 0.5
    m.gate_override = gates.clone().requires_grad_()
    out, _ = call(m, x, path, causal=True, key_padding_mask=kpm)
    (out * r).sum().backward()
    batched_grad = m.gate_override.grad
    for b in range(B):
        m.gate_override = gates[b].clone().requires_grad_()
        one, _ = call(m, x[b : b + 1], path, causal=True, key_padding_mask=kpm[b : b + 1])
        (one * r[b : b + 1]).sum().backward()
        assert_close(one[0], out[b].detach(), rtol=1e-12, atol=1e-12)
        assert_close(m.gate_override.grad, batched_grad[b], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_per_position_gates_act_on_their_position_only(path):
    """A (B, S, H) gate: position s of the output equals a run with (B, H) gates taken
    from position s, since the gate acts on each position's head outputs."""
    B, S = 2, 5
    m = make_mha(layout="gqa", dtype=F64)
    x = torch.randn(B, S, 8, dtype=F64)
    gates = torch.rand(B, S, 4, dtype=F64) * 2
    m.gate_override = gates
    out, _ = call(m, x, path, causal=True)
    for s in range(S):
        m.gate_override = gates[:, s]
        want, _ = call(m, x, path, causal=True)
        assert_close(out[:, s], want[:, s], rtol=1e-12, atol=1e-12)


def test_gate_override_equals_head_gate():
    m = make_mha(layout="gqa")
    x = torch.randn(2, 5, 8)
    gates = torch.tensor([0.0, 0.5, 1.0, 2.0])
    m.set_gates(gates)
    want = m(x, causal=True)
    m.set_gates(torch.ones(4))
    m.gate_override = gates
    assert_close(m(x, causal=True), want, rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_gates_at_one_are_bitwise_the_ungated_module(path):
    m = make_mha(layout="gqa")
    x = torch.randn(2, 6, 8)
    kw, _, _ = mask_case("causal+key_padding", 2, 4, 6, F32)
    want, _ = call(m, x, path, **kw)
    gated = copy.deepcopy(m)
    gated.set_gates(torch.ones(4))
    got, _ = call(gated, x, path, **kw)
    assert torch.equal(got, want)
    gated.set_gates(torch.full((4,), 0.5))
    half, _ = call(gated, x, path, **kw)
    assert not torch.equal(half, want)
    gated.set_gates(torch.ones(4))
    got, _ = call(gated, x, path, **kw)
    assert torch.equal(got, want)


def test_gate_change_is_never_missed():
    """Assigning a new gate tensor, in place or as a new buffer, is always seen, even
    when the new tensor lands at the address of a freed one."""
    m = make_mha(layout="gqa")
    x = torch.randn(2, 5, 8)
    ungated = m(x)
    bias_only = m.o_proj.bias.detach().expand(2, 5, 8)
    for _ in range(20):
        m.head_gate = torch.ones(4)
        assert_close(m(x), ungated, rtol=0, atol=0)
        m.head_gate = torch.ones(4)
        m.head_gate = torch.zeros(4)
        assert_close(m(x), bias_only, rtol=0, atol=1e-6)
        with torch.no_grad():
            m.head_gate.fill_(1.0)
        assert_close(m(x), ungated, rtol=0, atol=0)


def test_set_gates_checks_shape():
    m = make_mha()
    with pytest.raises(ValueError, match=r"gates must have shape \(4,\), got \(3,\)"):
        m.set_gates([1.0, 1.0, 1.0])


# ---------------------------------------------------------------------------- KV cache
CHUNKS = [5, 1, 7, 3, 9, 2, 13]  # sums to 40: past the cache's 16 -> 32 capacity steps


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("steps", ["token", "chunks"])
def test_cache_decoding_equals_full_forward(steps, layout, window):
    B, N = 2, sum(CHUNKS)
    m = make_mha(layout=layout)
    x = torch.randn(B, N, 8)
    full = m(x, causal=True, window=window)
    sizes = [1] * N if steps == "token" else CHUNKS
    cache, outs, start = KVCache(), [], 0
    for n in sizes:
        outs.append(m(x[:, start : start + n], causal=True, window=window, cache=cache))
        start += n
    assert cache.length == N
    assert_close(torch.cat(outs, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["gqa", "mqa"])
def test_cache_with_rotary_padding_and_weights_equals_full_forward(layout):
    """Eager path through the cache, with rotary at the right offsets and left padding."""
    B, N, D = 2, sum(CHUNKS), 2
    m = make_mha(layout=layout)
    x = torch.randn(B, N, 8)
    kpm = torch.ones(B, N, dtype=torch.bool)
    kpm[0, :3] = False
    rot, _ = rotary_tables(N, D, F32)
    full, full_w = m(x, causal=True, window=9, key_padding_mask=kpm, rotary=rot,
                     need_weights=True)
    cache, start = KVCache(), 0
    for n in CHUNKS:
        end = start + n
        out, w = m(x[:, start:end], causal=True, window=9, key_padding_mask=kpm[:, :end],
                   rotary=(rot[0][:, start:end], rot[1][:, start:end]), cache=cache,
                   need_weights=True)
        assert w.shape == (B, 4, n, end)
        assert_close(out, full[:, start:end], rtol=1e-5, atol=1e-5)
        assert_close(w, full_w[:, :, start:end, :end], rtol=1e-5, atol=1e-5)
        start = end


# ---------------------------------------------------------------------------- pruning
def _pruned_and_gated(layout: str, heads: list[int], d_model: int = 8):
    m = make_mha(layout=layout, d_model=d_model)
    gated = copy.deepcopy(m)
    gated.set_gates([0.0 if h in heads else 1.0 for h in range(m.n_heads)])
    m.prune_heads(heads)
    return m, gated


def _assert_same(pruned, gated, kept, kind="causal+window+bool+additive+key_padding"):
    B, S = 2, 6
    x = torch.randn(B, S, gated.d_model)
    kw, _, _ = mask_case(kind, B, gated.n_heads, S, F32)
    pruned_kw = dict(kw)
    if kw.get("attn_mask") is not None and kw["attn_mask"].dim() == 4:  # per-head mask
        pruned_kw["attn_mask"] = kw["attn_mask"][:, kept]
    for path in PATHS:
        got, got_w = call(pruned, x, path, **pruned_kw)
        want, want_w = call(gated, x, path, **kw)
        assert_close(got, want, rtol=1e-6, atol=1e-6)
        if got_w is not None:
            assert_close(got_w, want_w[:, kept], rtol=1e-6, atol=1e-6)


def test_prune_mha_equals_gated():
    pruned, gated = _pruned_and_gated("mha", [1, 3])
    assert pruned.head_ids.tolist() == [0, 2]
    assert pruned.q_proj.out_features == pruned.k_proj.out_features == 2 * 2
    assert pruned.o_proj.in_features == 2 * 2
    _assert_same(pruned, gated, [0, 2])


def test_prune_full_gqa_group_removes_its_kv_head():
    # H = 4, H_kv = 2: heads 2, 3 share kv head 1
    pruned, gated = _pruned_and_gated("gqa", [2, 3])
    assert pruned.k_proj.out_features == pruned.v_proj.out_features == 1 * 2
    assert pruned.kv_head_ids.tolist() == [0]
    _assert_same(pruned, gated, [0, 1])


def test_prune_part_of_a_gqa_group_keeps_its_kv_head():
    # heads 0 | 2, 3 remain: uneven groups, the kv heads stay
    pruned, gated = _pruned_and_gated("gqa", [1])
    assert pruned.k_proj.out_features == 2 * 2
    assert pruned.kv_index.tolist() == [0, 1, 1]
    _assert_same(pruned, gated, [0, 2, 3])


def test_prune_mqa_equals_gated():
    pruned, gated = _pruned_and_gated("mqa", [0, 2])
    assert pruned.k_proj.out_features == 2
    _assert_same(pruned, gated, [1, 3])


def test_prune_in_two_steps_uses_original_indices():
    m = make_mha(layout="gqa")
    gated = copy.deepcopy(m)
    gated.set_gates([1.0, 0.0, 0.0, 1.0])
    m.prune_heads([1])
    m.prune_heads([1, 2])  # 1 already gone (ignored); 2 is the ORIGINAL head 2
    assert m.head_ids.tolist() == [0, 3]
    assert m.n_heads == 2 and m.n_kv_heads == 2
    _assert_same(m, gated, [0, 3])


def test_prune_keeps_the_gates_of_the_remaining_heads():
    m = make_mha(layout="gqa")
    m.set_gates([0.5, 2.0, 1.0, 0.25])
    gated = copy.deepcopy(m)
    gated.set_gates([0.5, 0.0, 1.0, 0.25])
    m.prune_heads([1])
    assert_close(m.head_gate, torch.tensor([0.5, 1.0, 0.25]), rtol=0, atol=0)
    _assert_same(m, gated, [0, 2, 3])


def test_kv_index_rebuilds_a_pruned_layout():
    """A module built with the pruned layout (as from a pruned checkpoint) equals the
    module pruned in place, once the state dict is loaded."""
    pruned, gated = _pruned_and_gated("gqa", [1])
    rebuilt = MultiHeadAttention(d_model=8, n_heads=3, n_kv_heads=2, head_dim=2,
                                 kv_index=[0, 1, 1]).eval()
    rebuilt.load_state_dict(pruned.state_dict())
    _assert_same(rebuilt, gated, [0, 2, 3])


def test_kv_index_must_cover_every_kv_head():
    message = r"kv_index must map each of the 3 query heads.*got \[0, 0, 0\]"
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(d_model=8, n_heads=3, n_kv_heads=2, head_dim=2, kv_index=[0, 0, 0])


@filter_zero_element_warning
def test_prune_all_heads_leaves_the_output_bias():
    m = make_mha(layout="gqa")
    gated = copy.deepcopy(m)
    gated.set_gates(torch.zeros(4))
    m.prune_heads(range(4))
    assert m.n_heads == 0 and m.n_kv_heads == 0
    B, S = 2, 5
    x = torch.randn(B, S, 8)
    want = m.o_proj.bias.detach().expand(B, S, 8)
    for path in PATHS:
        out, w = call(m, x, path, causal=True)
        assert_close(out, want, rtol=0, atol=0)
        assert_close(out, gated(x, causal=True), rtol=1e-6, atol=1e-6)
        if w is not None:
            assert w.shape == (B, 0, S, S)


def test_pruned_gqa_cache_decoding_equals_full_forward():
    m = make_mha(layout="gqa")
    m.prune_heads([1])  # uneven groups
    x = torch.randn(2, 20, 8)
    full = m(x, causal=True)
    cache = KVCache()
    steps = [m(x[:, i : i + 1], causal=True, cache=cache) for i in range(20)]
    assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [[4], [-1], [0, 7]])
def test_prune_bad_indices_name_the_range(bad):
    m = make_mha()
    with pytest.raises(ValueError, match=r"out of range.*4 heads \(original indices 0\.\.3\)"):
        m.prune_heads(bad)
    assert m.n_heads == 4  # nothing pruned
    m.prune_heads([0])
    with pytest.raises(ValueError, match=r"original indices 0\.\.3"):
        m.prune_heads(bad)


# ---------------------------------------------------------------------------- from_torch
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"add_bias_kv": True}, r"add_bias_kv"),
        ({"add_zero_attn": True}, r"add_zero_attn"),
        ({"kdim": 4, "vdim": 4}, r"kdim == vdim == embed_dim"),
    ],
)
def test_from_torch_rejects_unsupported_options(kw, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, **kw))


def test_from_torch_without_bias_has_no_bias():
    m = MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, bias=False))
    assert m.q_proj.bias is None and m.o_proj.bias is None
