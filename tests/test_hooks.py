"""Tests for headlab.attention.hooks: capture and intervention by hook-point name.

References: transformers' eager GPT-2 (``output_attentions=True``) loaded from the same
checkpoint; the attention output rebuilt by hand from z and W_O. Equivalences: zero
ablation through hooks == head gates at 0; a capture of ``pattern`` == no capture.
Invariants: only what is asked for is stored, in the dtype asked for; the memory guard's
estimate is the bytes really stored; hooks never outlive their context.

Shape notation: B batch, S sequence length, T key length, H heads, D head dim, E model dim.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from torch.testing import assert_close

from headlab.attention import MultiHeadAttention
from headlab.attention.hooks import (
    CaptureTooLargeError,
    ablate_heads,
    capture,
    hook_names,
    hooks,
    mean_z,
)
from headlab.data.blocks import Blocks

B, S = 2, 12
# float32 through a 3-layer model: differences beyond ~1e-6 are not rounding
TIGHT = {"rtol": 1e-6, "atol": 1e-6}


@pytest.fixture()
def ids(tiny_gpt2):
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, tiny_gpt2.config.vocab_size, (B, S), generator=gen)


def _no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# ---------------------------------------------------------------------- references
def test_patterns_match_transformers_eager(tiny_gpt2, tiny_gpt2_dir, ids):
    hf = transformers.GPT2LMHeadModel.from_pretrained(
        tiny_gpt2_dir, attn_implementation="eager").eval()
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0  # right padding in the second row
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_attentions=True).attentions
        with capture(tiny_gpt2, "pattern") as cap:
            tiny_gpt2(ids, attention_mask=mask)
    assert len(ref) == len(cap) == 3
    for i, pattern in enumerate(cap.stack("pattern")):
        assert pattern.shape == (B, 4, S, S)
        assert_close(pattern, ref[i].float(), rtol=1e-5, atol=1e-5)
        # invariants: rows sum to 1, nothing above the causal diagonal
        assert_close(pattern.sum(-1), torch.ones(B, 4, S), rtol=1e-6, atol=1e-6)
        assert torch.all(pattern.triu(1) == 0)


def test_z_through_w_o_equals_out(tiny_gpt2, ids):
    with torch.no_grad(), capture(tiny_gpt2, ["z", "out"]) as cap:
        tiny_gpt2(ids)
    for i, attn in enumerate(tiny_gpt2.attentions):
        z = cap[f"blocks.{i}.attn.z"]  # (B, S, H, D)
        H, D = attn.n_heads, attn.head_dim
        assert z.shape == (B, S, H, D)
        w_o = attn.o_proj.weight.view(attn.d_model, H, D)  # (E, H, D)
        out = torch.einsum("bshd,ehd->bse", z, w_o) + attn.o_proj.bias
        assert_close(out, cap[f"blocks.{i}.attn.out"], rtol=1e-5, atol=1e-6)


def test_scores_softmax_to_the_pattern(tiny_gpt2, ids):
    with torch.no_grad(), capture(tiny_gpt2, ["scores", "pattern"], layers=[2]) as cap:
        tiny_gpt2(ids)
    scores = cap["blocks.2.attn.scores"]  # (B, H, S, T), -inf above the diagonal
    assert torch.isneginf(scores.triu(1)[..., 0, 1:]).all()
    assert_close(scores.softmax(-1), cap["blocks.2.attn.pattern"], **TIGHT)


# ---------------------------------------------------------------------- interventions
def test_zero_ablation_through_hooks_equals_gates_at_zero(tiny_gpt2, tiny_gpt2_dir, ids):
    import headlab

    heads = {0: [1], 2: [0, 3]}
    gated = headlab.load(tiny_gpt2_dir)
    gated.mask_heads(heads)
    with torch.no_grad():
        plain = tiny_gpt2(ids).logits
        with hooks(tiny_gpt2, ablate_heads(tiny_gpt2, heads)):
            ablated = tiny_gpt2(ids).logits
        expected = gated(ids).logits
    assert_close(ablated, expected, **TIGHT)
    assert (ablated - plain).abs().max() > 1e-4  # the ablation did something
    assert_close(tiny_gpt2(ids).logits.detach(), plain, rtol=0, atol=0)  # and was undone


def test_mean_ablation_replaces_z_by_the_dataset_mean(tiny_gpt2, ids):
    gen = torch.Generator().manual_seed(2)
    data = torch.randint(0, tiny_gpt2.config.vocab_size, (5, S), generator=gen)
    valid = torch.ones(5, S, dtype=torch.long)
    valid[4, 7:] = 0  # padded tokens must not count
    blocks = Blocks(data, valid)
    means = mean_z(tiny_gpt2, blocks.batches(2))
    assert sorted(means) == [0, 1, 2] and means[1].shape == (4, 8)

    # the mean by hand, over the valid tokens only (float64)
    with torch.no_grad(), capture(tiny_gpt2, "z", layers=[1]) as cap:
        tiny_gpt2(data, attention_mask=valid)
    z = cap["blocks.1.attn.z"].double()  # (N, S, H, D)
    expected = z[valid.bool()].mean(0)  # (H, D)
    assert_close(means[1].double(), expected, rtol=1e-6, atol=1e-7)

    with torch.no_grad():
        with capture(tiny_gpt2, "z", layers=[1]) as before:
            tiny_gpt2(ids)
        fns = ablate_heads(tiny_gpt2, {1: [2]}, means=means)
        with hooks(tiny_gpt2, fns), capture(tiny_gpt2, "z", layers=[1]) as after:
            tiny_gpt2(ids)
    z0, z1 = before["blocks.1.attn.z"], after["blocks.1.attn.z"]
    assert_close(z1[1, 5, 2], means[1][2], rtol=0, atol=0)  # one position
    assert_close(z1[:, :, 2], means[1][2].expand(B, S, -1), rtol=0, atol=0)
    others = [0, 1, 3]
    assert_close(z1[:, :, others], z0[:, :, others], rtol=0, atol=0)


# ---------------------------------------------------------------------- what is stored
def test_layers_and_heads_select_what_is_stored(tiny_gpt2, ids):
    with torch.no_grad():
        with capture(tiny_gpt2, ["pattern", "z"]) as full:
            tiny_gpt2(ids)
        with capture(tiny_gpt2, ["pattern", "z"], layers=[1], heads=[0, 2]) as part:
            tiny_gpt2(ids)
    assert sorted(part) == ["blocks.1.attn.pattern", "blocks.1.attn.z"]
    assert part["blocks.1.attn.pattern"].shape == (B, 2, S, S)
    assert part["blocks.1.attn.z"].shape == (B, S, 2, 8)
    assert part.head_ids == {"blocks.1.attn.pattern": [0, 2], "blocks.1.attn.z": [0, 2]}
    # layers 0 and 2 ran the fast path here and eager in `full`: rounding differs
    assert_close(part["blocks.1.attn.pattern"], full["blocks.1.attn.pattern"][:, [0, 2]],
                 **TIGHT)
    assert_close(part["blocks.1.attn.z"], full["blocks.1.attn.z"][:, :, [0, 2]], **TIGHT)
    assert full.head_ids["blocks.0.attn.pattern"] == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="was not captured"):
        part["blocks.0.attn.pattern"]


def test_heads_follow_original_indices_after_pruning(tiny_gpt2, ids):
    tiny_gpt2.prune_heads({0: [1], 1: [0, 2]})
    with torch.no_grad(), capture(tiny_gpt2, "pattern", heads=[1, 2]) as cap:
        tiny_gpt2(ids)
    assert cap.head_ids == {"blocks.0.attn.pattern": [2], "blocks.1.attn.pattern": [1],
                            "blocks.2.attn.pattern": [1, 2]}
    with torch.no_grad(), capture(tiny_gpt2, "pattern", heads=[0]) as cap:
        tiny_gpt2(ids)  # layer 1 no longer has head 0: it stores an empty head axis
    assert cap["blocks.1.attn.pattern"].shape == (B, 0, S, S)
    assert cap.head_ids["blocks.1.attn.pattern"] == []


def test_key_value_head_ids_under_gqa():
    """k and v carry key/value heads: their head_ids are the kv heads' ids."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block()])

        def forward(self, x):
            return self.blocks[0].attn(x, causal=True)

    model = Tiny().eval()
    with torch.no_grad(), capture(model, ["q", "k", "v"]) as cap:
        model(torch.randn(1, 5, 16))
    assert cap["blocks.0.attn.q"].shape == (1, 5, 4, 4)
    assert cap["blocks.0.attn.k"].shape == (1, 5, 2, 4)
    assert cap.head_ids["blocks.0.attn.q"] == [0, 1, 2, 3]
    assert cap.head_ids["blocks.0.attn.k"] == cap.head_ids["blocks.0.attn.v"] == [0, 1]


