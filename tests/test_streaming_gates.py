"""DuoAttention's gates (`headlab.importance.duo`) and `--demote-by gates`.

Equivalence: the gated mix with every gate at 1 is the model as it came, and with some
gates at 0 the model with those groups demoted (float64, GQA, MQA and MHA with a W_O
bias). Invariants: training is deterministic for a seed, and a resumed run continues
exactly; on a model where one group alone reads anything (the others' values are zero,
so their sink + window output is their full one) that group keeps the highest gate and
is the one kept. A run with `--demote-by gates` records the gates and demotes the
groups whose gates are lowest; bad input is refused in one line.

Shape notation: L layers, H_kv key/value heads, U = L x H_kv gates, D head dim.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from _cli import cli
from torch.testing import assert_close

import headlab
from headlab._util.checkpoint import Checkpoint
from headlab.data.texts import load_texts
from headlab.errors import UserError
from headlab.importance.duo import mixed, passkey_prompt, streaming_gates
from headlab.objectives import make_blocks
from headlab.pruning import copy_model, demote
from headlab.runs.config import RunConfig
from headlab.selection import PrunePlan, kv_groups, select_groups

TIGHT = {"rtol": 1e-6, "atol": 1e-6}  # the bound, float64 maths
SINKS, WINDOW = 2, 22  # prompts of 4 x 24 = 96 tokens


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory, bpe_tokenizer):
    """A random Llama, 2 layers x 4 query heads over one key/value head."""
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=len(bpe_tokenizer), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=128, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-mqa-llama")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    bpe_tokenizer.save_pretrained(path)
    return path


def _blocks(model):
    return make_blocks(load_texts(), model.tokenizer, kind="causal-lm", seq_len=32,
                       max_tokens=256)


@pytest.mark.parametrize("layout", ["gqa", "mqa", "mha"])
def test_the_mix_is_the_full_model_at_one_and_the_demoted_model_at_zero(
        layout, gqa_dir, mqa_dir, tiny_gpt2_dir):
    path = {"gqa": gqa_dir, "mqa": mqa_dir, "mha": tiny_gpt2_dir}[layout]
    model = headlab.load(path).double()
    n = sum(a.n_kv_heads for a in model.attentions)
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 33:] = 0  # right padding
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits  # (B, S, V)
        with mixed(model, torch.ones(n), sinks=2, window=5):
            at_one = model(ids, attention_mask=mask).logits
        # the first gate of each layer at 0: the first group of each layer demoted
        alpha, heads, offset = torch.ones(n), {}, 0
        for layer, (a, groups) in enumerate(zip(model.attentions, kv_groups(model),
                                                strict=True)):
            alpha[offset] = 0.0
            offset += a.n_kv_heads
            heads[layer] = groups[0]
        with mixed(model, alpha, sinks=2, window=5):
            at_zero = model(ids, attention_mask=mask).logits
        every = {i: list(range(model.n_original_heads)) for i in range(model.n_layers)}
        plan = PrunePlan(every, {i: [] for i in every}, heads)
        demoted = demote(copy_model(model), plan, sinks=2, window=5)
        want = demoted(ids, attention_mask=mask).logits
    assert_close(at_one, full, **TIGHT)
    assert_close(at_zero, want, **TIGHT)
    assert (want - full).abs().max() > 1e-3  # demotion changes the output at 40 tokens
    assert all(a.gate_override is None and a.streaming is None for a in model.attentions)


def test_a_prompt_holds_the_fact_before_the_question_and_its_answer(gqa_dir):
    model = headlab.load(gqa_dir)
    tok = model.tokenizer
    stream = _blocks(model).input_ids.flatten()
    ids, rows = passkey_prompt(stream, tok, length=96,
                               generator=torch.Generator().manual_seed(3))
    assert ids.shape == (96,)
    text = tok.decode(ids)
    value = tok.decode(ids[rows.start + 1:]).strip()
    assert len(value) == 5 and value.isdigit()
    assert f"The pass key is {value}. Remember it." in text
    assert text.endswith(f"What is the pass key? The pass key is {value}")
    assert rows.stop - rows.start == len(ids) - rows.start - 1  # every answer token


def test_training_is_deterministic_and_resumes_exactly(gqa_dir, tmp_path, monkeypatch):
    model = headlab.load(gqa_dir)
    blocks = _blocks(model)
    kw = {"sinks": SINKS, "window": WINDOW, "seed": 5}
    first = streaming_gates(model, blocks, steps=6, **kw)
    second = streaming_gates(model, blocks, steps=6, **kw)
    assert first.extra["alphas"] == second.extra["alphas"]
    assert first.scores == second.scores
    # 3 steps saved, then the run asked for 6 continues from them: 3 prompts more
    checkpoint = Checkpoint(tmp_path, every=1)
    streaming_gates(model, blocks, steps=3, checkpoint=checkpoint, **kw)
    drawn = []

    def counted(*args, **kwargs):
        drawn.append(1)
        return passkey_prompt(*args, **kwargs)

    monkeypatch.setattr("headlab.importance.duo.passkey_prompt", counted)
    resumed = streaming_gates(model, blocks, steps=6, checkpoint=checkpoint, **kw)
    assert resumed.extra["alphas"] == first.extra["alphas"]
    assert len(drawn) == 3
    alphas = torch.tensor(first.extra["alphas"])  # (L, H_kv)
    assert alphas.shape == (2, 3)
    assert bool(((alphas >= 0) & (alphas <= 1)).all())
    assert bool((alphas < 1).any())  # the gates moved
    # every head carries its group's gate (groups of two heads)
    t = first.tensor()  # (L, H)
    assert_close(t[:, 0::2], alphas.double(), rtol=0, atol=0)
    assert_close(t[:, 1::2], alphas.double(), rtol=0, atol=0)


def test_the_one_group_that_reads_keeps_the_highest_gate(gqa_dir):
    """Every key/value head's values zeroed but layer 1's group 2, its W_O columns
    scaled up: the other groups output 0 with full or sink + window attention alike, so
    only the L1 penalty moves their gates; that group's streaming output differs."""
    model = headlab.load(gqa_dir)
    D = model.attentions[0].head_dim
    with torch.no_grad():
        for layer, a in enumerate(model.attentions):
            for kv in range(a.n_kv_heads):
                if (layer, kv) != (1, 2):
                    a.v_proj.weight[kv * D:(kv + 1) * D] = 0.0
            if layer == 1:
                a.o_proj.weight[:, 4 * D:] *= 5.0  # query heads 4 and 5 read kv head 2
    s = streaming_gates(model, _blocks(model), sinks=SINKS, window=WINDOW, steps=30)
    alphas = torch.tensor(s.extra["alphas"])  # (L, H_kv)
    others = torch.cat([alphas[0], alphas[1, :2]])
    assert float(alphas[1, 2]) > 0.9
    assert float(others.max()) == 0.0  # pulled down by the penalty alone
    plan = select_groups(s, kv_groups(model), 1, group_score="max")
    assert plan.kept == {0: [], 1: [4, 5]}


