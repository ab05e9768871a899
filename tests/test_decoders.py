"""The decoder families on headlab's attention, each against transformers itself:
Qwen2, Qwen3, Mistral, Gemma-2, Gemma-3 (text), Phi-3, GPT-NeoX (parallel and
sequential residual), OLMo-2.

Every case is a random-weight checkpoint that transformers builds and writes with
``save_pretrained`` (2 layers, E = 64, float32; the configs live in _families.py), read
back with ``headlab.load``.
Windowed families slide a window of 4 over prompts of 12 tokens, so the window cuts.
Shape notation: B batch, S sequence, H heads, T keys, V vocabulary.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from _families import DECODER_SIZE as _SMALL
from _families import DECODERS as CASES
from _families import write_decoder as _checkpoint
from _gates import gate_leaves
from torch.testing import assert_close

from headlab.models import load
from headlab.models.export import export_hf, hf_expressible

LOGITS = {"rtol": 0.0, "atol": 1e-4}  # float32 logits against transformers
WEIGHTS = {"rtol": 0.0, "atol": 1e-5}  # attention weights; cache vs recompute; gate vs prune
GRAD = {"rtol": 1e-4, "atol": 1e-9}  # the same float32 gradients, batched differently

WINDOWED = {"qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"}
# the pruned shape has no HF config, or the norm spans the pruned heads (module docs)
NO_EXPORT = {"neox", "neox-sequential"}
PRUNE_IS_NOT_GATE = {"olmo2"}


def _hf(directory: str):
    return tf.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float32).eval()


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
    """(case, checkpoint dir, headlab model, transformers model) per family."""
    directory = _checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, directory, load(directory, tokenizer=False), _hf(directory)


def _patterns(model, ids, mask) -> dict[int, torch.Tensor]:
    captured: dict[int, torch.Tensor] = {}
    handles = [block.attn.pattern.register_forward_hook(
        lambda _m, _i, out, layer=i: captured.__setitem__(layer, out))
        for i, block in enumerate(model.blocks)]
    try:
        with torch.no_grad():
            model(ids, mask)
    finally:
        for h in handles:
            h.remove()
    return captured


# ---------------------------------------------------------------------- references
def test_logits_and_patterns_match_transformers(pair):
    case, _, model, hf = pair
    ids, mask = _batch()
    valid = mask.bool()  # padded query positions are not compared
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, output_attentions=True)
        assert_close(model(ids, mask).logits[valid], expected.logits[valid], **LOGITS)
        assert_close(model(ids).logits, hf(ids).logits, **LOGITS)  # no padding
    patterns = _patterns(model, ids, mask)
    assert len(patterns) == len(expected.attentions) == 2
    for layer, ref in enumerate(expected.attentions):  # (B, H, S, T) each
        got = patterns[layer]
        assert got.shape == ref.shape
        assert_close(got.transpose(1, 2)[valid], ref.transpose(1, 2)[valid], **WEIGHTS)
    if case in WINDOWED:  # the window is shorter than the prompt
        assert model.config.sliding_window == 4 < ids.shape[1]


def test_hooks_have_the_shared_names_and_shapes(pair):
    """Every hook of every block, at the names and shapes all headlab models share; the
    residual stream after block 0 equals transformers' hidden state after layer 0."""
    from headlab.attention.hooks import capture

    _, _, model, hf = pair
    ids, _ = _batch()
    B, S = ids.shape
    H, H_kv, D, E = (model.n_original_heads, model.kv_heads_per_layer[0], model.head_dim,
                     model.config.hidden_size)
    names = ["q", "k", "v", "scores", "pattern", "z", "out"]
    with capture(model, [f"blocks.*.attn.{n}" for n in names] + ["blocks.*.resid_post"]) as cap, \
            torch.no_grad():
        model(ids)
        expected = hf(ids, output_hidden_states=True).hidden_states
    shapes = {"q": (B, S, H, D), "k": (B, S, H_kv, D), "v": (B, S, H_kv, D),
              "scores": (B, H, S, S), "pattern": (B, H, S, S), "z": (B, S, H, D),
              "out": (B, S, E)}
    for layer in range(2):
        for name, shape in shapes.items():
            assert tuple(cap[f"blocks.{layer}.attn.{name}"].shape) == shape, name
    attn = model.blocks[0].attn
    assert_close(cap["blocks.0.attn.out"], attn.o_proj(cap["blocks.0.attn.z"].flatten(2)),
                 **WEIGHTS)
    assert_close(cap["blocks.0.resid_post"], expected[1], **LOGITS)


