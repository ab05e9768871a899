"""Tests for headlab.recovery: bias compensation, least-squares refits, the layer walk.

References: the ridge solve against float64 numpy.linalg.lstsq, on random problems and
on the activations the walk fitted (captured again through hooks). Invariants: the
error after a fit is never above the error before; nothing pruned, nothing changes; a
failed fit leaves the model as it came. Equivalences: bias compensation of heads with
constant output restores the layer exactly; a recovered model equals itself after
save -> load and after HF export. A sanity property: lsq brings held-out loss back.

Tiny random models from transformers configs, converted by headlab's own from_hf:
a Llama with GQA (6 query / 2 key-value heads, no biases), a GPT-2, a BERT encoder.
Shape notation: N tokens, P unknowns per output, E model dim, H heads, D head dim.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
import transformers
from scipy.sparse.linalg import lsmr
from torch.testing import assert_close

import headlab
from headlab.attention.hooks import capture
from headlab.data.blocks import Blocks
from headlab.errors import UserError
from headlab.evaluate.quality import evaluate
from headlab.models import bert, gpt2, llama
from headlab.models.base import Absent
from headlab.models.export import export_hf
from headlab.pruning import copy_model, prune
from headlab.recovery import (
    DEFAULT_RIDGE,
    RECOVERY_METHODS,
    RecoveryReport,
    recover,
    solve_ridge,
)
from headlab.recovery.lsq import DownProjection, NormalEquations
from headlab.schedule import prune_to_target
from headlab.selection import select

V = 96  # vocabulary
# each layer loses heads; layer 1 of the Llama loses a whole GQA group (heads 3, 4, 5)
LLAMA_PLAN = {0: [0, 4], 1: [3, 4, 5], 2: [1]}
GPT2_PLAN = {0: [1, 3], 1: [0], 2: [2, 3]}


def _llama(seed: int = 0, **kw) -> llama.Llama:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96,
                                   num_hidden_layers=3, num_attention_heads=6,
                                   num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, **kw)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    return llama.from_hf(cfg.to_dict(), hf.state_dict()).eval()


def _gpt2(seed: int = 0, **kw) -> gpt2.GPT2:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=3, n_head=4, n_embd=32, n_positions=64, vocab_size=V,
                                  **kw)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    return gpt2.from_hf(cfg.to_dict(), hf.state_dict()).eval()


def _bert(seed: int = 0) -> bert.Bert:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=64)
    hf = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    return bert.from_hf(cfg.to_dict(), hf.state_dict()).eval()


MODELS = {"llama": (_llama, LLAMA_PLAN), "gpt2": (_gpt2, GPT2_PLAN)}


def _blocks(n: int = 24, seq: int = 20, *, seed: int = 0, padded: bool = True) -> Blocks:
    """Random token blocks; with ``padded``, rows end in padding of random length."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, seq), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        lengths = torch.randint(seq // 2, seq + 1, (n,), generator=gen)
        mask = (torch.arange(seq)[None] < lengths[:, None]).long()
    return Blocks(ids, mask, spec="random")


def _pruned(reference, plan):
    model = copy_model(reference)
    model.prune_heads(plan)
    return model


def _logits(model, blocks: Blocks) -> torch.Tensor:
    with torch.no_grad():
        return model(blocks.input_ids, attention_mask=blocks.attention_mask).logits


def _layer_activations(pruned, reference, blocks, layer, batch_size=8):
    """What lsq fits at ``layer``, captured again through full forwards, over real tokens
    (float64): the attention's X = [z, 1] (N, H*D + 1) and Y = x_ref + attn_ref - x, the
    output that makes the pruned residual sum after attention the reference's (x, x_ref
    (N, E): the block inputs); the down projection's input A (N, F) and Y = mid_ref +
    mlp_ref - mid, the output that makes the sum after the MLP the reference's."""
    cols = {k: [] for k in ("x", "y", "act", "y_down")}
    for batch in blocks.batches(batch_size):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        seen = {}
        with _block_taps(pruned, layer, "p", seen), _block_taps(reference, layer, "r", seen), \
                torch.no_grad():
            pruned(ids, attention_mask=mask)
            reference(ids, attention_mask=mask)
        real = mask.bool()
        z = seen["p.z"][real]  # (N, H, D)
        cols["x"].append(torch.cat([z.reshape(len(z), -1), torch.ones(len(z), 1)], dim=1))
        cols["y"].append((seen["r.pre"] + seen["r.out"] - seen["p.pre"])[real])
        cols["act"].append(seen["p.act"][real])
        cols["y_down"].append((seen["r.mid"] + seen["r.mlp"] - seen["p.mid"])[real])
    return {k: torch.cat(v).double() for k, v in cols.items()}


@contextlib.contextmanager
def _block_taps(model, layer, tag, seen):
    """Keep block ``layer``'s input, z, attention output, residual after attention,
    MLP output and down-projection input as ``seen[f"{tag}.<name>"]``."""
    block = model.blocks[layer]
    down = block.mlp.get_submodule(model.mlp_down.split(".", 1)[1])
    handles = [
        block.mlp.register_forward_hook(lambda m, a, out: seen.__setitem__(f"{tag}.mlp", out)),
        down.register_forward_pre_hook(lambda m, a: seen.__setitem__(f"{tag}.act", a[0])),
    ]
    names = {"resid_pre": "pre", "attn.z": "z", "attn.out": "out", "resid_mid": "mid"}
    try:
        with capture(model, [f"blocks.{layer}.{n}" for n in names]) as cap:
            yield
        for n, short in names.items():
            seen[f"{tag}.{short}"] = cap[f"blocks.{layer}.{n}"]
    finally:
        for h in handles:
            h.remove()