@pytest.mark.parametrize(("names", "expected"), [
    ("z", [f"blocks.{i}.attn.z" for i in range(3)]),
    ("blocks.*.attn.z", [f"blocks.{i}.attn.z" for i in range(3)]),
    (["q", "k"], [f"blocks.{i}.attn.{n}" for i in range(3) for n in ("q", "k")]),
    ("resid_post", [f"blocks.{i}.resid_post" for i in range(3)]),
    ("blocks.2.attn.*", [f"blocks.2.attn.{n}"
                         for n in ("q", "k", "v", "scores", "pattern", "z", "out")]),
    ("blocks.[01].attn.out", ["blocks.0.attn.out", "blocks.1.attn.out"]),
])
def test_globs_and_short_names(tiny_gpt2, ids, names, expected):
    with torch.no_grad(), capture(tiny_gpt2, names) as cap:
        tiny_gpt2(ids)
    assert sorted(cap) == sorted(expected)
    assert set(expected) <= set(hook_names(tiny_gpt2))


def test_exact_names_resolve_without_walking_the_model(tiny_gpt2, ids, monkeypatch):
    """Exact names are looked up where they are (the recovery walk asks a few per layer
    and batch); a name that is not a hook point still gets the walk's error."""
    names = ["blocks.1.attn.z", "blocks.1.attn.out"]
    with torch.no_grad(), capture(tiny_gpt2, names) as want:
        tiny_gpt2(ids)

    def walk(*args, **kwargs):
        raise AssertionError("walked every module for exact names")

    got = {}

    def keep(t, name):
        got[name] = t

    with monkeypatch.context() as m:
        m.setattr(type(tiny_gpt2), "named_modules", walk)
        with torch.no_grad(), hooks(tiny_gpt2, dict.fromkeys(names, keep)):
            tiny_gpt2(ids)
    assert sorted(got) == sorted(names)
    for name in names:
        assert_close(got[name], want[name], rtol=0, atol=0)
    with (pytest.raises(KeyError, match="no hook point matches"),
          hooks(tiny_gpt2, {"blocks.1.attn": keep})):  # a module, not a hook point
        pass
    assert _no_hooks_left(tiny_gpt2)