def test_cached_decoding_equals_recompute(pair):
    _, _, model, _ = pair
    ids, _ = _batch()
    ids = ids[:2]
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding rides along in the cache
    cache = model.new_cache()
    with torch.no_grad():
        step = model(ids[:, :5], mask[:, :5], cache=cache).logits[:, -1]
        for t in range(5, ids.shape[1] + 1):
            full = model(ids[:, :t], mask[:, :t]).logits[:, -1]
            assert_close(step, full, **WEIGHTS)
            if t < ids.shape[1]:
                step = model(ids[:, t:t + 1], mask[:, :t + 1], cache=cache).logits[:, -1]
    assert cache.length == ids.shape[1]


# the default run generates with three families that cover windows in the cache (on
# every layer and on alternate ones), soft-capping and partial rotary; the slow run: all
_QUICK_GENERATION = {"mistral", "gemma2", "phi3"}


@pytest.mark.parametrize("case", [c if c in _QUICK_GENERATION else
                                  pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_greedy_generation_matches_transformers(case, tmp_path):
    directory = _checkpoint(tmp_path, case)
    model, hf = load(directory, tokenizer=False), _hf(directory)
    ids, _ = _batch()
    prompt = ids[:1, :6]  # 6 + 32 tokens: the window slides on through the cache
    expected = hf.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                           pad_token_id=0)
    got = model.generate(prompt, max_new_tokens=32, eos_token_id=())
    assert got.shape == (1, 38)
    assert torch.equal(got, expected)


def test_multimodal_gemma3_checkpoint_loads_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint: the text model under its prefix,
    the vision tower and projector ignored; text-only logits equal transformers'."""
    _, _, extra = CASES["gemma3"]
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = tf.Gemma3Config(text_config={**_SMALL, **extra}, vision_config=vision,
                          mm_tokens_per_image=4, image_token_index=100, boi_token_index=98,
                          eoi_token_index=99)
    torch.manual_seed(0)
    hf = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path)
    model = load(tmp_path, tokenizer=False)
    assert model.family == "gemma3" and model.n_layers == 2
    ids, mask = _batch()
    ids = ids.clamp(max=90)  # text tokens only: no image, boi or eoi token
    valid = mask.bool()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits[valid]
        assert_close(model(ids, mask).logits[valid], expected, **LOGITS)


# ---------------------------------------------------------------------- pruning
def test_gated_heads_equal_pruned_heads(pair):
    case, _, model, _ = pair
    ids, mask = _batch()
    valid = mask.bool()
    heads = {0: [0, 3], 1: [1]}
    gated, pruned = copy.deepcopy(model), copy.deepcopy(model)
    gated.mask_heads(heads)
    pruned.prune_heads(heads)
    assert pruned.heads_per_layer == [2, 3]
    with torch.no_grad():
        g, p = gated(ids, mask).logits[valid], pruned(ids, mask).logits[valid]
    if case in PRUNE_IS_NOT_GATE:
        # the QK-norm's statistic now runs over the kept heads only: a real difference
        assert (g - p).abs().max() > 1e-3
    else:
        assert_close(p, g, **WEIGHTS)


