"""Tests for headlab.data.protocol: calibration and evaluation sets the papers' way.

References: the windows perplexity recomputed directly with transformers' GPT-2 in
float64 (non-overlapping windows of the joined text, mean token loss); the windows
rebuilt from the tokenizer by hand. Invariants: calibration windows are seeded, do not
overlap, and share no document with the evaluation windows when both come from one
source. Errors name the limit or the count the data holds.

Shape notation: N windows, L window length, V vocabulary.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.testing import assert_close
from typer.testing import CliRunner

from headlab.cli import app
from headlab.data.protocol import (
    Settings,
    calibration_windows,
    eval_seq_len_for,
    evaluation_windows,
    split_documents,
)
from headlab.data.texts import TextData, load_texts
from headlab.errors import DataError, UserError
from headlab.evaluate.quality import evaluate
from headlab.runs.inputs import build_sets

WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "grove", "heron", "iris",
         "juniper", "kelp", "lumen", "maple", "nectar", "onyx", "pine")


def _marked_documents(n: int) -> TextData:
    """n documents, each saying its own number many times, so a window's document can
    be read back from its text."""
    gen = torch.Generator().manual_seed(1)
    texts = []
    for i in range(n):
        words = [WORDS[j] for j in torch.randint(0, len(WORDS), (30,), generator=gen).tolist()]
        texts.append(" ".join(f"doc{i:03d} {w}" for w in words))
    return TextData(texts, spec="marked")


def _doc_ids(tokenizer, blocks) -> set[str]:
    found = set()
    for row in blocks.input_ids:
        found |= set(re.findall(r"doc(\d{3}) ", tokenizer.decode(row.tolist())))
    return found


def test_windows_perplexity_equals_a_direct_computation(tiny_gpt2, tiny_gpt2_dir):
    tok = tiny_gpt2.tokenizer
    data = load_texts()
    blocks = evaluation_windows(data, tok, seq_len=64, max_windows=12)
    assert blocks.input_ids.shape == (12, 64)
    q = evaluate(tiny_gpt2, blocks, batch_size=5)

    # direct: the joined text tokenised once, windows j*L..(j+1)*L, transformers' GPT-2
    ids = torch.tensor(tok("\n\n".join(data.texts))["input_ids"])
    hf = transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2_dir).eval()
    nll = []
    with torch.no_grad():
        for j in range(12):
            window = ids[j * 64:(j + 1) * 64][None]  # (1, L)
            logits = hf(window).logits.double()  # (1, L, V)
            nll.append(F.cross_entropy(logits[0, :-1], window[0, 1:], reduction="none"))
    direct = torch.cat(nll).mean()
    assert_close(torch.tensor(q.loss, dtype=torch.float64), direct, rtol=1e-5, atol=1e-6)
    assert_close(q.value, math.exp(direct.item()), rtol=1e-5, atol=0.0)
    assert q.n_tokens == 12 * 64


def test_evaluation_windows_are_the_joined_text_cut_in_order(bpe_tokenizer):
    data = TextData(["one two three.", "four five.", "six seven eight nine."], spec="t")
    ids = bpe_tokenizer("one two three.\n\nfour five.\n\nsix seven eight nine.")["input_ids"]
    blocks = evaluation_windows(data, bpe_tokenizer, seq_len=4)
    n = len(ids) // 4
    assert blocks.input_ids.tolist() == [ids[4 * j:4 * j + 4] for j in range(n)]
    with pytest.raises(DataError, match="do not fill one evaluation window of 4096"):
        evaluation_windows(data, bpe_tokenizer, seq_len=4096)


def test_calibration_windows_are_seeded_disjoint_slices_of_the_stream(bpe_tokenizer):
    data = load_texts()
    a = calibration_windows(data, bpe_tokenizer, n_samples=16, seq_len=32, seed=0)
    b = calibration_windows(data, bpe_tokenizer, n_samples=16, seq_len=32, seed=0)
    c = calibration_windows(data, bpe_tokenizer, n_samples=16, seq_len=32, seed=1)
    assert a.input_ids.shape == (16, 32)
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    # every window is a run of one document's tokens (or spans a document end)
    whole = set()
    for text in data.texts:
        ids = bpe_tokenizer(text, add_special_tokens=False)["input_ids"]
        whole |= {tuple(ids[i:i + 8]) for i in range(len(ids) - 7)}
    for row in a.input_ids.tolist():
        assert tuple(row[:8]) in whole or bpe_tokenizer.eos_token_id in row[:8]
    # no two windows share a token position: distinct rows of distinct n-grams
    assert len({tuple(r) for r in a.input_ids.tolist()}) == 16


def test_calibration_asking_more_than_the_data_holds_says_how_many(bpe_tokenizer):
    data = TextData(["a short text of a few words."] * 3, spec="tiny.txt")
    n_tokens = 3 * (len(bpe_tokenizer(data.texts[0])["input_ids"]) + 1)
    with pytest.raises(DataError, match=rf"holds {n_tokens} tokens, {n_tokens // 8} windows "
                                        r"of 8; --calib-samples 50 asks for more"):
        calibration_windows(data, bpe_tokenizer, n_samples=50, seq_len=8)


def test_one_source_calibration_and_evaluation_share_no_document(bpe_tokenizer):
    data = _marked_documents(40)
    settings = Settings(kind="causal-lm", seq_len=16, max_tokens=10_000, seed=3,
                        calib_samples=12, eval_protocol="windows", eval_seq_len=32)
    calib, held = build_sets(settings, bpe_tokenizer, data, None)
    calib_docs, held_docs = _doc_ids(bpe_tokenizer, calib), _doc_ids(bpe_tokenizer, held)
    assert calib_docs and held_docs
    assert not calib_docs & held_docs
    calib_part, held_part = split_documents(data, heldout=0.5, seed=3)
    assert len(calib_part.texts) == 20 and len(held_part.texts) == 20
    assert not set(calib_part.texts) & set(held_part.texts)
    with pytest.raises(DataError, match="cannot be split"):
        split_documents(TextData(["only one"], spec="one"), heldout=0.5, seed=0)


def test_window_protocol_refuses_other_kinds_and_lengths_above_the_limit(bpe_tokenizer):
    with pytest.raises(UserError, match="limit of 1024 positions; give at most 1024"):
        eval_seq_len_for(2048, 1024)
    assert eval_seq_len_for(None, 8192) == 2048 and eval_seq_len_for(None, 128) == 128
    with pytest.raises(UserError, match="causal language models' protocol"):
        build_sets(Settings(kind="classifier", seq_len=16, max_tokens=100,
                            eval_protocol="windows"), bpe_tokenizer, _marked_documents(4), None)


def test_run_records_how_calibration_and_evaluation_are_kept_apart(tiny_gpt2_dir, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(app, [
        "score", "--model", str(tiny_gpt2_dir), "--method", "random", "--calib-samples", "4",
        "--calib-seq-len", "32", "--eval-protocol", "windows", "--eval-seq-len", "64",
        "--max-tokens", "512", "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "results.json").read_text())["data"]
    assert data["scoring_examples"] == 4 and data["calib_seq_len"] == 32
    assert data["eval_protocol"] == "windows" and data["eval_seq_len"] == 64
    assert data["heldout_examples"] == 512 // 64
    assert "no document is in both" in data["separation"]


@pytest.mark.parametrize("args, message", [
    (["--eval-protocol", "windows", "--eval-seq-len", "4096"],
     "--eval-seq-len 4096 is beyond the 128 positions of"),
    (["--calib-samples", "100000"], "--calib-samples 100000 asks for more: give at most"),
    (["--eval-seq-len", "64"], "give --eval-protocol windows too"),
])
def test_bad_protocol_input_is_one_line(tiny_gpt2_dir, tmp_path, args, message):
    res = CliRunner().invoke(app, ["score", "--model", str(tiny_gpt2_dir), "--method", "random",
                                   "--out", str(tmp_path / "r"), "--quiet", *args])
    assert res.exit_code == 2
    assert message in res.output
    assert not (tmp_path / "r").exists()

