"""`headlab prune` end to end on a random-weight MLM checkpoint of each encoder family,
with a tokenizer of the family's special tokens: the run completes, the pruned model
reloads with the kept heads, and the report's sample and token roles use the family's
own [CLS]/[SEP] tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _encoders import bpe_tokenizer, write_mlm_with_tokenizer

import headlab

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
# family -> (special tokens in id order, cls, sep, pad, mask, unk, extra HF config)
TOKENS = {
    "roberta": (["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "<s>", "</s>", "<pad>", "<mask>",
                "<unk>", {"max_position_embeddings": 66}),
    "distilbert": (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "[CLS]", "[SEP]", "[PAD]",
                   "[MASK]", "[UNK]", {"max_position_embeddings": 64}),
    "modernbert": (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "[CLS]", "[SEP]", "[PAD]",
                   "[MASK]", "[UNK]", {"local_attention": 8}),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TOKENS))
def test_prune_runs_and_the_report_names_the_special_tokens(tmp_path, family):
    specials, cls, sep, pad, mask, unk, extra = TOKENS[family]
    tok = bpe_tokenizer(cls=cls, sep=sep, pad=pad, mask=mask, unk=unk, specials=specials)
    directory = write_mlm_with_tokenizer(tmp_path, family, tok, **extra)
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "headlab", "prune", "--model", str(directory), "--keep", "0.5",
         "--max-tokens", "1024", "--seq-len", "32", "--batch-size", "8", "--out", str(out),
         "--json"], capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    results = json.loads((out / "results.json").read_text())
    assert (results["kind"], results["status"]) == ("masked-lm", "complete")
    assert results["heads_kept"] == results["heads_total"] // 2
    tokens = results["sample"]["tokens"]
    assert (tokens[0], tokens[-1]) == (cls, sep)
    # the roles found the family's own special tokens: attention mass lands on them
    assert max(s["cls"] for s in results["statistics"]) > 0
    assert max(s["sep"] for s in results["statistics"]) > 0
    report = (out / "report.html").read_text()
    assert sep.replace("<", "&lt;").replace(">", "&gt;") in report
    model = headlab.load(out / "model")
    assert model.family == results["family"]
    assert model.head_ids() == [results["kept_heads"][str(i)] for i in range(model.n_layers)]
