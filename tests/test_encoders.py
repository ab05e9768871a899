"""Tests for the encoder families beside BERT (headlab.models.roberta, ...): each rebuilt
model computes what transformers' computes.

References: random-weight checkpoints of every head (encoder, MLM, classifier) written
by transformers (tests/_encoders.py), compared in float32 with and without padding,
per-layer attention weights against eager ``output_attentions``; Michel scores against
per-example autograd on fresh gate leaves. Equivalences: save -> load, pruned == gated.

Shape notation: B batch, S sequence length, H heads, E model dim, V vocabulary, C classes.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from _encoders import FAMILIES, VOCAB, batch, load_hf, write_checkpoint
from _gates import gate_leaves
from torch.testing import assert_close

from headlab.attention.hooks import capture
from headlab.data.blocks import Blocks
from headlab.errors import UserError
from headlab.importance import score
from headlab.models import load
from headlab.models.export import export_hf

F32 = torch.float32
HEADS = ("encoder", "mlm", "classifier")
KINDS = {"encoder": "embedding", "mlm": "masked-lm", "classifier": "classifier"}
NAMES = sorted(FAMILIES)


def _run(model, ids, mask):
    with torch.no_grad():
        out = model(ids, mask)
    return out.logits if out.logits is not None else out.embeddings


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "full"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("family", NAMES)
def test_matches_transformers(tmp_path, family, head, padded):
    directory = write_checkpoint(tmp_path, family, head)
    model = load(directory, tokenizer=False)
    assert (model.family, model.kind) == (FAMILIES[family].name.replace("xlm-", ""), KINDS[head])
    hf = load_hf(directory, family, head, impl="sdpa")
    ids, mask = batch(family, padded=padded)
    valid = mask.bool()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        out = model(ids, mask)
    hidden = ref.hidden_states[-1]
    assert_close(out.last_hidden_state[valid], hidden[valid], atol=1e-4, rtol=0)
    if head == "mlm":
        assert out.logits.shape == (4, ids.shape[1], VOCAB)
        assert_close(out.logits[valid], ref.logits[valid], atol=1e-4, rtol=0)
    elif head == "classifier":
        assert out.logits.shape == (4, 3)
        assert_close(out.logits, ref.logits, atol=1e-4, rtol=0)
    else:
        m = mask[..., None].to(F32)
        assert_close(out.embeddings, (hidden * m).sum(1) / m.sum(1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", NAMES)
def test_attention_patterns_match_eager_output_attentions(tmp_path, family):
    directory = write_checkpoint(tmp_path, family, "mlm")
    model = load(directory, tokenizer=False)
    hf = load_hf(directory, family, "mlm", impl="eager")
    ids, mask = batch(family)
    valid = mask.bool()
    captured: dict[int, torch.Tensor] = {}
    handles = [b.attn.pattern.register_forward_hook(
        lambda _m, _i, out, i=i: captured.__setitem__(i, out.detach()))
        for i, b in enumerate(model.blocks)]
    try:
        with torch.no_grad():
            model(ids, mask)
            ref = hf(input_ids=ids, attention_mask=mask, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    assert sorted(captured) == list(range(model.n_layers))
    for i, weights in captured.items():
        assert weights.shape == (4, model.heads_per_layer[i], *ids.shape[1:], ids.shape[1])
        ours, theirs = weights.transpose(1, 2)[valid], ref.attentions[i].transpose(1, 2)[valid]
        assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("family", NAMES)
def test_save_load_and_pruned_equals_gated(tmp_path, family, head):
    model = load(write_checkpoint(tmp_path, family, head), tokenizer=False)
    ids, mask = batch(family)
    before = _run(model, ids, mask)
    reloaded = load(model.save(tmp_path / "saved"), tokenizer=False)
    assert (reloaded.family, reloaded.kind) == (model.family, model.kind)
    assert_close(_run(reloaded, ids, mask), before, atol=0, rtol=0)

    plan = {0: [1, 3], 1: list(range(model.n_original_heads))}  # layer 1 loses all
    gated = copy.deepcopy(model)
    gated.mask_heads(plan)
    model.prune_heads(plan)
    assert model.heads_per_layer[:2] == [model.n_original_heads - 2, 0]
    pruned = _run(model, ids, mask)
    assert_close(pruned, _run(gated, ids, mask), atol=1e-5, rtol=0)
    assert not torch.allclose(pruned, before, atol=1e-4)
    reloaded = load(model.save(tmp_path / "pruned"), tokenizer=False)
    assert reloaded.head_ids() == model.head_ids()
    assert_close(_run(reloaded, ids, mask), pruned, atol=0, rtol=0)


def _mlm_blocks(family: str) -> Blocks:
    """Padded blocks with 2-3 masked-token labels per row (-100 elsewhere)."""
    ids, mask = batch(family, seed=3)
    labels = torch.full_like(ids, -100)
    for row, cols in enumerate([[1, 5, 9], [2, 4], [6, 8, 10], [0]]):
        labels[row, cols] = ids[row, cols]
    return Blocks(ids, mask, labels, "test")


def _example_loss(model, ids, mask, labels) -> torch.Tensor:
    """One example's loss written out with torch: the mean NLL of its masked tokens
    (labels (S,), -100 = unscored), or the cross-entropy of its class (labels ())."""
    logits = model(ids[None], mask[None]).logits[0]  # (S, V) or (C,)
    if labels.dim() == 0:
        return -logits.log_softmax(-1)[labels]
    scored = labels != -100
    return -logits[scored].log_softmax(-1).gather(-1, labels[scored, None]).mean()


@pytest.mark.parametrize(("family", "head"), [*((f, "mlm") for f in NAMES),
                                              ("distilbert", "classifier"),
                                              ("modernbert", "classifier")])
def test_michel_equals_per_example_brute_force(tmp_path, family, head):
    model = load(write_checkpoint(tmp_path, family, head, std=0.1), tokenizer=False)
    blocks = _mlm_blocks(family)
    if head == "classifier":
        blocks = Blocks(blocks.input_ids, blocks.attention_mask, torch.tensor([0, 2, 1, 2]))
    expected = []
    for ids, mask, labels in zip(blocks.input_ids, blocks.attention_mask, blocks.labels,
                                 strict=True):
        with gate_leaves(model) as gates:
            _example_loss(model, ids, mask, labels).backward()
        expected.append(torch.stack([g.grad.double().abs() for g in gates]))  # (L, H)
    michel = score(model, blocks, method="michel", batch_size=3, normalize=False)
    assert_close(michel.tensor(), torch.stack(expected).mean(0), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("family", NAMES)
def test_hf_export_is_refused_with_the_reason(tmp_path, family):
    model = load(write_checkpoint(tmp_path, family, "mlm"), tokenizer=False)
    with pytest.raises(UserError, match="head size"):
        export_hf(model, tmp_path / "hf")


# ---------------------------------------------------------------------- ModernBERT
@pytest.mark.parametrize("head", ["mlm", "classifier"])
def test_modernbert_with_biases_and_mean_pooling_matches_transformers(tmp_path, head):
    """Every optional bias on, the classifier pooling the mean, a sequence of 20 tokens
    over local windows of 2 either side."""
    directory = write_checkpoint(
        tmp_path, "modernbert", head, attention_bias=True, mlp_bias=True, norm_bias=True,
        classifier_bias=True, classifier_pooling="mean", classifier_activation="silu")
    model = load(directory, tokenizer=False)
    hf = load_hf(directory, "modernbert", head, impl="sdpa")
    ids, mask = batch("modernbert", length=20)
    valid = mask.bool()
    with torch.no_grad():
        out, ref = model(ids, mask), hf(input_ids=ids, attention_mask=mask)
    got, want = (out.logits[valid], ref.logits[valid]) if head == "mlm" else (out.logits,
                                                                               ref.logits)
    assert_close(got, want, atol=1e-4, rtol=0)


def test_modernbert_v4_config_keys_give_the_same_model(tmp_path):
    """A config.json as the hub's ModernBERT checkpoints have it (transformers v4:
    global_attn_every_n_layers, global_rope_theta, local_rope_theta, no layer_types)."""
    directory = write_checkpoint(tmp_path, "modernbert", "mlm")
    cfg_file = directory / "config.json"
    cfg = json.loads(cfg_file.read_text())
    for key in ("layer_types", "rope_parameters"):
        cfg.pop(key)
    cfg.update(global_attn_every_n_layers=2, global_rope_theta=5000.0, local_rope_theta=300.0)
    cfg_file.write_text(json.dumps(cfg))
    model = load(directory, tokenizer=False)
    assert model.config.layer_types == ["full_attention", "sliding_attention", "full_attention"]
    assert (model.config.global_rope_theta, model.config.local_rope_theta) == (5000.0, 300.0)
    hf = load_hf(directory, "modernbert", "mlm", impl="eager")
    ids, mask = batch("modernbert")
    valid = mask.bool()
    with torch.no_grad():
        out, ref = model(ids, mask), hf(input_ids=ids, attention_mask=mask)
    assert_close(out.logits[valid], ref.logits[valid], atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- padding, errors
@pytest.mark.parametrize("family", NAMES)
def test_a_right_padded_row_equals_the_row_alone(tmp_path, family):
    """Padding changes nothing for the real tokens (what transformers' unpadded
    ModernBERT path computes): row 1 has 7 real tokens then padding."""
    model = load(write_checkpoint(tmp_path, family, "mlm"), tokenizer=False)
    ids, mask = batch(family)
    n = int(mask[1].sum())
    with torch.no_grad():
        padded = model(ids, mask).logits[1, :n]
        alone = model(ids[1:2, :n]).logits[0]
    assert_close(padded, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("roberta", {"pad_token_id": None}, "pad_token_id"),
        ("roberta", {"architectures": ["RobertaForCausalLM"]}, "RobertaForCausalLM"),
        ("roberta", {"model_type": "bert"}, "not one of"),
        ("distilbert", {"activation": "mish"}, "mish"),
        ("distilbert", {"architectures": ["DistilBertForQuestionAnswering"]},
         "DistilBertForQuestionAnswering"),
        ("modernbert", {"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "yarn"),
        ("modernbert", {"layer_types": ["full_attention"]}, "layer_types"),
        ("modernbert", {"classifier_pooling": "max"}, "classifier_pooling"),
        ("modernbert", {"hidden_activation": "mish"}, "mish"),
    ],
)
def test_unsupported_configs_are_refused(family, change, message):
    from headlab.models import registry

    hf = FAMILIES[family].hf_config()
    with pytest.raises(ValueError, match=message):
        registry.by_hf_type(hf.model_type).from_hf({**hf.to_dict(), **change}, {})


@pytest.mark.parametrize("family", NAMES)
def test_unknown_keys_pass_missing_tensor_and_long_input_are_named(tmp_path, family):
    from safetensors.torch import load_file, save_file

    directory = write_checkpoint(tmp_path, family, "classifier")
    cfg_file = directory / "config.json"  # a key no headlab version knows is ignored
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "future_key": 1}))
    model = load(directory, tokenizer=False)
    with pytest.raises(ValueError, match="positions"):
        model(torch.full((1, model.max_positions + 1), 5))
    file = directory / "model.safetensors"
    state = load_file(str(file))
    gone = sorted(k for k in state if "layer" in k and "1." in k)[0]
    del state[gone]
    save_file(state, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
        load(directory, tokenizer=False)


@pytest.mark.parametrize("family", NAMES)
def test_block_inputs_replay_the_forward(tmp_path, family):
    """What layer-wise recovery runs: the blocks one by one from `block_inputs` give the
    forward's residual stream, and ``attention(i, h)`` its attention output."""
    model = load(write_checkpoint(tmp_path, family, "mlm"), tokenizer=False)
    ids, mask = batch(family)
    with capture(model, ["out", "resid_post"]) as cap, torch.no_grad():
        model(ids, mask)
    with torch.no_grad():
        x = model.block_inputs(ids, mask)
        h = x.hidden
        for i in range(model.n_layers):
            assert_close(x.attention(i, h), cap[f"blocks.{i}.attn.out"], atol=0, rtol=0)
            h = x.block(i, h)
            assert_close(h, cap[f"blocks.{i}.resid_post"], atol=0, rtol=0)
