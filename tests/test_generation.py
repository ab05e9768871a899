"""Tests for headlab.models.generation: cached greedy and sampled decoding on tiny random models.

Every check runs on both a GPT-2 (learned positions, MHA) and a Llama (rotary, GQA),
built directly from headlab configs with random weights. The decoding kernel's products
are checked against torch's and its switch against leaking out of `generate`.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from headlab.models import kernels
from headlab.models.generation import _kernel_products, generate
from headlab.models.gpt2 import GPT2, GPT2Config
from headlab.models.llama import Llama, LlamaConfig

VOCAB = 61


def _gpt2():
    return GPT2(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                           eos_token_id=0, bos_token_id=0))


def _llama():
    return Llama(LlamaConfig.from_hf(dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        eos_token_id=0, bos_token_id=0)))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    torch.manual_seed(0)
    m = {"gpt2": _gpt2, "llama": _llama}[request.param]()
    with torch.no_grad():  # larger weights than the default init: peaked, varied logits
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return m.eval()


def _prompt(batch: int = 3, length: int = 5, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


def test_greedy_equals_argmax_of_full_recompute(model):
    ids = _prompt()
    out = generate(model, ids, max_new_tokens=8, eos_token_id=())
    assert out.shape == (3, 13)
    assert torch.equal(out[:, :5], ids)
    with torch.no_grad():
        for t in range(5, 13):
            expected = model(out[:, :t]).logits[:, -1].argmax(-1)
            assert torch.equal(out[:, t], expected), f"step {t - 5}"


def test_each_new_token_costs_one_cached_step(model):
    lengths: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, args: lengths.append(args[0].shape[1]))
    try:
        generate(model, _prompt(), max_new_tokens=6, eos_token_id=())
    finally:
        handle.remove()
    assert lengths == [5] + [1] * 5  # prefill once; the last token needs no forward


def test_left_padding_gives_the_unpadded_continuation(model):
    ids = _prompt(batch=2)
    short = ids[1:, 2:]  # row 1 without its first two tokens
    padded = ids.clone()
    padded[1, :2] = 0
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    out = generate(model, padded, attention_mask=mask, max_new_tokens=6, eos_token_id=())
    alone = generate(model, short, max_new_tokens=6, eos_token_id=())
    assert torch.equal(out[1, 5:], alone[0, 3:])
    assert torch.equal(out[0], generate(model, ids[:1], max_new_tokens=6, eos_token_id=())[0])


def test_right_padding_is_refused(model):
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="left"):
        generate(model, _prompt(), attention_mask=mask)


def test_sampling_with_a_seeded_generator_is_reproducible(model):
    def sample(seed):
        g = torch.Generator().manual_seed(seed)
        return generate(model, _prompt(), max_new_tokens=10, do_sample=True, temperature=1.5,
                        eos_token_id=(), generator=g)

    first = sample(7)
    assert torch.equal(first, sample(7))
    assert not torch.equal(first, sample(8))  # 30 draws at temperature 1.5


def test_top_k_one_and_tiny_top_p_equal_greedy(model):
    ids = _prompt()
    greedy = generate(model, ids, max_new_tokens=8, eos_token_id=())
    g = torch.Generator().manual_seed(0)
    top_k = generate(model, ids, max_new_tokens=8, do_sample=True, top_k=1, eos_token_id=(),
                     generator=g)
    top_p = generate(model, ids, max_new_tokens=8, do_sample=True, top_p=1e-6, eos_token_id=(),
                     generator=g)
    assert torch.equal(top_k, greedy)
    assert torch.equal(top_p, greedy)


def test_top_k_samples_only_among_the_k_best(model):
    g = torch.Generator().manual_seed(3)
    out = generate(model, _prompt(), max_new_tokens=8, do_sample=True, top_k=3,
                   temperature=5.0, eos_token_id=(), generator=g)
    with torch.no_grad():
        for t in range(5, 13):
            best = model(out[:, :t]).logits[:, -1].topk(3, dim=-1).indices  # (B, 3)
            assert bool((best == out[:, t, None]).any(-1).all()), f"step {t - 5}"


def test_eos_stops_its_row_and_pads_it(model):
    ids = _prompt()
    free = generate(model, ids, max_new_tokens=8, eos_token_id=())
    eos = int(free[0, 7])  # row 0's third new token (or an earlier one: same id)
    pad = VOCAB - 1
    out = generate(model, ids, max_new_tokens=8, eos_token_id=eos, pad_token_id=pad)
    assert out.shape[1] <= 13
    for row in range(3):  # each row: the free run up to its first eos, then pads
        hits = (free[row, 5:] == eos).nonzero()
        end = 5 + int(hits[0]) + 1 if len(hits) else out.shape[1]
        assert torch.equal(out[row, :end], free[row, :end])
        assert bool((out[row, end:] == pad).all())


def test_generation_ends_when_every_row_has_stopped(model):
    ids = _prompt(batch=1)
    free = generate(model, ids, max_new_tokens=8, eos_token_id=())
    out = generate(model, ids, max_new_tokens=8, eos_token_id=int(free[0, 6]))
    first = int((free[0, 5:] == free[0, 6]).nonzero()[0])
    assert torch.equal(out, free[:, : 5 + first + 1])


def test_eos_defaults_to_the_config(model):
    ids = _prompt()
    assert model.config.eos_token_id == 0
    out = generate(model, ids, max_new_tokens=20)
    explicit = generate(model, ids, max_new_tokens=20, eos_token_id=0)
    assert torch.equal(out, explicit)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_max_new_tokens_is_respected(model, n):
    ids = _prompt()
    out = generate(model, ids, max_new_tokens=n, eos_token_id=())
    assert out.shape == (3, 5 + n)
    assert torch.equal(out[:, :5], ids)


def test_positions_beyond_the_model_are_refused(model):
    with pytest.raises(ValueError, match="positions"):
        generate(model, _prompt(), max_new_tokens=60)


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(top_k=0), dict(top_p=0.0),
                                dict(top_p=1.5), dict(max_new_tokens=-1)])
def test_bad_settings_are_refused(model, kw):
    with pytest.raises(ValueError):
        generate(model, _prompt(), do_sample=True, **kw)


# ---------------------------------------------------------------------- decoding kernel
needs_kernel = pytest.mark.skipif(not kernels.available(), reason=kernels.status())


def _linears(model) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _counted_kernel(monkeypatch) -> list[int]:
    """One entry (the rows multiplied) per product the kernel computes."""
    calls: list[int] = []
    real = kernels.linear_rows

    def counted(x, w, bias):
        y = real(x, w, bias)
        if y is not None:
            calls.append(x.numel() // x.shape[-1])
        return y

    monkeypatch.setattr(kernels, "linear_rows", counted)
    return calls


@needs_kernel
def test_kernel_products_equal_torchs_within_float32_rounding(model, monkeypatch):
    calls = _counted_kernel(monkeypatch)
    ids = _prompt()
    with torch.no_grad():
        step = ids[:, -1:]  # one decode step of 3 rows after a 5-token prefill
        logits = []
        for switch in (contextlib.nullcontext, lambda: _kernel_products(model)):
            cache = model.new_cache()
            model(ids, cache=cache)
            with switch():
                logits.append(model(step, cache=cache).logits)
        torch_logits, kernel_logits = logits
    assert len(calls) == len(_linears(model))  # every linear layer took the kernel
    assert_close(kernel_logits, torch_logits, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_only_decode_steps_take_the_kernel(model, monkeypatch):
    calls = _counted_kernel(monkeypatch)
    ids = _prompt()
    generate(model, ids, max_new_tokens=4, eos_token_id=(), decode_kernel=False)
    assert calls == []
    out = generate(model, ids, max_new_tokens=4, eos_token_id=())
    # 3 decode steps of 3 rows (the prefill and the first token need no kernel)
    assert calls == [3] * (3 * len(_linears(model)))
    assert torch.equal(out, generate(model, ids, max_new_tokens=4, eos_token_id=(),
                                     decode_kernel=False))


def test_the_kernel_switch_never_outlives_its_block(model):
    generate(model, _prompt(), max_new_tokens=3, eos_token_id=())
    assert all("forward" not in m.__dict__ for m in _linears(model))
    with pytest.raises(RuntimeError, match="inside"), _kernel_products(model):
        assert all("forward" in m.__dict__ for m in _linears(model)) or not kernels.available()
        raise RuntimeError("inside")
    assert all("forward" not in m.__dict__ for m in _linears(model))


def test_without_the_kernel_generation_uses_torch(model, monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    ids = _prompt()
    with _kernel_products(model):
        assert all("forward" not in m.__dict__ for m in _linears(model))
    out = generate(model, ids, max_new_tokens=4, eos_token_id=())
    assert torch.equal(out, generate(model, ids, max_new_tokens=4, eos_token_id=(),
                                     decode_kernel=False))