def _relative(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


# ---------------------------------------------------------------------- the solve
@pytest.mark.parametrize("ridge", [0.0, 0.05])
def test_ridge_solve_equals_numpy_lstsq(ridge):
    gen = np.random.default_rng(0)
    x = gen.normal(size=(300, 12)) @ gen.normal(size=(12, 12))  # (N, P), correlated columns
    y = gen.normal(size=(300, 5))  # (N, E)
    w0 = gen.normal(size=(12, 5))
    eq = NormalEquations(12, 5, torch.device("cpu"))
    for rows in np.array_split(np.arange(300), 7):  # summed over uneven batches
        eq.add(torch.from_numpy(x[rows]), torch.from_numpy(y[rows]))
    ours = solve_ridge(eq.xtx, eq.xty, torch.from_numpy(w0), ridge).numpy()
    # the ridge problem as one stacked least-squares problem:
    # [X; sqrt(lam) I] W ~ [Y; sqrt(lam) W0], lam = ridge * mean(diag(X^T X))
    lam = ridge * np.mean(np.diag(x.T @ x))
    a = np.vstack([x, np.sqrt(lam) * np.eye(12)])
    b = np.vstack([y, np.sqrt(lam) * w0])
    expected = np.linalg.lstsq(a, b, rcond=None)[0]
    assert _relative(ours, expected) < 1e-8


@pytest.mark.parametrize("fast", [False, True])
def test_normal_equations_equal_numpy_sums(fast):
    """X^T X (symmetric, taken in column blocks at this width) and X^T Y over uneven
    batches against float64 numpy: exact to float64 rounding, or within float32's
    (relative 1e-6) with ``fast``, the rows coming in float32 as a model gives them.
    5000 rows: products over the 2048 rows gathered, and over what is left when read;
    rows added after a read are summed too."""
    gen = np.random.default_rng(2)
    x = (gen.normal(size=(5000, 300)) + 0.5).astype(np.float32)  # (N, P), a mean as in
    y = gen.normal(size=(5000, 7)).astype(np.float32)  # (N, E)    activations after GELU
    eq = NormalEquations(300, 7, torch.device("cpu"), fast=fast)
    tol = 1e-6 if fast else 1e-12
    for n, rows in enumerate(np.array_split(np.arange(5000), 13)):
        eq.add(torch.from_numpy(x[rows]), torch.from_numpy(y[rows]))
        if n in (3, 12):  # read mid-way, and at the end
            xd, yd = x[:rows[-1] + 1].astype(np.float64), y[:rows[-1] + 1].astype(np.float64)
            assert torch.equal(eq.xtx, eq.xtx.T)
            assert _relative(eq.xtx.numpy(), xd.T @ xd) < tol
            assert _relative(eq.xty.numpy(), xd.T @ yd) < tol
            assert eq.rows == rows[-1] + 1


@pytest.mark.parametrize("fast", [False, True])
def test_sum_of_squared_errors_from_the_sums_equals_numpy(fast):
    """`NormalEquations.sse(W)` = ||X W - Y||^2 from X^T X, X^T Y and ||Y||^2, against
    float64 numpy, for W near the fit, where the error is 1% of ||Y||^2 and the three
    terms cancel to it: relative 1e-4 with float32 products, 1e-9 without."""
    gen = np.random.default_rng(3)
    x = (gen.normal(size=(3000, 200)) + 0.3).astype(np.float32)  # (N, P)
    w_true = gen.normal(size=(200, 9)) / 14
    y = (x @ w_true + 0.1 * gen.normal(size=(3000, 9))).astype(np.float32)  # (N, E)
    eq = NormalEquations(200, 9, torch.device("cpu"), fast=fast)
    for rows in np.array_split(np.arange(3000), 5):
        eq.add(torch.from_numpy(x[rows]), torch.from_numpy(y[rows]))
    w = w_true + 0.001 * gen.normal(size=w_true.shape)
    xd, yd = x.astype(np.float64), y.astype(np.float64)
    expected = float(np.square(xd @ w - yd).sum())
    assert 0.005 < expected / float(np.square(yd).sum()) < 0.05
    assert eq.sse(torch.from_numpy(w)) == pytest.approx(expected, rel=1e-4 if fast else 1e-9)


def test_rank_deficient_ridge_zero_falls_back_to_least_squares():
    gen = np.random.default_rng(1)
    x = gen.normal(size=(100, 6))
    x = np.hstack([x, x[:, :2]])  # two repeated columns: X^T X is singular
    y = gen.normal(size=(100, 3))
    xt = torch.from_numpy(x)
    ours = solve_ridge(xt.T @ xt, xt.T @ torch.from_numpy(y), torch.zeros(8, 3), 0.0).numpy()
    # any least-squares solution has the same fitted values
    expected = np.linalg.lstsq(x, y, rcond=None)[0]
    assert _relative(x @ ours, x @ expected) < 1e-8


@pytest.mark.parametrize("family", sorted(MODELS))
def test_lsq_fits_equal_numpy_lstsq_on_the_activations_they_saw(family):
    """Each layer's W_O and bias are numpy's lstsq of Y on X = [z, 1], and its MLP down
    projection (and bias, GPT-2's) numpy's lstsq of the MLP's target on its inputs, with
    X from the pruned model after its earlier layers (and this layer's attention) were
    repaired and Y from the reference (see `_layer_activations`)."""
    build, plan = MODELS[family]
    reference, blocks = build(), _blocks()
    model = _pruned(reference, plan)
    recover(model, reference, blocks, method="lsq", ridge=0.0)
    for layer, attn in enumerate(model.attentions):
        # z of layer i depends on the repaired layers < i and on its own Q, K, V only
        fit = _layer_activations(model, reference, blocks, layer)
        x, y = fit["x"], fit["y"]
        assert x.shape[0] > x.shape[1]  # full rank: more tokens than unknowns
        expected = np.linalg.lstsq(x.numpy(), y.numpy(), rcond=None)[0]  # (H*D + 1, E)
        eq = NormalEquations(x.shape[1], y.shape[1], torch.device("cpu"))
        for part in range(0, len(x), 50):
            eq.add(x[part:part + 50], y[part:part + 50])
        solved = solve_ridge(eq.xtx, eq.xty, torch.zeros(x.shape[1], y.shape[1]), 0.0)
        assert _relative(solved.numpy(), expected) < 1e-8
        # the model holds it in float32
        written = torch.cat([attn.o_proj.weight.T, attn.o_proj.bias[None]]).double()
        assert _relative(written.detach().numpy(), expected) < 1e-5

        down = model.blocks[layer].mlp.get_submodule(model.mlp_down.split(".", 1)[1])
        act = fit["act"]
        if down.bias is not None:
            act = torch.cat([act, torch.ones(len(act), 1, dtype=act.dtype)], dim=1)
        assert act.shape[0] > act.shape[1]
        expected = np.linalg.lstsq(act.numpy(), fit["y_down"].numpy(), rcond=None)[0]
        written = down.weight.T if down.bias is None else torch.cat(
            [down.weight.T, down.bias[None]])
        assert _relative(written.detach().double().numpy(), expected) < 1e-5


def _ridge_numpy(x: np.ndarray, y: np.ndarray, w0: np.ndarray, ridge: float) -> np.ndarray:
    """The ridge problem as one stacked float64 least-squares problem:
    [X; sqrt(lam) I] W ~ [Y; sqrt(lam) W0], lam = ridge * mean(diag(X^T X))."""
    lam = ridge * np.mean(np.sum(x * x, axis=0))
    a = np.vstack([x, np.sqrt(lam) * np.eye(x.shape[1])])
    b = np.vstack([y, np.sqrt(lam) * w0])
    return np.linalg.lstsq(a, b, rcond=None)[0]


@pytest.mark.parametrize("family", sorted(MODELS))
def test_lsq_at_the_default_ridge_equals_float64_numpy(family):
    """The default (ridge) lsq takes each batch's X^T X in float32 (`NormalEquations`):
    its W_O and down projection stay within 2e-6 (relative; float32 storage alone
    gives ~1e-7, float32 sums ~4e-7) of float64 numpy's ridge solution on the same
    activations, X from the repaired pruned model as above."""
    build, plan = MODELS[family]
    reference, blocks = build(), _blocks()
    model = _pruned(reference, plan)
    originals = copy_model(model)
    recover(model, reference, blocks, method="lsq")
    for layer, attn in enumerate(model.attentions):
        fit = _layer_activations(model, reference, blocks, layer)
        lin = originals.attentions[layer].o_proj
        bias = torch.zeros(lin.weight.shape[0]) if lin.bias is None else lin.bias
        w0 = torch.cat([lin.weight.T, bias[None]]).double().detach().numpy()
        expected = _ridge_numpy(fit["x"].numpy(), fit["y"].numpy(), w0, DEFAULT_RIDGE)
        written = torch.cat([attn.o_proj.weight.T, attn.o_proj.bias[None]]).double()
        assert _relative(written.detach().numpy(), expected) < 2e-6

        path = model.mlp_down.split(".", 1)[1]
        down = model.blocks[layer].mlp.get_submodule(path)
        old = originals.blocks[layer].mlp.get_submodule(path)
        act, w0 = fit["act"], old.weight.T
        if down.bias is not None:
            act = torch.cat([act, torch.ones(len(act), 1, dtype=act.dtype)], dim=1)
            w0 = torch.cat([w0, old.bias[None]])
        expected = _ridge_numpy(act.numpy(), fit["y_down"].numpy(),
                                w0.double().detach().numpy(), DEFAULT_RIDGE)
        written = down.weight.T if down.bias is None else torch.cat(
            [down.weight.T, down.bias[None]])
        assert _relative(written.detach().double().numpy(), expected) < 2e-6


def _kwon_scales(a: np.ndarray, b: np.ndarray, constant: bool) -> np.ndarray:
    """Kwon et al.'s scales from their design matrix A (N*E, K) and target vec B (N*E,),
    float64: a constant column appended (attention), the normal equations G = A^T A,
    r = A^T B, then their lsmr_cupy_solver (utils/linalg.py) as written, scipy's lsmr in
    place of cupyx's port of it: lsmr(G, r - G 1, damp=1), scales 1 + x, the constant's
    dropped; None where it reports failure (istop 3 and up), which stops their loop."""
    if constant:
        a = np.concatenate([a, np.ones((len(a), 1))], axis=1)
    g, r = a.T @ a, a.T @ b
    x, istop = lsmr(g, r - g.sum(1), damp=1)[:2]
    if istop >= 3:
        return None
    return (1 + x)[:-1] if constant else 1 + x


@pytest.mark.parametrize("family", sorted(MODELS))
def test_rescale_equals_kwons_equations_in_numpy(family):
    """rescale's head scales (layers after 0) and neuron scales (every layer) are Kwon
    et al.'s: the residual target Y - b, one constant column for attention, fitted on
    the pruned stream its earlier layers (and, for the MLP, this layer's attention)
    already rescaled, from the activations captured again (`_layer_activations`), and
    solved by their solver; from the first solve it reports failed on, nothing moves."""
    build, plan = MODELS[family]
    # weights large enough that the normal equations outweigh LSMR's damping 1 (at the
    # default init the scales stay within 1e-5 of 1)
    reference, blocks = build(initializer_range=0.1), _blocks(48)
    model, original = _pruned(reference, plan), _pruned(reference, plan)
    report = recover(model, reference, blocks, method="rescale")
    D = model.head_dim
    fitted, stopped, stopped_at = [], False, None
    for layer, attn in enumerate(model.attentions):
        fit = _layer_activations(model, reference, blocks, layer)
        old = original.attentions[layer].o_proj
        w = old.weight.detach().double()  # (E, H*D)
        E, H = w.shape[0], attn.n_heads
        new = attn.o_proj.weight.detach().double().view(E, H, D)
        b = (torch.zeros(E, dtype=torch.float64) if old.bias is None
             else old.bias.detach().double())
        if layer > 0 and not stopped:  # Kwon et al.: layer_idx != 0
            z = fit["x"][:, :-1].view(-1, H, D)  # (N, H, D)
            p = torch.einsum("nhd,ehd->hne", z, w.view(E, H, D)).reshape(H, -1)
            target = (fit["y"] - b).reshape(-1).numpy()  # (N*E,)
            expected = _kwon_scales(p.T.numpy(), target, constant=True)  # (H,)
            stopped = expected is None
            stopped_at = f"layer {layer}'s attention" if stopped else None
        if layer == 0 or stopped:
            assert torch.equal(new, w.view(E, H, D))
        else:
            ours = (new / w.view(E, H, D)).mean((0, 2)).numpy()
            assert_close(new, w.view(E, H, D) * torch.from_numpy(ours)[None, :, None],
                         rtol=1e-6, atol=0)  # one scale per head
            assert np.abs(ours - expected).max() < 1e-5
            fitted.append(np.abs(expected - 1).max())
        assert (attn.o_proj.bias is None) == (old.bias is None)  # the bias stays

        down = model.blocks[layer].mlp.get_submodule(model.mlp_down.split(".", 1)[1])
        old_down = original.blocks[layer].mlp.get_submodule(model.mlp_down.split(".", 1)[1])
        wd = old_down.weight.detach().double()  # (E, F)
        if not stopped:
            bd = (torch.zeros(E, dtype=torch.float64) if old_down.bias is None
                  else old_down.bias.detach().double())
            act = fit["act"]  # (N, F)
            p = (act[:, :, None] * wd.T[None]).permute(1, 0, 2).reshape(act.shape[1], -1)
            expected = _kwon_scales(p.T.numpy(), (fit["y_down"] - bd).reshape(-1).numpy(),
                                    constant=False)  # (F,)
            stopped = expected is None
            stopped_at = f"layer {layer}'s MLP" if stopped else None
        if stopped:
            assert torch.equal(down.weight.detach().double(), wd)
        else:
            ours = (down.weight.detach().double() / wd).mean(0).numpy()
            assert np.abs(ours - expected).max() < 1e-5
            fitted.append(np.abs(expected - 1).max())
    assert fitted and max(fitted) > 1e-3  # some fit moved its scales
    halted = [n for n in report.notes if n.startswith("rescale stopped")]
    if stopped_at is None:
        assert not halted
    else:  # the report says where, and LSMR's reason
        assert len(halted) == 1
        assert halted[0].startswith(f"rescale stopped at {stopped_at}: ")
        assert "istop" in halted[0]


def test_rescale_head_system_is_kwons_normal_equations(monkeypatch):
    """The system one layer's head scales are solved from, built from X^T X, X^T Y and
    W_O, is Kwon's: G = A^T A and r = A^T vec(Y - b) for A = [vec z_h W_h^T, ..., 1]
    (N*E, H + 1), in float64 numpy; the solver's answer is folded into W_O's columns."""
    from headlab.recovery import rescale

    model = _pruned(_llama(initializer_range=0.1), LLAMA_PLAN)
    attn = model.attentions[1]
    gen = torch.Generator().manual_seed(0)
    H, D, E = attn.n_heads, attn.head_dim, attn.d_model
    z, y = torch.randn(60, H, D, generator=gen), torch.randn(60, E, generator=gen)
    seen = {}

    def solver(gram, rhs):
        seen.update(gram=gram, rhs=rhs)
        return torch.linspace(0.5, 1.5, H + 1, dtype=torch.float64)

    monkeypatch.setattr(rescale, "damped_scales", solver)
    fit = rescale.Rescale(1, attn, rescale.Stop())
    fit.pruned(z[:25], y[:25])
    fit.pruned(z[25:], y[25:])
    w_new, bias = fit.solve()
    w = attn.o_proj.weight.detach().double().numpy().reshape(E, H, D)
    b = (np.zeros(E) if attn.o_proj.bias is None
         else attn.o_proj.bias.detach().double().numpy())
    per_head = np.einsum("nhd,ehd->hne", z.double().numpy(), w).reshape(H, -1)  # (H, N*E)
    a = np.concatenate([per_head.T, np.ones((per_head.shape[1], 1))], axis=1)
    target = (y.double().numpy() - b).reshape(-1)
    np.testing.assert_allclose(seen["gram"].numpy(), a.T @ a, rtol=1e-9)
    np.testing.assert_allclose(seen["rhs"].numpy(), a.T @ target, rtol=1e-9, atol=1e-9)
    scales = np.linspace(0.5, 1.5, H + 1)[:H]  # the constant's dropped
    np.testing.assert_allclose(w_new.numpy().reshape(E, H, D), w * scales[None, :, None],
                               rtol=1e-12)
    assert bias is None  # the bias stays


def test_rescale_stops_at_the_first_scale_out_of_bounds(monkeypatch):
    """As Kwon et al.'s loop breaks: once a solve gives a scale outside [-10, 10] (here
    layer 0's MLP, the first fit), no later sublayer is rescaled."""
    from headlab.recovery import rescale

    reference, blocks = _gpt2(initializer_range=0.1), _blocks(48)
    solve, calls, widest = rescale.damped_scales, [], []

    def first_out_of_bounds(gram, rhs):
        calls.append(len(rhs))
        scales = solve(gram, rhs)
        if len(calls) == 1:
            scales = scales * 11
            widest.append(float(scales.abs().max()))
        return scales

    monkeypatch.setattr(rescale, "damped_scales", first_out_of_bounds)
    model = _pruned(reference, GPT2_PLAN)
    report = recover(model, reference, blocks, method="rescale")
    assert calls == [model.blocks[0].mlp.proj.weight.shape[1]]  # then no more solves
    assert [n for n in report.notes if n.startswith("rescale")] == [
        f"rescale stopped at layer 0's MLP: a scale of {widest[0]:.3g} is outside "
        "[-10, 10]; as Kwon et al.'s loop breaks, it and every later sublayer were left "
        "as they were"]
    assert_close(_logits(model, blocks), _logits(_pruned(reference, GPT2_PLAN), blocks),
                 rtol=0, atol=0)
    monkeypatch.setattr(rescale, "damped_scales", solve)
    recover(model, reference, blocks, method="rescale")  # without: later layers move
    assert not torch.equal(_logits(model, blocks),
                           _logits(_pruned(reference, GPT2_PLAN), blocks))


# ---------------------------------------------------------------------- invariants
@pytest.mark.parametrize("method", ["lsq", "rescale"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_error_after_fit_never_above_before(family, method):
    build, plan = MODELS[family]
    reference, blocks = build(), _blocks()
    model = _pruned(reference, plan)
    report = recover(model, reference, blocks, method=method)
    assert [e.layer for e in report.layers] == [0, 1, 2]
    for e in report.layers:
        assert e.error_before > 0
        # float32 forwards measure both: a fit that changes nothing may differ by rounding
        assert e.error_after <= e.error_before + 1e-6
    if method == "lsq":  # 60+ tokens per unknown output row: with a light ridge, a real
        # improvement (the default ridge, tuned on held-out quality, pulls harder to W0)
        light = recover(_pruned(reference, plan), reference, blocks, method=method,
                        ridge=1e-2)
        assert all(e.error_after < 0.5 * e.error_before for e in light.layers)


def test_bert_encoder_walks_its_blocks():
    reference, blocks = _bert(), _blocks()
    model = _pruned(reference, {0: [0, 2], 1: [3]})
    report = recover(model, reference, blocks, method="lsq")
    for e in report.layers:
        assert e.error_after < e.error_before


@pytest.mark.parametrize("method", [m for m in RECOVERY_METHODS if m != "distill"])
def test_nothing_pruned_changes_no_output(method):
    reference, blocks = _llama(), _blocks()
    model = copy_model(reference)
    report = recover(model, reference, blocks, method=method)
    assert_close(_logits(model, blocks), _logits(reference, blocks), rtol=0, atol=1e-6)
    assert all(e.error_before == 0 and e.error_after == 0 for e in report.layers)


def test_bias_restores_a_layer_whose_removed_heads_are_constant():
    """With zero V weights and a constant V bias, a head outputs that constant at every
    position (attention weights sum to 1): its mean contribution is all it did."""
    reference, blocks = _gpt2(), _blocks()
    removed, D = GPT2_PLAN[0], reference.head_dim
    attn = reference.attentions[0]
    with torch.no_grad():
        for h in removed:
            attn.v_proj.weight[h * D:(h + 1) * D] = 0
            attn.v_proj.bias[h * D:(h + 1) * D] = torch.randn(D)
    model = _pruned(reference, GPT2_PLAN)
    report = recover(model, reference, blocks, method="bias")
    real = blocks.attention_mask.bool()
    with capture(model, "blocks.0.attn.out") as ours, \
            capture(reference, "blocks.0.attn.out") as ref, torch.no_grad():
        model(blocks.input_ids, attention_mask=blocks.attention_mask)
        reference(blocks.input_ids, attention_mask=blocks.attention_mask)
    assert_close(ours["blocks.0.attn.out"][real], ref["blocks.0.attn.out"][real],
                 rtol=0, atol=1e-5)
    assert report.layers[0].error_before > 1e-3 and report.layers[0].error_after < 1e-10


def test_bias_gives_a_llama_an_output_bias_only_where_heads_went():
    reference, blocks = _llama(), _blocks()
    model = _pruned(reference, {0: [1], 2: [0, 5]})
    before = _logits(model, blocks)
    recover(model, reference, blocks, method="bias")
    assert [a.o_proj.bias is not None for a in model.attentions] == [True, False, True]
    assert all(a.o_proj.bias is None for a in reference.attentions)
    assert not torch.allclose(_logits(model, blocks), before)


# ---------------------------------------------------------------------- save, load, export
@pytest.mark.parametrize("method", ["bias", "lsq"])
def test_recovered_llama_survives_save_and_load(method, tmp_path):
    reference, blocks = _llama(), _blocks()
    model = _pruned(reference, LLAMA_PLAN)
    recover(model, reference, blocks, method=method)
    model.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert meta["out_bias"] == [True, True, True]
    loaded = headlab.load(tmp_path / "m")
    assert_close(_logits(loaded, blocks), _logits(model, blocks), rtol=0, atol=1e-6)


def test_export_hf_of_recovered_llama_loads_in_transformers(tmp_path):
    reference, blocks = _llama(), _blocks()
    # whole GQA groups, the same count in every layer: expressible in an HF config
    model = _pruned(reference, {0: [3, 4, 5], 1: [0, 1, 2], 2: [3, 4, 5]})
    recover(model, reference, blocks, method="lsq")
    export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.attention_bias and hf.config.num_attention_heads == 3
    with torch.no_grad():
        theirs = hf(blocks.input_ids, attention_mask=blocks.attention_mask).logits
    real = blocks.attention_mask.bool()
    assert_close(theirs[real], _logits(model, blocks)[real], rtol=0, atol=1e-4)


def test_report_round_trips_through_json():
    reference, blocks = _gpt2(), _blocks()
    report = recover(_pruned(reference, GPT2_PLAN), reference, blocks, method="lsq")
    assert report.tokens == blocks.n_tokens and report.options == {"ridge": DEFAULT_RIDGE}
    again = RecoveryReport.from_json(json.loads(json.dumps(report.to_json())))
    assert again == report


# ---------------------------------------------------------------------- bad input
def test_unknown_method_names_the_choices():
    reference = _gpt2()
    with pytest.raises(UserError, match="lsq, rescale"):
        recover(_pruned(reference, GPT2_PLAN), reference, _blocks(), method="sgd")


def test_bad_arguments_are_user_errors():
    reference, blocks = _gpt2(), _blocks()
    model = _pruned(reference, GPT2_PLAN)
    with pytest.raises(UserError, match="ridge applies"):
        recover(model, reference, blocks, method="bias", ridge=0.1)
    with pytest.raises(UserError, match="ridge must be"):
        recover(model, reference, blocks, method="lsq", ridge=-1.0)
    with pytest.raises(UserError, match="takes no options"):
        recover(model, reference, blocks, method="lsq", steps=3)
    with pytest.raises(UserError, match="separate model"):
        recover(model, model, blocks, method="lsq")


def test_a_ridge_for_a_method_without_one_is_refused_before_the_run():
    from headlab.runs.config import RunConfig

    for method in ("lsq", "distill"):
        assert RunConfig(model="m", keep=0.5, recover=method, recover_ridge=0.1).validated()
    for method in ("rescale", "bias", "none"):
        with pytest.raises(UserError, match=rf"^--recover-ridge applies to lsq .*--recover "
                                            rf"{method}: drop it$"):
            RunConfig(model="m", keep=0.5, recover=method, recover_ridge=0.1).validated()
    with pytest.raises(UserError, match="ridge applies to lsq, not 'rescale'"):
        reference = _gpt2()
        recover(_pruned(reference, GPT2_PLAN), reference, _blocks(), method="rescale",
                ridge=0.1)


@pytest.mark.parametrize("method", ["bias", "lsq", "rescale"])
def test_nan_activations_name_the_layer_and_leave_the_model_unchanged(method):
    """A NaN in the reference's second input norm reaches layer 1's activations: the
    walk has already repaired layer 0 (its W_O and, lsq, its MLP's down projection)
    when layer 1's fit fails, and must put it back."""
    reference, blocks = _llama(), _blocks()
    model = _pruned(reference, LLAMA_PLAN)
    with torch.no_grad():
        reference.blocks[1].attn_norm.weight[0] = float("nan")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    projections = [a.o_proj for a in model.attentions] + [b.mlp.down_proj for b in model.blocks]
    with pytest.raises(UserError, match="layer 1"):
        recover(model, reference, blocks, method=method)
    assert [a.o_proj for a in model.attentions] + [b.mlp.down_proj
                                                   for b in model.blocks] == projections
    after = model.state_dict()
    assert sorted(after) == sorted(state)
    for k, v in state.items():
        assert torch.equal(after[k], v), k


# ---------------------------------------------------------------------- held-out quality
def _sampled(model, n: int, seq: int, seed: int, vocab: int = V) -> Blocks:
    """Text the reference model writes itself: its loss is its entropy, and any other
    model's exceeds it by the KL divergence, so held-out loss measures closeness."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, 1), generator=gen)
    with torch.no_grad():
        for _ in range(seq - 1):
            probs = model(ids).logits[:, -1].softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return Blocks(ids, torch.ones_like(ids), spec="sampled")


def test_lsq_lowers_held_out_loss_of_a_pruned_model():
    # larger weights than the default init: predictions peaked enough to lose by pruning
    reference = _llama(initializer_range=0.1)
    scoring, heldout = _sampled(reference, 48, 24, 0), _sampled(reference, 48, 24, 1)
    plan = {0: [1, 4], 1: [2, 5], 2: [1, 3]}
    base = evaluate(reference, heldout).loss
    losses = {}
    for method in ("none", "lsq"):
        model = _pruned(reference, plan)
        recover(model, reference, scoring, method=method)
        losses[method] = evaluate(model, heldout).loss
    assert losses["none"] > base
    assert losses["lsq"] - base < 0.5 * (losses["none"] - base)


@pytest.mark.parametrize("seed", [1, 2])
def test_rescale_lowers_held_out_loss_of_a_pruned_model(seed):
    """With Kwon et al.'s residual target the rescaled model loses less than with no
    repair (a fit to the attention output alone does not, on these seeds)."""
    reference = _llama(seed, initializer_range=0.1)
    scoring, heldout = _sampled(reference, 48, 24, 0), _sampled(reference, 48, 24, 1)
    plan = {0: [1, 4], 1: [2, 5], 2: [1, 3]}
    base = evaluate(reference, heldout).loss
    lost = {}
    for method in ("none", "rescale"):
        model = _pruned(reference, plan)
        recover(model, reference, scoring, method=method)
        lost[method] = evaluate(model, heldout).loss - base
    assert lost["none"] > 0.1
    assert lost["rescale"] < 0.95 * lost["none"]


def test_distill_starts_from_lsq_and_reports_it():
    reference, blocks = _llama(), _blocks(padded=False)
    model = _pruned(reference, LLAMA_PLAN)
    report = recover(model, reference, blocks, method="distill", tokens=64, lr=1e-3)
    assert report.method == "distill" and report.options["start"] == "lsq"
    assert report.options["ridge"] == DEFAULT_RIDGE and report.tokens >= 64
    assert [e.layer for e in report.layers] == [0, 1, 2]
    assert all(a.o_proj.bias is not None for a in model.attentions)  # lsq gave biases
    json.dumps(report.to_json())


# ---------------------------------------------------------------------- after each step
def test_recovery_after_each_step_scores_and_measures_the_repaired_model():
    """With ``recover``, each step's quality is that of the pruned copy repaired toward
    the unpruned model, and the next step scores that copy: the first re-scoring
    equals michel on the copy repaired after step one, which differs from michel on the
    masked model; the last point is what prune, then recover of the plan give."""
    reference = _llama(initializer_range=0.1)
    scoring, heldout = _sampled(reference, 24, 16, 0), _sampled(reference, 24, 16, 1)
    # 18 heads -> 14 -> 10: two steps
    kw = dict(method="michel", n_keep=10, step=0.25, batch_size=8)
    plain = prune_to_target(reference, scoring, heldout, **kw)
    ours = prune_to_target(reference, scoring, heldout, recover="lsq", **kw)
    assert [p.heads_kept for p in ours.curve] == [18, 14, 10]
    assert ours.curve[0] == plain.curve[0]
    assert ours.step_scores[0].scores == plain.step_scores[0].scores

    first = _pruned(reference, select(ours.step_scores[0], 14).pruned)
    recover(first, reference, scoring, method="lsq")
    assert ours.curve[1].loss == pytest.approx(evaluate(first, heldout).loss, rel=1e-6)
    assert ours.curve[1].loss < plain.curve[1].loss
    rescored = headlab.score(first, scoring, method="michel", batch_size=8, seed=1).tensor()
    assert_close(ours.step_scores[1].tensor(), rescored, rtol=1e-6, atol=1e-9, equal_nan=True)
    masked = plain.step_scores[1].tensor()
    assert not torch.allclose(rescored.nan_to_num(), masked.nan_to_num(), rtol=1e-3)

    last = prune(copy_model(reference), ours.plan)
    recover(last, reference, scoring, method="lsq")
    assert ours.curve[-1].loss == pytest.approx(evaluate(last, heldout).loss, rel=1e-6)
    # the unpruned model is left as it came
    assert_close(_logits(reference, heldout), _logits(_llama(initializer_range=0.1), heldout),
                 rtol=0, atol=0)


def test_recovery_after_each_step_takes_a_training_free_method():
    reference, blocks = _llama(), _blocks()
    with pytest.raises(UserError, match="no training"):
        prune_to_target(reference, blocks, blocks, method="michel", n_keep=9, recover="distill")


# ---------------------------------------------------------------------- every family
# the shared decoder's families (tests/test_decoders.py's checkpoints: parallel residual,
# post-norms, fused projections) and ModernBERT (tests/_encoders.py): lsq refits W_O and
# the MLP's down projection in every block
LSQ_FAMILIES = ["qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "neox",
                "neox-sequential", "olmo2", "modernbert"]


def _family(case: str, directory):
    from tests._encoders import VOCAB, write_checkpoint
    from tests.test_decoders import _SMALL, _checkpoint

    if case == "modernbert":
        return headlab.load(write_checkpoint(directory, case, "encoder"), tokenizer=False), VOCAB
    return headlab.load(_checkpoint(directory, case), tokenizer=False), _SMALL["vocab_size"]


@pytest.mark.parametrize("case", LSQ_FAMILIES)
def test_lsq_refits_the_mlp_down_projection_of_every_family(case, tmp_path, monkeypatch):
    """Each layer's attention and MLP errors after the fit are never above before, and
    the MLP refit ran in every layer (its errors are in the report's JSON). The walk
    never runs the old down projection: the error before comes from the fit's sums,
    which here equal the old weights applied to the very rows the fit was shown
    (float64, relative 1e-4: the sums' products are float32)."""
    reference, vocab = _family(case, tmp_path)
    reference.eval()
    gen = torch.Generator().manual_seed(0)
    blocks = Blocks(torch.randint(0, vocab, (16, 12), generator=gen),
                    torch.ones(16, 12, dtype=torch.long), spec="random")
    model = _pruned(reference, {0: [0, 3], 1: [1]})
    down_before = [model.blocks[i].get_submodule(model.mlp_down).weight.detach().clone()
                   for i in range(model.n_layers)]
    from_sums = []
    add, error_before = DownProjection.add, DownProjection.error_before

    def keep(fit, act, y):
        fit.__dict__.setdefault("shown", []).append((act.double(), y.double()))
        add(fit, act, y)

    def checked(fit):
        w, b = fit.linear.weight.double(), fit.linear.bias
        direct = sum(float((a @ w.T + (0 if b is None else b.double()) - y).square().sum())
                     for a, y in fit.shown)
        from_sums.append((error_before(fit), direct))
        return from_sums[-1][0]

    monkeypatch.setattr(DownProjection, "add", keep)
    monkeypatch.setattr(DownProjection, "error_before", checked)
    report = recover(model, reference, blocks, method="lsq", ridge=1e-2)
    assert len(from_sums) == reference.n_layers
    for ours, direct in from_sums:
        assert ours == pytest.approx(direct, rel=1e-4)
    assert [e.layer for e in report.layers] == list(range(reference.n_layers))
    for e, layer in zip(report.to_json()["layers"], report.layers, strict=True):
        assert e["mlp_error_before"] is not None and e["mlp_error_after"] is not None
        assert layer.error_after <= layer.error_before + 1e-6
        assert layer.mlp_error_after <= layer.mlp_error_before + 1e-6
        assert layer.mlp_error_before > 0
    # the refit wrote new down projections
    for i, before in enumerate(down_before):
        assert not torch.equal(model.blocks[i].get_submodule(model.mlp_down).weight, before)
    assert report.notes == []


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "olmo2"])
def test_lsq_behind_post_norms_lowers_held_out_loss(case, tmp_path):
    """Gemma's and OLMo-2's sublayers reach the residual through a norm: the residual's
    drift is not a target in their projections' space, so lsq fits them to the
    reference's outputs and gives back a good part of what pruning lost (with the drift
    in the target, Gemma-2's lsq lost more than no repair and Gemma-3's 0.94 of it)."""
    reference, vocab = _family(case, tmp_path)
    reference.eval()
    with torch.no_grad():  # post-norm gains of 8, as trained ones grow: the sublayers
        for block in reference.blocks:  # write large, the drift is large in their space
            for norm in (block.attn_post_norm, block.mlp_post_norm):
                norm.weight.add_(7 * norm.gain())
    scoring = _sampled(reference, 48, 24, 0, vocab)
    heldout = _sampled(reference, 48, 24, 1, vocab)
    base = evaluate(reference, heldout).loss
    lost = {}
    for method in ("none", "lsq"):
        model = _pruned(reference, {0: [0, 3], 1: [1]})
        recover(model, reference, scoring, method=method)
        lost[method] = evaluate(model, heldout).loss - base
    assert lost["none"] > 0.01, lost
    assert lost["lsq"] < 0.75 * lost["none"], lost


def test_cli_lsq_writes_an_mlp_error_for_every_layer(tmp_path, bpe_tokenizer):
    """results.json after --recover lsq on a Qwen2: an MLP refit error in every layer."""
    from typer.testing import CliRunner

    from headlab.cli import app
    from tests.test_decoders import _checkpoint

    directory = _checkpoint(tmp_path / "qwen2", "qwen2", vocab_size=len(bpe_tokenizer))
    bpe_tokenizer.save_pretrained(directory)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["prune", "--model", directory, "--keep", "0.5",
                                      "--max-tokens", "1024", "--seq-len", "32",
                                      "--recover", "lsq", "--out", str(out)])
    assert result.exit_code == 0, result.output
    layers = json.loads((out / "results.json").read_text())["recovery"]["layers"]
    assert len(layers) == 2
    for e in layers:
        assert e["mlp_error_after"] <= e["mlp_error_before"] + 1e-6


def test_a_family_without_a_down_projection_is_said_not_skipped(caplog):
    """Where a model names no MLP down projection, lsq refits W_O alone and says so: a
    warning and a note in the report (and its JSON), never a silent half repair."""
    reference, blocks = _llama(), _blocks()
    model = _pruned(reference, LLAMA_PLAN)
    model.mlp_down = Absent("its MLP is fused into one projection")  # as a family declares
    with caplog.at_level("WARNING", logger="headlab.recovery"):
        report = recover(model, reference, blocks, method="lsq")
    assert len(report.notes) == 1 and "refitted W_O alone" in report.notes[0]
    assert "its MLP is fused into one projection" in report.notes[0]
    assert report.notes[0] in caplog.text
    assert RecoveryReport.from_json(report.to_json()).notes == report.notes
    assert all(e.mlp_error_before is None for e in report.layers)
    assert all(e.error_after <= e.error_before + 1e-6 for e in report.layers)


@pytest.mark.parametrize("method", ["lsq", "distill"])
def test_a_repair_that_leaves_weights_out_of_range_is_refused_and_undone(method, monkeypatch):
    """A fit gone wrong (here lsq's solve scaled a millionfold, or distillation at a
    learning rate of 1e3 for one step) stops in one line naming the weight, and the pruned model is
    left as it came."""
    import headlab.recovery.lsq as lsq_module

    build, plan = MODELS["llama"]
    reference, blocks = build(), _blocks()
    model = _pruned(reference, plan)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = {}
    if method == "lsq":
        solve = lsq_module.solve_ridge
        monkeypatch.setattr(lsq_module, "solve_ridge", lambda *a, **k: solve(*a, **k) * 1e6)
    else:
        options = {"start": "none", "lr": 1e3, "params": "all", "tokens": 100}  # one step
    with pytest.raises(UserError, match=rf"recovery {method} left \S+ (non-finite|at \S+, "
                                        r"over 1000 times).* left as it came"):
        recover(model, reference, blocks, method=method, **options)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def test_lsq_on_fewer_tokens_than_inputs_says_so():
    """The report notes (and the log warns) when the scoring tokens are fewer than the
    widest projection lsq refits, and not otherwise."""
    build, plan = MODELS["llama"]
    reference = build()
    widest = max(getattr(m, "in_features", 0)
                 for _, _, m in headlab.recovery.layerwise.refitted(reference))
    few = _blocks(n=2, seq=max(2, widest // 4))
    report = recover(_pruned(reference, plan), reference, few, method="lsq")
    assert few.n_tokens < widest
    assert any("fewer tokens than inputs" in n for n in report.notes)
    many = _blocks(n=8, seq=widest)
    report = recover(_pruned(reference, plan), reference, many, method="lsq")
    assert many.n_tokens >= widest and not any("fewer tokens" in n for n in report.notes)
