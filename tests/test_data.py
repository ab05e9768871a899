"""Tests for headlab.data: text sources -> token blocks -> (scoring, held-out) split.

References: files written here and read back through ``datasets`` with the columns
inferred; a token stream rebuilt by hand from the tokenizer. Invariants: every block is
full, the token budget holds, the split is seeded, disjoint and complete. Errors say
what was wrong and what to do.

Shape notation: N blocks (rows), S block length.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.testing import assert_close

from headlab.data.blocks import Blocks, DataError, split_blocks
from headlab.data.texts import BUNDLED_SPEC, TextData, bundled_text, load_texts, sentences
from headlab.objectives import make_blocks


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------- sources
def test_bundled_text_loads_with_a_warning():
    data = load_texts()
    assert data.spec == BUNDLED_SPEC
    assert "bundled" in data.warning and "--data" in data.warning
    paragraphs = [p.strip() for p in bundled_text().split("\n\n") if p.strip()]
    assert data.texts == paragraphs
    assert len(data.texts) > 20 and data.pairs is None and data.labels is None
    assert load_texts(BUNDLED_SPEC).texts == data.texts


def test_txt_file_reads_paragraphs(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("First paragraph,\nstill first.\n\n\n  Second one.  \n\n\n")
    data = load_texts(str(path))
    assert data.texts == ["First paragraph,\nstill first.", "Second one."]
    assert data.spec == str(path) and data.warning is None and data.labels is None


def test_jsonl_infers_text_and_label_columns(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", [
        {"id": 1, "text": "the cat sat", "label": 1},
        {"id": 2, "text": "   ", "label": 0},  # blank text: skipped with its label
        {"id": 3, "text": "a dog ran", "label": 0},
    ])
    data = load_texts(str(path))
    assert data.texts == ["the cat sat", "a dog ran"]
    assert data.labels == [1, 0]
    assert data.pairs is None


def test_csv_infers_sentence_column_without_labels(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text('idx,sentence\n0,"one, with a comma"\n1,two\n')
    data = load_texts(str(path))
    assert data.texts == ["one, with a comma", "two"]
    assert data.labels is None


def test_tsv_reads_sentence_pairs(tmp_path):
    path = tmp_path / "nli.tsv"
    path.write_text("premise\thypothesis\tlabel\n"
                    "A man eats.\tSomeone eats.\t0\n"
                    "A dog runs.\tA cat sleeps.\t2\n")
    data = load_texts(str(path))
    assert data.texts == ["A man eats.", "A dog runs."]
    assert data.pairs == ["Someone eats.", "A cat sleeps."]
    assert data.labels == [0, 2]


def test_named_columns_override_inference(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", [
        {"text": "ignored", "body": "used one", "y": 3},
        {"text": "ignored", "body": "used two", "y": 4},
    ])
    data = load_texts(str(path), text_column="body", label_column="y")
    assert data.texts == ["used one", "used two"] and data.labels == [3, 4]
    with pytest.raises(DataError, match=r"no column 'nope'; columns: \['text', 'body', 'y'\]"):
        load_texts(str(path), text_column="nope")
    with pytest.raises(DataError, match="no label column 'nope'"):
        load_texts(str(path), label_column="nope")


def test_missing_and_empty_files_raise(tmp_path):
    with pytest.raises(DataError, match=r"absent\.txt does not exist"):
        load_texts(str(tmp_path / "absent.txt"))
    with pytest.raises(DataError, match=r"absent\.csv does not exist"):
        load_texts(str(tmp_path / "absent.csv"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty"):
        load_texts(str(tmp_path / "empty.jsonl"))
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    with pytest.raises(DataError, match="holds no text"):
        load_texts(str(tmp_path / "blank.txt"))


def test_file_without_text_column_raises(tmp_path):
    path = _write_jsonl(tmp_path / "numbers.jsonl", [{"a": 1, "b": 2}])
    with pytest.raises(DataError, match=r"no text column found among \['a', 'b'\].*--text-column"):
        load_texts(str(path))


def test_non_integer_labels_raise_a_data_error(tmp_path):
    path = tmp_path / "sentiment.csv"
    path.write_text("text,label\ngreat film,pos\nawful,neg\n")
    with pytest.raises(DataError, match="label column 'label' holds 'pos'.*integer class ids"):
        load_texts(str(path))
    path = tmp_path / "holes.csv"
    path.write_text("text,label\ngreat film,1\nawful,\n")
    with pytest.raises(DataError, match="label column 'label' holds None"):
        load_texts(str(path))


def test_unreadable_file_and_unknown_spec_raise(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text("this is not json\n")
    with pytest.raises(DataError, match=r"could not read .*broken\.jsonl"):
        load_texts(str(path))
    with pytest.raises(DataError, match=r"\.txt/\.jsonl/\.csv/\.tsv file.*name:config:split"):
        load_texts("report.docx")


def test_hub_dataset_offline_names_the_alternatives():
    with pytest.raises(DataError) as err:
        load_texts("no_such_dataset_headlab:default:test")
    message = str(err.value)
    assert "no_such_dataset_headlab:default:test" in message
    assert "Without network" in message and ".txt/.jsonl/.csv" in message
    assert "bundled text" in message


# ---------------------------------------------------------------------- blocks
def _stream(data: TextData, tokenizer) -> list[int]:
    """The causal-LM token stream by hand: each text's tokens, then EOS."""
    out: list[int] = []
    for text in data.texts:
        out += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return out


