"""``--data enwiki``: the English Wikipedia sample that gensim's wheel ships.

gensim 4.4 carries ``test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-
shortened.bz2``, an April-2016 dump shortened to 206 pages: once redirects, disambiguation
and project pages are left out, 101 articles and some 460k words of running
text (WikiText-2's scale and genre; CC BY-SA). Each article becomes one document: wiki
markup stripped by gensim's ``filter_wiki``, bold and italic quotes removed, headings kept
as their own lines, and the trailing reference sections (References, External links,
See also, ...) cut. A run with ``--data enwiki`` splits the articles, never their
paragraphs, into calibration and evaluation (`headlab.data.protocol.split_documents`).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from headlab.errors import DataError

SPEC = "enwiki"
SOURCE = ("English Wikipedia, gensim 4.4's shortened April-2016 dump "
          "(enwiki-latest-pages-articles1...-shortened.bz2), CC BY-SA")
_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
# sections after which an article holds lists of links and citations, not prose
_TAIL_SECTIONS = ("references", "external links", "see also", "further reading", "notes",
                  "bibliography", "sources", "footnotes", "notes and references")
_HEADING = re.compile(r"^\s*(=+)\s*(.*?)\s*\1\s*$")
_QUOTES = re.compile(r"'{2,}")
_BLANKS = re.compile(r"\n{3,}")
_EMPTY_BULLET = re.compile(r"^\s*[*#:;]+\s*$")


def corpus_path() -> Path:
    """The dump inside the installed gensim wheel, found without importing gensim."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("--data enwiki reads the Wikipedia sample in gensim's wheel: "
                        "run `pip install gensim`")
    path = Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data" / _FILE
    if not path.is_file():
        raise DataError(f"--data enwiki: {path} is missing from the installed gensim; "
                        "reinstall it: pip install --force-reinstall gensim")
    return path


@functools.cache
def articles() -> tuple[tuple[str, str], ...]:
    """(title, text) of each article, in the dump's order; paragraphs of a text are
    separated by blank lines."""
    import bz2

    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    out = []
    with bz2.BZ2File(corpus_path()) as f:
        for title, markup, _ in extract_pages(f):
            if not _is_article(title, markup):
                continue
            text = clean(filter_wiki(markup))
            if text:
                out.append((title, text))
    return tuple(out)


def _is_article(title: str, markup: str) -> bool:
    return not (markup.lstrip().lower().startswith("#redirect") or ":" in title
                or title.endswith("(disambiguation)"))


def clean(text: str) -> str:
    """Text that ``filter_wiki`` left, as prose: quotes of bold and italics dropped,
    headings as plain lines, empty list items dropped, reference sections cut."""
    lines = []
    for line in _QUOTES.sub("", text).splitlines():
        heading = _HEADING.match(line)
        if heading:
            if heading.group(2).strip().lower() in _TAIL_SECTIONS:
                break
            line = heading.group(2).strip()
        if _EMPTY_BULLET.match(line):
            continue
        lines.append(line.rstrip())
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def n_words(texts: list[str]) -> int:
    return sum(len(t.split()) for t in texts)