def test_olmo2_pruned_equals_gated_with_the_norm_over_kept_heads(tmp_path):
    """What does hold for OLMo-2: the pruned layer is the gated layer whose QK-norm
    statistic runs over the kept heads, computed here by hand from the gated model."""
    model = load(_checkpoint(tmp_path, "olmo2"), tokenizer=False)
    ids, mask = _batch()
    pruned = copy.deepcopy(model)
    pruned.prune_heads({0: [0, 1]})  # the whole first group: 2 of 4 heads, 1 of 2 kv
    attn = model.blocks[0].attn
    D = attn.head_dim
    q_keep, kv_keep = torch.arange(2 * D, 4 * D), torch.arange(D, 2 * D)

    def kept_stat(norm, rows):
        def hook(_m, args):
            (x,) = args  # (B, S, H*D): RMS over the kept rows, applied to every row
            rms = x[..., rows].pow(2).mean(-1, keepdim=True).add(norm.eps).rsqrt()
            return norm.weight * (x * rms)
        return hook

    model.mask_heads({0: [0, 1]})
    with torch.no_grad():
        attn.q_norm.forward = lambda x: kept_stat(attn.q_norm, q_keep)(None, (x,))
        attn.k_norm.forward = lambda x: kept_stat(attn.k_norm, kv_keep)(None, (x,))
        assert_close(pruned(ids, mask).logits, model(ids, mask).logits, **WEIGHTS)


def test_export_round_trips_through_transformers(pair, tmp_path):
    case, _, model, _ = pair
    if case in NO_EXPORT:
        assert "hidden_size / num_attention_heads" in hf_expressible(model)
        return
    model = copy.deepcopy(model)
    model.prune_heads({0: [0, 1], 1: [2, 3]})  # a whole GQA group in each layer
    assert hf_expressible(model) is None
    reloaded = _hf(str(export_hf(model, tmp_path / "hf")))
    assert reloaded.config.num_attention_heads == 2
    ids, mask = _batch()
    valid = mask.bool()
    with torch.no_grad():
        assert_close(reloaded(ids, attention_mask=mask).logits[valid],
                     model(ids, mask).logits[valid], **LOGITS)


@pytest.mark.parametrize("case", ["qwen2", "qwen3"])
def test_a_recovered_out_bias_exports_where_the_family_can_hold_one(case, tmp_path):
    """Qwen3's attention_bias switches on all four biases (zeros where none were);
    Qwen2 has biases on Q, K, V and never on W_O, so the export says why not."""
    model = load(_checkpoint(tmp_path / "src", case), tokenizer=False)
    model.prune_heads({0: [0, 1], 1: [0, 1]})
    with torch.no_grad():
        for a in model.attentions:
            a.ensure_out_bias().normal_(0.0, 0.1)
    if case == "qwen2":
        assert "recovery gave W_O a bias" in hf_expressible(model)
        return
    reloaded = _hf(str(export_hf(model, tmp_path / "hf")))
    assert reloaded.config.attention_bias
    ids, mask = _batch()
    valid = mask.bool()
    with torch.no_grad():
        assert_close(reloaded(ids, attention_mask=mask).logits[valid],
                     model(ids, mask).logits[valid], **LOGITS)


@pytest.mark.parametrize("case", ["phi3", "olmo2"])
def test_save_load_round_trip_of_pruned_model(case, tmp_path):
    model = load(_checkpoint(tmp_path / "src", case), tokenizer=False)
    model.prune_heads({0: [1], 1: [0, 1, 2]})
    reloaded = load(model.save(tmp_path / "saved"), tokenizer=False)
    assert type(reloaded) is type(model) and reloaded.heads_per_layer == [3, 1]
    ids, mask = _batch()
    with torch.no_grad():
        assert torch.equal(reloaded(ids, mask).logits, model(ids, mask).logits)


# ---------------------------------------------------------------------- scores
def _per_example_gate_grads(model, examples: torch.Tensor) -> torch.Tensor:
    """dL(x)/d gate for each example x alone: (N, L, H), autograd on (H,) leaves."""
    out = []
    for x in examples:
        with gate_leaves(model) as gates:
            logp = model(x[None]).logits[0, :-1].log_softmax(-1)  # (S-1, V)
            (-logp.gather(-1, x[1:, None]).mean()).backward()
        out.append(torch.stack([g.grad.double() for g in gates]))
    return torch.stack(out)


def test_michel_equals_per_example_brute_force(pair):
    from headlab.data.blocks import Blocks
    from headlab.importance import score

    model = copy.deepcopy(pair[2])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, _SMALL["vocab_size"], (4, 10), generator=g)
    blocks = Blocks(input_ids=ids, attention_mask=torch.ones_like(ids))
    michel = score(model, blocks, method="michel", batch_size=3, normalize=False)
    assert_close(michel.tensor(), _per_example_gate_grads(model, ids).abs().mean(0), **GRAD)