def test_float16_storage(tiny_gpt2, ids):
    with torch.no_grad():
        with capture(tiny_gpt2, ["pattern", "z"]) as f32:
            tiny_gpt2(ids)
        with capture(tiny_gpt2, ["pattern", "z"], dtype=torch.float16) as f16:
            tiny_gpt2(ids)
    assert {t.dtype for t in f32.tensors.values()} == {torch.float32}
    assert {t.dtype for t in f16.tensors.values()} == {torch.float16}
    assert f16.nbytes() * 2 == f32.nbytes()
    for name, t in f16.items():
        # float16 keeps 11 significant bits: relative error below 2**-11
        assert_close(t.float(), f32[name], rtol=2**-10, atol=1e-6)


def test_unknown_name_raises_with_examples(tiny_gpt2):
    with (pytest.raises(KeyError, match=r"no hook point matches.*blocks\.0\.attn\.q"),
          capture(tiny_gpt2, "blocks.0.attn.patern")):
        pass
    with (pytest.raises(KeyError, match="examples of names"),
          hooks(tiny_gpt2, {"nothing_here": lambda t, n: None})):
        pass
    assert _no_hooks_left(tiny_gpt2)


# ---------------------------------------------------------------------- memory guard
def test_memory_guard_estimate_is_the_stored_size(tiny_gpt2, ids):
    with (pytest.raises(CaptureTooLargeError) as err,
          capture(tiny_gpt2, "pattern", max_bytes=1000)):
        tiny_gpt2(ids)
    needed = err.value.needed
    assert err.value.limit == 1000
    assert f"{needed} bytes" in str(err.value)
    for way_out in ("layers=", "heads=", "dtype=torch.float16", "max_bytes="):
        assert way_out in str(err.value)
    assert _no_hooks_left(tiny_gpt2)

    with torch.no_grad(), capture(tiny_gpt2, "pattern", max_bytes=needed) as cap:
        tiny_gpt2(ids)  # exactly at the limit: allowed
    assert cap.nbytes() == needed == 3 * B * 4 * S * S * 4
    assert cap.forwards == 1


@pytest.mark.parametrize("kw", [
    {"names": ["z", "out", "resid_pre"]},
    {"names": ["pattern", "q", "v"], "layers": [0, 2], "heads": [1, 3]},
    {"names": ["scores"], "dtype": torch.float16},
    {"names": ["pattern", "z", "resid_mid"], "heads": [3], "float64": True},
])
def test_memory_estimate_matches_other_captures(tiny_gpt2, ids, kw):
    names = kw.pop("names")
    if kw.pop("float64", False):
        tiny_gpt2.double()
    with pytest.raises(CaptureTooLargeError) as err, capture(tiny_gpt2, names, max_bytes=1, **kw):
        tiny_gpt2(ids)
    with torch.no_grad(), capture(tiny_gpt2, names, **kw) as cap:
        tiny_gpt2(ids)
    assert cap.nbytes() == err.value.needed


