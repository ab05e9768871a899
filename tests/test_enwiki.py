"""Tests for `--data enwiki` (headlab.data.enwiki): gensim's English Wikipedia sample read
into articles, split by article into calibration and evaluation.

References: the dump itself, read again here with the standard library's bz2 and a
regular expression over its <title> and <text> elements, independently of gensim's page
extraction; the split checked by text, not by index. Errors: gensim missing and a token
budget the corpus cannot hold end in one line, the latter before any model loads.
"""

from __future__ import annotations

import bz2
import re
import time

import pytest
from typer.testing import CliRunner

from headlab.cli import app
from headlab.data import enwiki
from headlab.data.protocol import Settings, split_documents
from headlab.data.texts import load_texts
from headlab.errors import DataError
from headlab.runs.inputs import build_sets


@pytest.fixture(scope="module")
def corpus():
    return load_texts("enwiki")


def _titles_in_dump() -> list[str]:
    with bz2.open(enwiki.corpus_path(), "rt", encoding="utf-8") as f:
        raw = f.read()
    pages = re.findall(r"<title>(.*?)</title>.*?<text[^>]*>(.*?)</text>", raw, flags=re.S)
    return [t for t, body in pages
            if not body.lstrip().lower().startswith("#redirect") and ":" not in t
            and not t.endswith("(disambiguation)")]


def test_corpus_is_the_dumps_articles_as_prose(corpus):
    titles = [t for t, _ in enwiki.articles()]
    assert titles == _titles_in_dump()
    assert 90 <= len(corpus.texts) <= 110, len(corpus.texts)
    assert 350_000 < enwiki.n_words(corpus.texts) < 480_000
    joined = "\n\n".join(corpus.texts)
    for markup in ("'''", "[[", "]]", "{{", "}}", "<ref", "\n==", "\n\n\n"):
        assert markup not in joined, markup
    aristotle = dict(enwiki.articles())["Aristotle"]
    assert aristotle.startswith("Aristotle (;  , Aristotélēs; 384–322\xa0BC) was a Greek")
    assert "\nLife\n" in aristotle  # a heading kept as its own line
    assert "External links" not in aristotle  # the reference sections cut


def test_clean_keeps_prose_and_cuts_tails():
    text = ("'''Ada''' is a ''language''.\n\n\n\n== History ==\nIt began.\n* \n*  Item\n"
            "== See also ==\n* Pascal\n== Later ==\nNot prose.")
    assert enwiki.clean(text) == "Ada is a language.\n\nHistory\nIt began.\n*  Item"


def test_article_split_is_disjoint_deterministic_and_seeded(corpus):
    calib, held = split_documents(corpus, heldout=0.5, seed=0)
    again = split_documents(load_texts("enwiki"), heldout=0.5, seed=0)
    assert (calib.texts, held.texts) == (again[0].texts, again[1].texts)
    assert len(calib.texts) + len(held.texts) == len(corpus.texts)
    assert split_documents(corpus, heldout=0.5, seed=1)[1].texts != held.texts
    calib_text = "\n\n".join(calib.texts)
    for article in held.texts:  # no evaluation article's opening is in calibration
        assert article[:300] not in calib_text


def test_windows_come_from_their_own_articles(corpus, bpe_tokenizer):
    """A causal LM reads each part in windows spread over its articles; decoded, every
    window is text of the part's own articles and of no article of the other part."""
    settings = Settings(kind="causal-lm", seq_len=32, max_tokens=32 * 40, seed=0)
    calib_blocks, held_blocks = build_sets(settings, bpe_tokenizer, corpus, None)
    assert calib_blocks.input_ids.shape == held_blocks.input_ids.shape == (40, 32)
    calib, held = split_documents(corpus, heldout=0.5, seed=0)
    calib_words = set(" ".join(calib.texts).split())
    held_only = set(" ".join(held.texts).split()) - calib_words
    seen = set()
    for row in calib_blocks.input_ids:
        words = set(bpe_tokenizer.decode(row).split()[1:-1])  # whole words only
        seen |= words
    assert seen and not seen & held_only  # no word that only the evaluation articles hold
    assert len({tuple(r.tolist()) for r in held_blocks.input_ids}) == 40


def test_budget_beyond_the_articles_is_refused(corpus, bpe_tokenizer):
    settings = Settings(kind="causal-lm", seq_len=64, max_tokens=10_000_000, seed=0)
    with pytest.raises(DataError, match=r"the calibration documents hold \d+ tokens"):
        build_sets(settings, bpe_tokenizer, corpus, None)


def test_cli_refuses_a_budget_beyond_the_corpus_before_loading(tmp_path):
    out = tmp_path / "run"
    start = time.perf_counter()
    res = CliRunner().invoke(app, ["score", "--model", "smollm2-135m", "--data", "enwiki",
                                   "--max-tokens", "5000000", "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--max-tokens 5000000" in lines[0], res.output
    assert "calibration articles" in lines[0]
    assert time.perf_counter() - start < 30 and not out.exists()


def test_gensim_missing_names_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gensim" else real(name, *a))
    enwiki.articles.cache_clear()
    try:
        with pytest.raises(DataError, match=r"pip install gensim"):
            load_texts("enwiki")
    finally:
        enwiki.articles.cache_clear()


class _WordTokenizer:
    """Words to ids, opening every text with BOS (id 1) as Gemma's and Llama's do."""

    bos_token_id, eos_token_id, sep_token_id, cls_token_id, pad_token_id = 1, 2, None, None, 0

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def __call__(self, text, add_special_tokens=True):
        ids = [self.vocab.setdefault(w, len(self.vocab) + 3) for w in text.split()]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}


def test_every_causal_window_opens_with_bos_where_the_tokenizer_uses_one(corpus):
    """Gemma reads a window without its BOS as noise (perplexity 100 against 23 on these
    articles), so each window and each stream block opens with BOS: no other BOS inside,
    and the text runs on from window to window."""
    from headlab.data.blocks import layout_blocks
    from headlab.data.protocol import document_windows

    tok = _WordTokenizer()
    windows = document_windows(corpus, tok, seq_len=16, max_tokens=16 * 1000, seed=0,
                               what="calibration").input_ids
    blocks = layout_blocks(corpus, tok, layout="stream", seq_len=16,
                           max_tokens=16 * 50).input_ids
    for ids in (windows, blocks):
        assert (ids[:, 0] == 1).all() and not (ids[:, 1:] == 1).any()
    words = " ".join(corpus.texts).split()
    assert blocks[0, 1:].tolist() == [tok.vocab[w] for w in words[:15]]
    assert blocks[1, 1:].tolist() == [tok.vocab[w] for w in words[15:30]]
