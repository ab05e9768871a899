"""Demoted heads (`headlab.attention.streaming`): a sink + window cache instead of the full one.

Equivalence: a layer with demoted heads (plain, soft-capped, QK-normed) == the same
layer with a full cache and the equivalent per-head sink + window mask (given to the
plain attention as ``attn_mask``, with padding and an additive mask), at prefill and at
every decoding step across the window boundary, fast and eager paths; on the families
whose attention differs from Llama's, demotion whose sinks + window cover the sequence
changes nothing; a demoted model's incremental decoding == its own full forward.
Invariants: the ring buffer holds sinks + window positions per demoted key/value head
and a decoding step reads it in place; the streaming mask is built once per forward; the
cache's bytes equal the prediction from the kept groups. Save -> load keeps the
demotion; export to Hugging Face format is refused with the reason.

Shape notation: B batch, H query heads, H_kv key/value heads, S, T query/key lengths,
E model dim, D head dim.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

import headlab
from headlab.attention import MultiHeadAttention
from headlab.attention.masks import Mask
from headlab.attention.streaming import Streaming, StreamingCache, key_sets
from headlab.errors import UserError
from headlab.models.export import export_hf, hf_expressible
from headlab.pruning import demote, demoted_heads
from headlab.selection import PrunePlan, kv_groups

# the bound for a demoted head against the masked full-cache head, float64 maths
TIGHT = {"rtol": 1e-6, "atol": 1e-6}
SINKS, WINDOW = 2, 5


def _reference_mask(kv_index: list[int], demoted: set[int], T: int) -> torch.Tensor:
    """(1, H, T, T): causal for full heads; causal sink + window for demoted ones."""
    q = torch.arange(T)[:, None]
    k = torch.arange(T)[None, :]
    causal = k <= q
    stream = causal & ((k < SINKS) | (k > q - WINDOW))
    return torch.stack([stream if kv in demoted else causal for kv in kv_index])[None]


@pytest.fixture(params=["plain", "softcap", "qk-norm"])
def layers(request):
    """A GQA attention (6 heads over 3 kv heads, float64; plain, with Gemma-2's logit
    soft-capping, or with per-head QK-norm) and a copy with kv heads 1 and 2 demoted."""
    torch.manual_seed(3)
    extra = {"softcap": {"softcap": 0.5},
             "qk-norm": {"q_norm": torch.nn.RMSNorm(4), "k_norm": torch.nn.RMSNorm(4)},
             "plain": {}}[request.param]
    attn = MultiHeadAttention(d_model=24, n_heads=6, n_kv_heads=3, head_dim=4, **extra)
    attn = attn.double()
    if request.param == "qk-norm":
        with torch.no_grad():
            attn.q_norm.weight.uniform_(0.5, 2.0)
            attn.k_norm.weight.uniform_(0.5, 2.0)
    demoted = copy.deepcopy(attn)
    demoted.streaming = Streaming((1, 2), sinks=SINKS, window=WINDOW)
    return attn, demoted


@pytest.mark.parametrize("eager", [False, True])
def test_demoted_head_equals_full_cache_head_under_the_mask(layers, eager):
    attn, demoted = layers
    x = torch.randn(2, 16, 24, dtype=torch.float64)
    ref_mask = _reference_mask(attn.kv_index.tolist(), {1, 2}, 16)
    cache = StreamingCache(demoted.streaming)
    prefill = 4  # < SINKS + WINDOW: the ring is not full yet; the steps then wrap it
    got = demoted(x[:, :prefill], causal=True, cache=cache, need_weights=eager)
    want = attn(x[:, :prefill], attn_mask=ref_mask[..., :prefill, :prefill],
                need_weights=eager)
    if eager:
        assert_close(got[1], want[1], **TIGHT)  # weights, zero outside sinks + window
        got, want = got[0], want[0]
    assert_close(got, want, **TIGHT)
    for t in range(prefill, 16):  # every step, across the window boundary and the wrap
        got = demoted(x[:, t:t + 1], causal=True, cache=cache, need_weights=eager)
        want = attn(x[:, :t + 1], attn_mask=ref_mask[..., :t + 1, :t + 1],
                    need_weights=eager)
        if eager:
            assert_close(got[1], want[1][:, :, -1:], **TIGHT)
            got, want = got[0], want[0]
        assert_close(got, want[:, -1:], **TIGHT)
    # the ring buffer holds sinks + window positions of the 2 demoted kv heads, no more
    assert cache.k.shape == cache.v.shape == (2, 2, SINKS + WINDOW, 4)
    assert cache.full.length == 16 and cache.full._k.shape[1] == 1
    assert sorted(cache.positions.tolist()) == [0, 1, *range(16 - WINDOW, 16)]


def test_prefill_longer_than_the_window_then_chunks(layers):
    attn, demoted = layers
    x = torch.randn(1, 20, 24, dtype=torch.float64)
    ref = attn(x, attn_mask=_reference_mask(attn.kv_index.tolist(), {1, 2}, 20))
    # a plain forward without a cache uses the same mask
    assert_close(demoted(x, causal=True), ref, **TIGHT)
    cache = StreamingCache(demoted.streaming)
    parts = [demoted(x[:, a:b], causal=True, cache=cache) for a, b in ((0, 9), (9, 14),
                                                                        (14, 20))]
    assert_close(torch.cat(parts, dim=1), ref, **TIGHT)


@pytest.mark.parametrize("eager", [False, True])
def test_padding_and_a_per_head_additive_mask_hold_for_demoted_heads(layers, eager):
    attn, demoted = layers
    T = 14
    x = torch.randn(2, T, 24, dtype=torch.float64)
    pad = torch.ones(2, T, dtype=torch.bool)
    pad[1, :5] = False  # row 1's sinks are padding; its first 5 queries see no key
    bias = torch.randn(1, 6, T, T, dtype=torch.float64)  # (1, H, T, T)

    def reference(t: int):  # the plain layer over positions 0 .. t-1, one combined mask
        allowed = _reference_mask(attn.kv_index.tolist(), {1, 2}, t) & pad[:, None, None, :t]
        return attn(x[:, :t], attn_mask=bias[..., :t, :t].masked_fill(~allowed, -torch.inf),
                    need_weights=eager)

    cache = StreamingCache(demoted.streaming)
    for a, b in [(0, 5), (5, 8), *((t, t + 1) for t in range(8, T))]:
        got = demoted(x[:, a:b], causal=True, key_padding_mask=pad[:, :b],
                      attn_mask=bias[..., a:b, :b], cache=cache, need_weights=eager)
        want = reference(b)
        if eager:
            assert_close(got[1], want[1][:, :, a:b], **TIGHT)
            got, want = got[0], want[0]
        assert_close(got, want[:, a:b], **TIGHT)


def test_every_kv_head_demoted_and_no_sinks():
    torch.manual_seed(5)
    attn = MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2, head_dim=4).double()
    demoted = copy.deepcopy(attn)
    demoted.streaming = Streaming((0, 1), sinks=0, window=3)
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    q, k = torch.arange(9)[:, None], torch.arange(9)[None, :]
    want = attn(x, attn_mask=(k <= q) & (k > q - 3))
    cache = StreamingCache(demoted.streaming)
    got = torch.cat([demoted(x[:, :2], causal=True, cache=cache)]
                    + [demoted(x[:, t:t + 1], causal=True, cache=cache) for t in range(2, 9)],
                    dim=1)
    assert_close(got, want, **TIGHT)
    assert cache.k.shape == (1, 2, 3, 4) and cache.full._k is None


def _demote_half(model) -> PrunePlan:
    # layer 0: group of kv head 1 (query heads 2, 3); layer 1: kv heads 0 and 2
    plan = PrunePlan({0: list(range(6)), 1: list(range(6))}, {0: [], 1: []},
                     {0: [2, 3], 1: [0, 1, 4, 5]})
    return demote(model, plan, sinks=SINKS, window=WINDOW)


# families whose attention differs from Llama's: soft-capping (gemma2), QK-norm per head
# (qwen3, gemma3) and over the projection (olmo2), partial rotary and a fused QKV (phi3)
FAMILIES = ["gemma2", "qwen3", "gemma3", "olmo2", "phi3"]


def _family_model(tmp_path, case: str):
    """A random-weight checkpoint of ``case`` (tests/test_decoders.py) loaded by headlab:
    2 layers of 4 query heads over 2 key/value heads."""
    from test_decoders import _checkpoint

    return headlab.load(_checkpoint(tmp_path / case, case), tokenizer=False)


@pytest.mark.parametrize("case", FAMILIES)
def test_demotion_covering_every_position_changes_nothing(case, tmp_path):
    model = _family_model(tmp_path, case)
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(ids).logits
        # sinks 4 + window 8 reach every earlier position of 12 tokens: nothing is cut
        plan = PrunePlan({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, {0: [], 1: []},
                         {0: [2, 3], 1: [0, 1]})
        demote(model, plan, sinks=4, window=8)
        assert demoted_heads(model) == {0: [2, 3], 1: [0, 1]}
        assert_close(model(ids).logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["llama", "gemma2"])
def test_demoted_model_decodes_as_its_full_forward(case, gqa_dir, tmp_path):
    model = headlab.load(gqa_dir) if case == "llama" else _family_model(tmp_path, case)
    groups = kv_groups(model)  # layer 0: demote its last group; layer 1: its first
    plan = PrunePlan({0: sum(groups[0], []), 1: sum(groups[1], [])}, {0: [], 1: []},
                     {0: groups[0][-1], 1: groups[1][0]})
    demote(model, plan, sinks=SINKS, window=WINDOW)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(7))
    pad = torch.ones_like(ids)
    pad[1, :3] = 0  # left padding covers the sinks of row 1 and rides along in the cache
    with torch.no_grad():
        full = model(ids, pad).logits
        cache = model.new_cache()
        steps = [model(ids[:, :4], pad[:, :4], cache=cache).logits]  # the ring not yet full
        steps += [model(ids[:, t:t + 1], pad[:, :t + 1], cache=cache).logits
                  for t in range(4, 16)]
    assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert sorted(cache.layers[0].positions.tolist()) == [0, 1, *range(16 - WINDOW, 16)]


def test_a_decoding_step_reads_the_ring_in_place(layers):
    _, demoted = layers
    cache = StreamingCache(demoted.streaming)
    x = torch.randn(1, 12, 24, dtype=torch.float64)
    demoted(x[:, :10], causal=True, cache=cache)  # the ring has wrapped
    new = torch.randn(1, 3, 1, 4, dtype=torch.float64)  # (B, H_kv, S, D)
    full, stream = key_sets(demoted, new, new, Mask(), cache)
    # the streaming heads read the sinks + window slots themselves: no copy of the ring
    assert stream.k.data_ptr() == cache.k.data_ptr()
    assert stream.k.shape == (1, 2, SINKS + WINDOW, 4)
    assert sorted(stream.positions.tolist()) == [0, 1, *range(11 - WINDOW, 11)]
    assert full.k.shape == (1, 1, 11, 4)


def test_the_streaming_mask_is_built_once_per_forward(gqa_dir, monkeypatch):
    model = _demote_half(headlab.load(gqa_dir))
    built = []
    of = Mask.of

    def spy(**kw):
        built.append(1)
        return of(**kw)

    monkeypatch.setattr(Mask, "of", staticmethod(spy))
    with torch.no_grad():
        model(torch.randint(0, 500, (1, 12)))
    assert len(built) == 2  # the model's causal mask, then the streaming heads' for both layers


def test_demoted_model_decodes_as_its_full_forward_and_cache_bytes_match(gqa_dir):
    model = _demote_half(headlab.load(gqa_dir))
    assert demoted_heads(model) == {0: [2, 3], 1: [0, 1, 4, 5]}
    ids = torch.randint(0, 500, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        steps = [model(ids[:, :6], cache=cache).logits]
        steps += [model(ids[:, t:t + 1], cache=cache).logits for t in range(6, 21)]
    assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    # prediction from the kept groups: 3 full kv heads keep 21 positions, 3 demoted keep
    # sinks + window, each 2 x D = 8 floats of 4 bytes for K and V
    per_head = 2 * 8 * 4
    predicted = per_head * (3 * 21 + 3 * (SINKS + WINDOW))
    assert model.kv_cache_bytes(21) == predicted
    assert sum(layer.nbytes() for layer in cache.layers) == predicted
    assert model.kv_cache_bytes_per_token() == 3 * per_head
    assert cache.layers[1].k.shape == (1, 2, SINKS + WINDOW, 8)


def test_generate_with_demoted_heads_matches_a_step_by_step_recompute(gqa_dir):
    model = _demote_half(headlab.load(gqa_dir))
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(4))
    out = model.generate(ids, max_new_tokens=6, eos_token_id=())
    seq = ids
    with torch.no_grad():
        for _ in range(6):  # no cache: each step a full forward under the same masks
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, seq)


def test_demotion_survives_save_and_load_and_refuses_hf_export(gqa_dir, tmp_path):
    model = _demote_half(headlab.load(gqa_dir))
    model.save(tmp_path / "m")
    back = headlab.load(tmp_path / "m")
    assert demoted_heads(back) == demoted_heads(model)
    assert back.attentions[1].streaming == Streaming((0, 2), sinks=SINKS, window=WINDOW)
    ids = torch.randint(0, 500, (1, 15))
    with torch.no_grad():
        assert_close(back(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert "demoted heads" in hf_expressible(model)
    with pytest.raises(UserError, match="demoted heads"):
        export_hf(model, tmp_path / "hf")


def test_hooks_see_the_demoted_pattern(gqa_dir):
    model = _demote_half(headlab.load(gqa_dir))
    ids = torch.randint(0, 500, (1, 12))
    seen = {}
    hook = model.attentions[0].pattern.register_forward_hook(
        lambda m, i, o: seen.setdefault("p", o))
    with torch.no_grad():
        model(ids)
    hook.remove()
    p = seen["p"][0]  # (H, S, T)
    q, k = torch.arange(12)[:, None], torch.arange(12)[None, :]
    outside = (k <= q) & ~((k < SINKS) | (k > q - WINDOW))
    assert bool((p[2:4][:, outside] == 0).all())  # the demoted group: nothing outside
    assert bool((p[0][outside] > 0).all())  # a full head attends there
    assert_close(p.sum(-1), torch.ones(6, 12), rtol=0, atol=1e-6)


def test_demoting_part_of_a_group_is_refused(gqa_dir):
    plan = PrunePlan({0: list(range(6))}, {0: []}, {0: [2]})
    with pytest.raises(UserError, match="whole groups"):
        demote(headlab.load(gqa_dir), plan)


def test_demoting_an_encoder_is_refused():
    encoder = headlab.load("minilm-l6")
    plan = PrunePlan({0: list(range(12))}, {0: []}, {0: [0]})
    with pytest.raises(UserError, match="attends both ways"):
        demote(encoder, plan)


def test_the_command_refuses_demote_with_export_hf(gqa_dir, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "headlab", "prune", "--model", str(gqa_dir),
                        "--unit", "kv-group", "--kv-keep", "0.5", "--demote", "--export", "hf",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "drop --export hf" in r.stderr
    assert not (tmp_path / "run").exists()