def test_memory_estimate_counts_only_present_heads(tiny_gpt2, ids):
    tiny_gpt2.prune_heads({0: [0, 1], 2: [1]})
    with (pytest.raises(CaptureTooLargeError) as err,
          capture(tiny_gpt2, ["pattern", "z"], heads=[0, 1], max_bytes=1)):
        tiny_gpt2(ids)
    with torch.no_grad(), capture(tiny_gpt2, ["pattern", "z"], heads=[0, 1]) as cap:
        tiny_gpt2(ids)
    assert [t.shape[1] for t in cap.per_layer("pattern")] == [0, 2, 1]
    assert cap.nbytes() == err.value.needed


def test_memory_guard_counts_from_zero_limit(tiny_gpt2, ids):
    with pytest.raises(CaptureTooLargeError), capture(tiny_gpt2, "z", max_bytes=0):
        tiny_gpt2(ids)


# ---------------------------------------------------------------------- cleanup, fast path
def test_hooks_are_removed_after_the_context(tiny_gpt2, ids):
    with capture(tiny_gpt2, ["pattern", "z", "resid_mid"]):
        assert not _no_hooks_left(tiny_gpt2)
    assert _no_hooks_left(tiny_gpt2)
    with hooks(tiny_gpt2, ablate_heads(tiny_gpt2, {0: [0]})):
        assert tiny_gpt2.blocks[0].attn.z._forward_hooks
    assert _no_hooks_left(tiny_gpt2)


def test_hooks_are_removed_when_the_body_raises(tiny_gpt2, ids):
    with pytest.raises(RuntimeError, match="boom"), capture(tiny_gpt2, "pattern"):
        tiny_gpt2(ids)
        raise RuntimeError("boom")
    assert _no_hooks_left(tiny_gpt2)

    def bad(t, name):
        raise RuntimeError(f"boom at {name}")

    with (pytest.raises(RuntimeError, match="boom at blocks.1.attn.out"),
          hooks(tiny_gpt2, {"blocks.1.attn.out": bad})):
        tiny_gpt2(ids)
    assert _no_hooks_left(tiny_gpt2)


def test_no_active_hook_takes_the_fast_path(tiny_gpt2, ids, monkeypatch):
    calls = []
    for attn in tiny_gpt2.attentions:
        eager = attn._eager

        def spy(*args, _eager=eager):
            calls.append(1)
            return _eager(*args)

        monkeypatch.setattr(attn, "_eager", spy)
    with torch.no_grad():
        plain = tiny_gpt2(ids).logits
        assert calls == []  # no hook point active: patterns are never computed
        with capture(tiny_gpt2, ["z", "out", "resid_post"]):
            with_z = tiny_gpt2(ids).logits
        assert calls == []  # z and out do not need the weights either
        with capture(tiny_gpt2, "pattern") as cap:
            with_pattern = tiny_gpt2(ids).logits
        assert len(calls) == 3  # a pattern hook switches every block to eager
        calls.clear()
        with capture(tiny_gpt2, "scores", layers=[1]):
            tiny_gpt2(ids)
        assert len(calls) == 1
    assert len(cap) == 3
    assert_close(with_z, plain, rtol=0, atol=0)
    assert_close(with_pattern, plain, **TIGHT)


# ---------------------------------------------------------------------- the off switch
def test_hooks_disabled_switches_every_hook_off_and_back(tiny_gpt2, ids):
    """Inside hooks_disabled a registered intervention changes nothing and a capture
    stores nothing, at every kind of hook site (run_hook calls and the points the
    attention tests itself: q, k, v, z, scores, pattern); outside, both work again."""
    from headlab.attention.hookpoint import hooks_disabled, hooks_enabled

    names = ["q", "k", "v", "z", "scores", "pattern", "out"]
    with torch.no_grad():
        plain = tiny_gpt2(ids).logits
        fns = {f"blocks.1.attn.{n}": (lambda x, _name: x * 1.5) for n in names}
        fns["blocks.0.resid_post"] = lambda x, _name: x + 1.0
        with hooks(tiny_gpt2, fns):
            hooked = tiny_gpt2(ids).logits
            with hooks_disabled():
                assert not hooks_enabled()
                off = tiny_gpt2(ids).logits
            again = tiny_gpt2(ids).logits
        with capture(tiny_gpt2, names) as cap, hooks_disabled():
            tiny_gpt2(ids)
    assert hooks_enabled()
    assert not torch.allclose(hooked, plain, rtol=1e-3, atol=1e-3)
    assert_close(off, plain, **TIGHT)
    assert torch.equal(again, hooked)
    assert len(cap) == 0
    assert _no_hooks_left(tiny_gpt2)


def test_hooks_disabled_is_restored_after_an_error():
    from headlab.attention.hookpoint import hooks_disabled, hooks_enabled

    with pytest.raises(KeyError), hooks_disabled():
        raise KeyError("inside")
    assert hooks_enabled()