def test_an_encoder_has_no_gates_to_train(tmp_path, bpe_tokenizer):
    cfg = transformers.BertConfig(vocab_size=len(bpe_tokenizer), hidden_size=32,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    transformers.BertModel(cfg).eval().save_pretrained(tmp_path)
    bpe_tokenizer.save_pretrained(tmp_path)
    model = headlab.load(tmp_path)
    blocks = make_blocks(load_texts(), model.tokenizer, kind=model.kind, seq_len=16,
                         max_tokens=64)
    with pytest.raises(UserError, match="causal language model"):
        streaming_gates(model, blocks, steps=1)


@pytest.mark.parametrize(("kw", "match"), [
    ({"demote_by": "gates"}, "add --demote"),
    ({"demote": True, "demote_by": "gates", "gate_reg": -0.1}, "--gate-reg must be"),
    ({"demote": True, "demote_by": "gates", "gate_steps": 0}, "--gate-steps"),
    ({"demote": True, "demote_by": "gates", "gate_lr": 0.0}, "--gate-lr"),
])
def test_bad_gate_options_say_what_to_do(kw, match):
    with pytest.raises(UserError, match=match):
        RunConfig(model="m", unit="kv-group", kv_keep=0.5, **kw).validated()


def test_prompts_too_short_for_the_fact_say_so(gqa_dir):
    model = headlab.load(gqa_dir)
    with pytest.raises(UserError, match="give --window W"):
        streaming_gates(model, _blocks(model), sinks=1, window=4, steps=1)


def test_demote_by_gates_records_the_gates_and_demotes_the_lowest(gqa_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = cli(capsys, "prune", "-m", str(gqa_dir), "--unit", "kv-group",
                       "--kv-keep", "0.5", "--demote", "--demote-by", "gates", "--sinks",
                       str(SINKS), "--window", str(WINDOW), "--gate-steps", "8",
                       "--max-tokens", "512", "--seq-len", "32", "--recover", "none",
                       "--out", str(out), "--quiet")
    assert code == 0, err
    data = json.loads((out / "results.json").read_text())
    kv = data["kv_cache"]
    assert headlab.RunResult.from_json(data).kv_cache.alphas == kv["alphas"]  # read back
    assert kv["selection"] == "gates"
    alphas = kv["alphas"]  # (L, H_kv)
    assert len(alphas) == 2 and all(len(row) == 3 for row in alphas)
    assert all(0.0 <= a <= 1.0 for row in alphas for a in row)
    # the 3 groups (of 6) with the lowest gates are demoted, as stable sorting orders ties
    ranked = sorted(((a, layer, g) for layer, row in enumerate(alphas)
                     for g, a in enumerate(row)), key=lambda x: -x[0])
    lowest = {}
    for _, layer, g in ranked[3:]:
        lowest[layer] = sorted(lowest.get(layer, []) + [2 * g, 2 * g + 1])
    assert {int(k): v for k, v in kv["demoted"].items()} == lowest
    html = (out / "report.html").read_text()
    flat = [a for row in alphas for a in row]
    assert f"chosen by gates, kv-group; gate alphas {min(flat):.2f} to {max(flat):.2f}" in html
    # the run's scores are the gates: each head carries its group's alpha, no michel ran
    assert data["method"] == "gates" and data["schedule"] == "one-shot"
    assert [row[h // 2] for row in alphas for h in range(6)] == pytest.approx(
        [v for row in data["importance"] for v in row], abs=1e-6)
