"""Texts and datasets: the bundled English text, local files and Hugging Face datasets
read into `TextData` (texts, sentence pairs, labels).

``--data`` accepts:
    nothing                         the bundled English text (small: a warning says so)
    enwiki                          English Wikipedia articles (`headlab.data.enwiki`),
                                    split by article into calibration and evaluation
    path.txt                        prose: paragraphs separated by blank lines
    path.jsonl / .csv / .tsv        rows; the text column(s) and label column inferred
    name:config:split               a Hugging Face dataset, e.g. wikitext:wikitext-2-raw-v1:test
`headlab.data.blocks` cuts them into token blocks.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from headlab._util.filecheck import check_dataset_spec, check_rows_file, read_text
from headlab.data import enwiki
from headlab.errors import DataError

log = logging.getLogger(__name__)


BUNDLED_SPEC = "bundled:english"
BUNDLED_WARNING = ("no data given (--data, or data in a recipe): using headlab's bundled "
                   "English text (~15k words), too small for publishable numbers; name a "
                   "corpus, e.g. enwiki (Wikipedia articles, offline) or "
                   "wikitext:wikitext-2-raw-v1:test")
_TEXT_COLUMNS = ("text", "sentence", "content", "document", "review", "question")
_PAIR_COLUMNS = (("premise", "hypothesis"), ("sentence1", "sentence2"),
                 ("question", "sentence"), ("question1", "question2"))
_LABEL_COLUMNS = ("label", "labels", "gold_label")


@dataclass
class TextData:
    """Examples read from a source: single texts or sentence pairs, optional labels."""

    texts: list[str]
    pairs: list[str] | None = None  # second sentence of each pair, aligned with texts
    labels: list[int] | None = None
    spec: str = BUNDLED_SPEC
    warning: str | None = None
    prose: bool = False  # running text in paragraphs, which sentence encoders cut up
    # whole documents (a corpus such as enwiki): one source for calibration and
    # evaluation is split by document, and causal LMs read them in windows
    documents: bool = False


# the --data names whose texts are whole documents (`TextData.documents`)
CORPORA = (enwiki.SPEC,)


def bundled_text() -> str:
    """headlab's offline evaluation text (~15k words), written for it in many registers:
    fiction, essays, a hire contract, an appliance manual, a recipe, two paper abstracts.
    Everything in it is invented, the abstracts' studies and numbers included: it is
    text to measure a model on, not a source of facts."""
    return resources.files("headlab.data.resources").joinpath("english.txt").read_text("utf-8")


def load_texts(
    spec: str | None = None, *, text_column: str | None = None, label_column: str | None = None
) -> TextData:
    """Read examples from ``spec`` (see the module docstring)."""
    if spec is None or spec == BUNDLED_SPEC:
        paragraphs = _paragraphs(bundled_text())
        return TextData(paragraphs, spec=BUNDLED_SPEC, warning=BUNDLED_WARNING, prose=True)
    if spec == enwiki.SPEC:
        return TextData([text for _, text in enwiki.articles()], spec=spec, prose=True,
                        documents=True)
    path = Path(spec)
    suffix = path.suffix.lower()
    if suffix in (".txt", ".jsonl", ".json", ".csv", ".tsv"):
        if not path.is_file():
            raise DataError(f"data file {spec} does not exist")
        if path.stat().st_size == 0:
            raise DataError(f"data file {spec} is empty")
        if suffix == ".txt":
            texts = _paragraphs(read_text(path))
            if not texts:
                raise DataError(f"data file {spec} holds no text")
            return TextData(texts, spec=str(spec), prose=True)
        check_rows_file(path)
        return _from_rows(_local_rows(path), str(spec), text_column, label_column)
    if spec.count(":") >= 1 and not path.exists():
        check_dataset_spec(spec)
        return _from_rows(_hub_rows(spec), spec, text_column, label_column)
    raise DataError(
        f"cannot read data {spec!r}: give a .txt/.jsonl/.csv/.tsv file, a Hugging Face "
        "dataset as name:config:split (e.g. wikitext:wikitext-2-raw-v1:test), enwiki (the "
        "Wikipedia sample in gensim), or nothing for the bundled text"
    )


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


# a candidate sentence end: . ! or ?, any closing quotes or brackets, then white space
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]\u201d\u2019]*\s+")
_SENTENCE_START = re.compile(r"[\"'(\[\u201c\u2018]*[A-Z0-9]")
# words a full stop follows without ending the sentence ("no" is left out: "No." is one)
_ABBREVIATIONS = frozenset((
    "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "mt", "capt", "col", "gen", "lt", "sgt",
    "rev", "hon", "vs", "etc", "cf", "al", "fig", "approx", "dept", "est", "inc", "ltd", "co",
    "corp", "e.g", "i.e"))


def sentences(text: str) -> list[str]:
    """Cut prose into sentences, white space inside each folded to single spaces.

    A sentence ends at . ! or ? (with any closing quotes or brackets) followed by white
    space and a capital, a digit or an opening quote, except where the full stop follows
    an abbreviation (Mr., e.g.), an initial (J.) or a number (a list's "3.").
    """
    text = " ".join(text.split())
    out, start = [], 0
    for end in _SENTENCE_END.finditer(text):
        if not _SENTENCE_START.match(text, end.end()):
            continue
        stop = text[end.start():end.end()].strip()
        if stop.startswith(".") and not stop.startswith(".."):
            word = text[start:end.start()].rsplit(" ", 1)[-1].lstrip("\"'([\u201c\u2018")
            if (word.lower() in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())
                    or word.isdigit()):
                continue
        out.append(text[start:end.end()].strip())
        start = end.end()
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def _local_rows(path: Path):
    import datasets

    kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "csv"}[path.suffix.lower()]
    kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train", **kwargs)
    except Exception as exc:
        raise DataError(f"could not read {path}: {type(exc).__name__}: {exc}") from exc


def _hub_rows(spec: str):
    import datasets

    parts = spec.split(":")
    name, config, split = parts[0], (parts[1] or None) if len(parts) > 1 else None, (
        parts[2] if len(parts) > 2 else "test")
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        raise DataError(
            f"could not load dataset {spec!r} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). Without network use a local "
            ".txt/.jsonl/.csv file or omit --data for the bundled text"
        ) from exc


def _from_rows(rows, spec: str, text_column: str | None, label_column: str | None) -> TextData:
    columns = list(rows.column_names)
    pair = None
    if text_column:
        if text_column not in columns:
            raise DataError(f"{spec}: no column {text_column!r}; columns: {columns}")
        first = text_column
    else:
        pair = next((p for p in _PAIR_COLUMNS if p[0] in columns and p[1] in columns), None)
        first = pair[0] if pair else next((c for c in _TEXT_COLUMNS if c in columns), None)
        if first is None:
            raise DataError(
                f"{spec}: no text column found among {columns}; name it with --text-column"
            )
    label = label_column or next((c for c in _LABEL_COLUMNS if c in columns), None)
    if label_column and label_column not in columns:
        raise DataError(f"{spec}: no label column {label_column!r}; columns: {columns}")
    texts, seconds, labels = [], [], []
    for row in rows:
        text = row[first]
        if not isinstance(text, str) or not text.strip():
            continue
        texts.append(text)
        if pair:
            seconds.append(str(row[pair[1]]))
        if label:
            labels.append(_class_id(row[label], label, spec))
    if not texts:
        raise DataError(f"{spec}: every row of column {first!r} is empty")
    return TextData(texts, pairs=seconds or None,
                    labels=labels if label and labels else None, spec=spec)


def _class_id(value, column: str, spec: str) -> int:
    """A label as an integer class id; anything else is a DataError naming the value."""
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DataError(
            f"{spec}: label column {column!r} holds {value!r}; labels must be integer class "
            "ids (0, 1, ...) in the model's label order: convert them, or name another "
            "column with --label-column"
        ) from None