# ---------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(set(CASES) - {"neox-sequential"}))
def test_headlab_prune_runs_end_to_end(case, tmp_path, bpe_tokenizer):
    """`headlab prune --per-layer --export hf` on each family's checkpoint (with a
    tokenizer), with the default lsq repair; report and export included (GPT-NeoX once:
    its sequential wiring is proven above)."""
    import json
    import subprocess
    import sys

    directory = _checkpoint(tmp_path / "ckpt", case, vocab_size=len(bpe_tokenizer))
    bpe_tokenizer.save_pretrained(directory)
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "headlab", "prune", "--model", directory, "--keep", "0.5",
         "--max-tokens", "512", "--seq-len", "32", "--batch-size", "8", "--schedule", "one-shot",
         "--per-layer", "--export", "hf",
         "--out", str(out),
         "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["heads_total"] == 8 and results["heads_kept"] == 4
    assert all(q == q for q in (results["quality"]["before"], results["quality"]["after"]))
    assert (out / "report.html").stat().st_size > 10_000
    pruned = load(out / "model", tokenizer=False)
    assert pruned.heads_per_layer == [len(ids) for ids in results["kept_heads"].values()]
    # HF export where the shape (and lsq's W_O bias) fits the family's config
    reason = hf_expressible(pruned)
    assert (out / "model-hf").is_dir() == (reason is None), reason
    if reason is None:
        ids = torch.randint(0, len(bpe_tokenizer), (2, 12), generator=torch.Generator())
        with torch.no_grad():
            assert_close(_hf(str(out / "model-hf"))(ids).logits, pruned(ids).logits, **LOGITS)


# ---------------------------------------------------------------------- configs
def test_hub_style_configs_read_as_transformers_reads_them():
    """config.json files written by transformers v4 (as on the hub) keep rope keys at
    the top level and leave derived fields out."""
    from headlab.models import gemma, neox, phi3, qwen

    base = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, unknown_key_from_the_future=1)
    pythia = neox.read_config(dict(base, model_type="gpt_neox", rotary_pct=0.25,
                                   rotary_emb_base=10000, use_parallel_residual=True))
    assert (pythia.rotary_dim, pythia.parallel_residual, pythia.norm) == (4, True, "layer")
    qwen25 = qwen.read_config(dict(base, model_type="qwen2", use_sliding_window=False,
                                   sliding_window=32768, max_window_layers=21, rope_theta=1e6))
    assert qwen25.sliding_window is None and set(qwen25.layer_types) == {"full_attention"}
    assert qwen25.rope["full_attention"]["rope_theta"] == 1e6
    off = qwen.read_config(dict(base, model_type="qwen3", use_sliding_window=False,
                                sliding_window=4, layer_types=["sliding_attention"] * 6))
    assert off.sliding_window is None and set(off.layer_types) == {"full_attention"}
    g3 = gemma.read_config(dict(base, model_type="gemma3_text", head_dim=16,
                                rope_theta=1e6, rope_local_base_freq=1e4,
                                rope_scaling={"rope_type": "linear", "factor": 8.0},
                                sliding_window=512, sliding_window_pattern=6))
    assert g3.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert g3.rope["full_attention"] == {"rope_type": "linear", "factor": 8.0,
                                         "rope_theta": 1e6}
    assert g3.rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    assert (g3.attn_softcap, g3.final_softcap, g3.tie_word_embeddings) == (None, None, True)
    g2 = gemma.read_config(dict(base, model_type="gemma2", head_dim=16))
    assert (g2.attn_softcap, g2.final_softcap, g2.query_pre_attn_scalar) == (50.0, 30.0, 256)
    assert g2.layer_types[:2] == ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="longrope"):
        phi3.read_config(dict(base, model_type="phi3",
                              rope_scaling={"type": "longrope", "short_factor": [1.0] * 8}))
    with pytest.raises(ValueError, match="lacks \\['intermediate_size'\\]"):
        qwen.read_config({k: v for k, v in base.items() if k != "intermediate_size"}
                         | {"model_type": "qwen3"})