def test_causal_blocks_are_the_stream_cut_into_full_blocks(bpe_tokenizer):
    data = TextData(load_texts().texts[:12])
    stream = _stream(data, bpe_tokenizer)
    blocks = make_blocks(data, bpe_tokenizer, kind="causal-lm", seq_len=32)
    n = len(stream) // 32
    assert blocks.input_ids.shape == (n, 32) and n >= 4
    assert blocks.input_ids.flatten().tolist() == stream[: n * 32]
    assert torch.all(blocks.attention_mask == 1) and blocks.labels is None
    assert blocks.n_tokens == n * 32


@pytest.mark.parametrize("max_tokens", [64, 100, 257, 1000])
def test_causal_blocks_respect_the_token_budget(bpe_tokenizer, max_tokens):
    data = load_texts()
    blocks = make_blocks(data, bpe_tokenizer, kind="causal-lm", seq_len=32, max_tokens=max_tokens)
    assert blocks.input_ids.shape == (max_tokens // 32, 32)
    assert blocks.n_tokens <= max_tokens
    # the budget takes the first blocks of the same stream
    everything = _stream(TextData(data.texts[:40]), bpe_tokenizer)
    assert blocks.input_ids.flatten().tolist() == everything[: blocks.n_tokens]


def test_too_little_text_raises(bpe_tokenizer):
    with pytest.raises(DataError, match=r"tokens do not fill one block of 64.*--seq-len"):
        make_blocks(TextData(["just a few words"], spec="tiny"), bpe_tokenizer,
                    kind="causal-lm", seq_len=64)
    with pytest.raises(DataError, match="seq_len must be >= 4"):
        make_blocks(load_texts(), bpe_tokenizer, kind="causal-lm", seq_len=2)


def test_an_unknown_kind_of_model_is_refused_with_the_known_ones(bpe_tokenizer):
    with pytest.raises(DataError, match="'seq2seq'.*causal-lm, masked-lm, classifier, embedding"):
        make_blocks(load_texts(), bpe_tokenizer, kind="seq2seq", seq_len=32)


def test_row_blocks_pad_and_keep_labels(bpe_tokenizer, caplog):
    texts = ["short", "a somewhat longer sentence here", "mid length one"]
    data = TextData(texts, labels=[2, 0, 1], spec="rows")
    blocks = make_blocks(data, bpe_tokenizer, kind="classifier", seq_len=64)
    lengths = [len(bpe_tokenizer(t)["input_ids"]) for t in texts]
    assert blocks.input_ids.shape == (3, max(lengths))
    order = [1, 2, 0]  # longest first
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
    assert blocks.attention_mask.sum(1).tolist() == [lengths[i] for i in order]
    for row, i in enumerate(order):
        n = lengths[i]
        assert blocks.input_ids[row, :n].tolist() == bpe_tokenizer(texts[i])["input_ids"]
        assert torch.all(blocks.input_ids[row, n:] == 0)  # no pad token: id 0
    assert_close(blocks.labels, torch.tensor([0, 1, 2]), rtol=0, atol=0)  # with their rows

    with caplog.at_level(logging.WARNING, logger="headlab.data"):
        short = make_blocks(data, bpe_tokenizer, kind="classifier", seq_len=4)
    assert short.input_ids.shape[1] == 4
    assert "2 of 3 examples were longer than 4 tokens" in caplog.text


def test_truncated_rows_are_the_tokenizers_own_cut_and_counted_once(bpe_tokenizer, caplog):
    data = TextData(["a somewhat longer sentence here"] * 3, pairs=["and its pair"] * 3,
                    labels=[0, 1, 2])
    with caplog.at_level(logging.WARNING, logger="headlab.data"):
        blocks = make_blocks(data, bpe_tokenizer, kind="classifier", seq_len=6, max_tokens=12)
    assert len(blocks) == 2  # the budget holds two rows of 6
    cut = bpe_tokenizer(data.texts[0], data.pairs[0], truncation=True, max_length=6)
    assert blocks.input_ids.tolist() == [cut["input_ids"]] * 2
    assert "2 of 2 examples were longer than 6 tokens" in caplog.text


def test_row_blocks_stop_at_the_token_budget(bpe_tokenizer):
    data = TextData([f"example number {i} of many" for i in range(50)],
                    labels=list(range(50)))
    lengths = [len(bpe_tokenizer(t)["input_ids"]) for t in data.texts]
    for budget in (40, 60, 61):
        blocks = make_blocks(data, bpe_tokenizer, kind="classifier", seq_len=16,
                             max_tokens=budget)
        n = len(blocks)
        assert sum(lengths[:n]) <= budget < sum(lengths[: n + 1])  # as many rows as fit
        assert blocks.n_tokens == sum(lengths[:n])
        # the first n examples, longest first, each row with its own label
        assert sorted(blocks.labels.tolist()) == list(range(n))
        assert blocks.attention_mask.sum(1).tolist() == [lengths[i] for i in blocks.labels]
        assert blocks.attention_mask.sum(1).tolist() == sorted(lengths[:n], reverse=True)
    # a budget below the first row still gives that row
    assert len(make_blocks(data, bpe_tokenizer, kind="classifier", seq_len=16,
                           max_tokens=3)) == 1


def test_pairs_become_one_row_each(bpe_tokenizer):
    data = TextData(["A man eats.", "A dog runs."], pairs=["Someone eats.", "A cat."],
                    labels=[0, 1])
    blocks = make_blocks(data, bpe_tokenizer, kind="classifier", seq_len=32)
    first = bpe_tokenizer("A man eats.", "Someone eats.")["input_ids"]
    assert blocks.input_ids[0, : len(first)].tolist() == first
    assert len(first) > len(bpe_tokenizer("A man eats.")["input_ids"])


# ---------------------------------------------------------------------- split
def test_sentences_end_at_stops_not_at_abbreviations_initials_or_list_numbers():
    text = ('"Mr. Abernathy?" she called.  The bell\ngave its cough. "It\'s Ruth. From the '
            'bakery." J. R. Hartley wrote e.g. this, at 11.00 p.m. on Friday. 1. Grant of '
            "Licence. No. Why not?! Wait... (Then he left.) Done")
    assert sentences(text) == [
        '"Mr. Abernathy?" she called.', "The bell gave its cough.", '"It\'s Ruth.',
        'From the bakery."', "J. R. Hartley wrote e.g. this, at 11.00 p.m. on Friday.",
        "1. Grant of Licence.", "No.", "Why not?!", "Wait...", "(Then he left.)", "Done"]
    assert sentences("  ") == [] and sentences("no stop at all") == ["no stop at all"]


def test_sentence_encoders_read_prose_a_sentence_per_row(bpe_tokenizer, tmp_path):
    path = tmp_path / "prose.txt"
    path.write_text("One short line. Another one here!\n\nA second paragraph? Yes.\n")
    data = load_texts(str(path))
    assert data.texts == ["One short line. Another one here!", "A second paragraph? Yes."]
    rows = make_blocks(data, bpe_tokenizer, kind="embedding", seq_len=64)
    want = ["One short line.", "Another one here!", "A second paragraph?", "Yes."]
    encoded = sorted((bpe_tokenizer(t)["input_ids"] for t in want), key=len, reverse=True)
    assert rows.attention_mask.sum(1).tolist() == [len(e) for e in encoded]
    assert [rows.input_ids[i, :len(e)].tolist() for i, e in enumerate(encoded)] == encoded
    # rows the user gave (jsonl, csv, datasets) stay whole, and classifiers read rows
    assert len(make_blocks(TextData(data.texts), bpe_tokenizer, kind="embedding",
                           seq_len=64)) == 2
    assert len(make_blocks(data, bpe_tokenizer, kind="classifier", seq_len=64)) == 2
    bundled = make_blocks(load_texts(), bpe_tokenizer, kind="embedding", seq_len=128)
    assert len(bundled) > 3 * len(load_texts().texts)


def test_batches_drop_the_padding_no_row_of_the_batch_reaches(bpe_tokenizer):
    texts = ["a b c d e f g h i j k l", "a b", "a b c", "a"]
    blocks = make_blocks(TextData(texts, labels=[0, 1, 0, 1]), bpe_tokenizer,
                         kind="classifier", seq_len=64)
    lengths = blocks.attention_mask.sum(1).tolist()
    batches = list(blocks.batches(2))
    assert [b["input_ids"].shape[1] for b in batches] == [max(lengths[:2]), max(lengths[2:])]
    assert batches[1]["input_ids"].shape[1] < blocks.input_ids.shape[1]
    for b, rows in zip(batches, (slice(0, 2), slice(2, 4)), strict=True):
        width = b["input_ids"].shape[1]
        assert torch.equal(b["input_ids"], blocks.input_ids[rows, :width])
        assert torch.equal(b["attention_mask"], blocks.attention_mask[rows, :width])
        assert torch.all(blocks.attention_mask[rows, width:] == 0)
        assert torch.equal(b["labels"], blocks.labels[rows])
    # token labels (masked-LM) are cut with the tokens
    tokens = Blocks(blocks.input_ids, blocks.attention_mask, blocks.input_ids.clone())
    assert [b["labels"].shape for b in tokens.batches(2)] == [b["input_ids"].shape
                                                           for b in batches]


def _numbered(n: int) -> Blocks:
    """Blocks whose row i holds the value i, so rows can be told apart after a split."""
    ids = torch.arange(n)[:, None].expand(n, 8).clone()
    return Blocks(ids, torch.ones_like(ids), torch.arange(n), "numbered",
                  {"extra": torch.arange(n).double()})


@pytest.mark.parametrize(("n", "heldout"), [(2, 0.5), (10, 0.5), (11, 0.3), (40, 0.9)])
def test_split_is_seeded_disjoint_and_complete(n, heldout):
    blocks = _numbered(n)
    scoring, held = split_blocks(blocks, heldout=heldout, seed=3)
    a, b = scoring.input_ids[:, 0].tolist(), held.input_ids[:, 0].tolist()
    assert not set(a) & set(b)
    assert sorted(a + b) == list(range(n))
    assert len(b) == min(n - 1, max(1, round(n * heldout)))
    # labels and extras travel with their rows
    assert scoring.labels.tolist() == a and held.extras["extra"].tolist() == [float(i) for i in b]
    again = split_blocks(blocks, heldout=heldout, seed=3)
    assert again[0].input_ids[:, 0].tolist() == a
    assert again[1].input_ids[:, 0].tolist() == b


def test_split_depends_on_the_seed():
    blocks = _numbered(30)
    splits = {tuple(split_blocks(blocks, seed=s)[1].input_ids[:, 0].tolist()) for s in range(5)}
    assert len(splits) > 1


def test_split_refuses_too_few_blocks_and_bad_fractions():
    with pytest.raises(DataError, match=r"1 block\(s\) cannot be split.*--max-tokens"):
        split_blocks(_numbered(1))
    for bad in (0.0, 1.0, -0.2):
        with pytest.raises(DataError, match=r"held-out fraction must be in \(0, 1\)"):
            split_blocks(_numbered(10), heldout=bad)


def test_batches_cover_every_row_once():
    blocks = _numbered(7)
    rows = [b["input_ids"][:, 0] for b in blocks.batches(3)]
    assert [len(r) for r in rows] == [3, 3, 1] == [3] * 2 + [1]
    assert torch.cat(rows).tolist() == list(range(7))
    assert blocks.n_batches(3) == 3
