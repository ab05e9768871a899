"""Calibration and evaluation sets the way the pruning papers build them.

SparseGPT, Wanda, FLAP and SliceGPT score (calibrate) on random windows of one text and
measure perplexity on another: 128 random 2048-token windows of C4, then WikiText-2's
test split joined with "\\n\\n", cut into non-overlapping windows of 2048 tokens (or
the model's limit), scored as exp of the mean token loss (wanda ``lib/eval.py``).

    calibration_windows   N seeded random windows of L tokens from a source
    evaluation_windows    the "windows" protocol: one joined text, non-overlapping windows
    document_windows      a corpus of documents (enwiki) read the windows' way, for both sets
    split_documents       one source for both: its documents split, none in both

Shape notation: N windows, L window length.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from headlab.data.blocks import Blocks, bos_prefix
from headlab.data.texts import TextData
from headlab.errors import DataError, UserError

PROTOCOLS = ("split", "windows")
PAPER_SEQ_LEN = 2048  # the papers' window, for calibration and evaluation alike
# a calibration stream of at most this many times the tokens asked for: a random sample
# of documents (they are read in a seeded random order), without tokenising a whole corpus
_STREAM_FACTOR = 8


def eval_seq_len_for(asked: int | None, limit: int) -> int:
    """The evaluation window: ``asked``, or 2048 capped by the model's ``limit``; asking
    for more than the model holds is an error that names the limit."""
    if asked is None:
        return min(PAPER_SEQ_LEN, limit)
    if asked > limit:
        raise UserError(f"--eval-seq-len {asked} is above the model's limit of {limit} "
                        f"positions; give at most {limit}")
    return asked


def split_documents(data: TextData, *, heldout: float, seed: int) -> tuple[TextData, TextData]:
    """Seeded split of one source's documents into (calibration, evaluation): ``heldout``
    of them (at least one) measure, the rest score; no document is in both."""
    n = len(data.texts)
    if n < 2:
        raise DataError(f"{data.spec}: {n} document(s) cannot be split into calibration and "
                        "evaluation parts; give more documents, or separate sources with "
                        "--calib-data and --eval-data")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_held = min(n - 1, max(1, round(n * heldout)))
    return _subset(data, order[n_held:].sort().values), _subset(data, order[:n_held].sort().values)


def _subset(data: TextData, index: torch.Tensor) -> TextData:
    rows = index.tolist()
    return replace(data, texts=[data.texts[i] for i in rows],
                   pairs=None if data.pairs is None else [data.pairs[i] for i in rows],
                   labels=None if data.labels is None else [data.labels[i] for i in rows])


def _documents(data: TextData) -> list[str]:
    if data.pairs is None:
        return data.texts
    return [f"{a} {b}" for a, b in zip(data.texts, data.pairs, strict=True)]


def calibration_windows(data: TextData, tokenizer, *, n_samples: int, seq_len: int,
                        seed: int = 0) -> Blocks:
    """``n_samples`` seeded random windows of ``seq_len`` tokens, none overlapping another.

    The documents are read in a seeded random order, each followed by the end-of-text
    token, into one stream of up to 8 x n_samples x seq_len tokens; the windows are
    n_samples of its aligned slots of seq_len, chosen at random, after a random shift.
    Asking for more windows than the source holds is an error that says how many it has.
    """
    if n_samples < 1 or seq_len < 4:
        raise UserError(f"--calib-samples must be >= 1 and --calib-seq-len >= 4, got "
                        f"{n_samples} and {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    docs = _documents(data)
    budget = _STREAM_FACTOR * n_samples * seq_len
    stream: list[int] = []
    for i in torch.randperm(len(docs), generator=gen).tolist():
        stream.extend(tokenizer(docs[i], add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
        if len(stream) >= budget:
            break
    n_slots = len(stream) // seq_len
    if n_slots < n_samples:
        raise DataError(
            f"{data.spec}: the calibration text holds {len(stream)} tokens, {n_slots} windows "
            f"of {seq_len}; --calib-samples {n_samples} asks for more: give at most "
            f"{n_slots}, a shorter --calib-seq-len or more text")
    shift = int(torch.randint(0, len(stream) - n_slots * seq_len + 1, (1,), generator=gen))
    slots = torch.randperm(n_slots, generator=gen)[:n_samples].sort().values
    ids = torch.tensor(stream[shift: shift + n_slots * seq_len]).view(n_slots, seq_len)
    ids = ids[slots]  # (N, L)
    return Blocks(ids, torch.ones_like(ids), None, data.spec)


def evaluation_windows(data: TextData, tokenizer, *, seq_len: int,
                       max_windows: int | None = None, seed: int | None = None,
                       bos_each: bool = False) -> Blocks:
    """The papers' perplexity protocol: the documents joined with "\\n\\n", tokenised
    once (special tokens as the tokenizer adds them, as wanda does), cut into
    non-overlapping windows of ``seq_len``; a partial last window is left out. At most
    ``max_windows``: the first ones, or with ``seed`` a seeded sample of them, in order.
    ``bos_each``: every window starts with the beginning-of-text token where the
    tokenizer puts one before a text (`headlab.data.blocks.bos_prefix`), as lm-eval's
    rolling windows do, and holds seq_len - 1 tokens of text."""
    prefix = bos_prefix(tokenizer) if bos_each else []
    ids = tokenizer("\n\n".join(_documents(data)), add_special_tokens=not prefix)["input_ids"]
    body = seq_len - len(prefix)
    n = len(ids) // body
    if n == 0:
        raise DataError(f"{data.spec}: {len(ids)} tokens do not fill one evaluation window "
                        f"of {seq_len}; give more text or a smaller --eval-seq-len (--seq-len "
                        "for a corpus of documents)")
    windows = torch.tensor(ids[: n * body]).view(n, body)  # (N, L - len(prefix))
    if prefix:
        windows = torch.cat([torch.tensor(prefix).expand(n, len(prefix)), windows], dim=1)
    if max_windows is not None and max_windows < n:
        if seed is None:
            windows = windows[:max_windows]
        else:
            gen = torch.Generator().manual_seed(seed)
            windows = windows[torch.randperm(n, generator=gen)[:max_windows].sort().values]
    return Blocks(windows, torch.ones_like(windows), None, data.spec)


def document_windows(data: TextData, tokenizer, *, seq_len: int, max_tokens: int,
                     seed: int, what: str) -> Blocks:
    """A corpus of documents read the papers' way, for calibration or evaluation alike:
    `evaluation_windows` of ``seq_len``, a seeded sample of ``max_tokens // seq_len`` of
    them spread over all the documents, each window opened by the beginning-of-text
    token where the tokenizer uses one (a model such as Gemma reads text without it as
    noise: perplexity 100 against 23 on these articles). Asking for more tokens than the
    documents hold is an error that says how many they hold."""
    blocks = evaluation_windows(data, tokenizer, seq_len=seq_len, seed=seed, bos_each=True,
                                max_windows=max(1, max_tokens // seq_len))
    if blocks.n_tokens < max_tokens - seq_len + 1:  # short by more than the partial window
        raise DataError(f"{data.spec}: the {what} documents hold {blocks.n_tokens} tokens in "
                        f"windows of {seq_len}; --max-tokens {max_tokens} asks for more: give "
                        f"at most {blocks.n_tokens}")
    return blocks


@dataclass
class Settings:
    """How a run builds its calibration and evaluation sets (the RunConfig keys)."""

    kind: str
    seq_len: int  # blocks of the split protocol, and calibration windows unless told
    max_tokens: int
    heldout: float = 0.5
    seed: int = 0
    calib_samples: int | None = None
    calib_seq_len: int | None = None
    eval_protocol: str = "split"
    eval_seq_len: int = PAPER_SEQ_LEN


def describe(*, same_source: bool, heldout: float, seed: int,
             documents: TextData | None = None) -> str:
    """How the calibration and evaluation sets are kept apart, for results.json;
    ``documents``, the one source's documents where they are at hand, to count them."""
    if same_source:
        counts = ""
        if documents is not None:
            calib, held = split_documents(documents, heldout=heldout, seed=seed)
            counts = (f" ({len(calib.texts)} for calibration, {len(held.texts)} for "
                      "evaluation)")
        return (f"one source: its documents split by seed {seed}, a fraction {heldout:g} "
                f"for evaluation and the rest for calibration{counts}; no document is in "
                "both")
    return "two sources named apart (--calib-data, --eval-data); their overlap is not checked"
