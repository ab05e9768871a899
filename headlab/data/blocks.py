"""Texts -> token blocks, split into a scoring part and a held-out part.

Language models read the text as one stream cut into fixed-length blocks; classifiers
read one example (or sentence pair) per row; sentence encoders read one row each too,
and prose (the bundled text, .txt files) one sentence each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from headlab._util.checks import check_fraction, check_int, check_seed
from headlab.data.texts import BUNDLED_SPEC, TextData, sentences
from headlab.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class Blocks:
    """Token blocks ready for a model: input_ids and attention_mask (N, S).

    ``labels`` is (N,) class labels for classifiers or (N, S) token labels (-100 =
    ignored) for masked-LM; ``extras`` holds other per-row tensors (N, ...) such as the
    reference embeddings that fidelity is measured against.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor | None = None
    spec: str = BUNDLED_SPEC
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    layout: str | None = None  # the LAYOUTS entry layout_blocks cut them in

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def subset(self, index: torch.Tensor | list[int]) -> Blocks:
        index = torch.as_tensor(index, dtype=torch.long)
        return Blocks(self.input_ids[index], self.attention_mask[index],
                      None if self.labels is None else self.labels[index], self.spec,
                      {k: v[index] for k, v in self.extras.items()}, self.layout)

    def batches(self, batch_size: int):
        """Yield dicts (input_ids, attention_mask, labels, extras) of at most batch_size rows,
        cut after the batch's last real token: padding beyond it is attended by nothing."""
        for start in range(0, len(self), batch_size):
            rows = slice(start, start + batch_size)
            mask = self.attention_mask[rows]
            real = mask.any(0).nonzero()
            cols = slice(0, int(real[-1]) + 1 if len(real) else mask.shape[1])
            batch = {"input_ids": self.input_ids[rows, cols], "attention_mask": mask[:, cols]}
            if self.labels is not None:
                per_token = self.labels.dim() == 2  # masked-LM token labels, cut with the tokens
                batch["labels"] = self.labels[rows, cols] if per_token else self.labels[rows]
            batch.update({k: v[rows] for k, v in self.extras.items()})
            yield batch

    def n_batches(self, batch_size: int) -> int:
        return -(-len(self) // batch_size)


def bos_prefix(tokenizer) -> list[int]:
    """[BOS] where the tokenizer itself opens a text with its beginning-of-text token
    (Gemma, Llama), else []: the token a causal block starts with, as the model was
    trained (SmolLM2's and GPT-2's tokenizers add none)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    ids = tokenizer("a")["input_ids"]
    return [bos] if ids and ids[0] == bos else []


def _stream_blocks(data: TextData, tokenizer, *, seq_len: int, max_tokens: int | None,
                   wrapped: bool = False) -> Blocks:
    """One stream of texts (pairs joined by a space) cut into full blocks of seq_len;
    texts end with EOS, and every block opens with BOS where the tokenizer opens a text
    with one (`bos_prefix`); or, ``wrapped``, texts end with [SEP] and every block is
    [CLS] ... [SEP]."""
    sep_id = tokenizer.sep_token_id if wrapped else tokenizer.eos_token_id
    prefix = [] if wrapped else bos_prefix(tokenizer)
    body = seq_len - 2 if wrapped else seq_len - len(prefix)
    budget = max_tokens if max_tokens is not None else None
    stream: list[int] = []
    texts = data.texts if data.pairs is None else [
        f"{a} {b}" for a, b in zip(data.texts, data.pairs, strict=True)]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        stream.extend(ids)
        if sep_id is not None:
            stream.append(sep_id)
        if budget is not None and len(stream) >= budget + body:
            break
    n_blocks = len(stream) // body
    if budget is not None:
        n_blocks = min(n_blocks, max(1, budget // seq_len))
    if n_blocks == 0:
        raise DataError(
            f"{data.spec}: {len(stream)} tokens do not fill one block of {seq_len}; "
            "give more text or a smaller --seq-len"
        )
    ids = torch.tensor(stream[: n_blocks * body], dtype=torch.long).view(n_blocks, body)
    if prefix:
        ids = torch.cat([torch.tensor(prefix).expand(n_blocks, len(prefix)), ids], dim=1)
    if wrapped:
        cls = torch.full((n_blocks, 1), tokenizer.cls_token_id, dtype=torch.long)
        sep = torch.full((n_blocks, 1), tokenizer.sep_token_id, dtype=torch.long)
        ids = torch.cat([cls, ids, sep], dim=1)
    return Blocks(ids, torch.ones_like(ids), None, data.spec)


def _wrapped_stream_blocks(data: TextData, tokenizer, *, seq_len: int,
                           max_tokens: int | None) -> Blocks:
    return _stream_blocks(data, tokenizer, seq_len=seq_len, max_tokens=max_tokens, wrapped=True)


def _sentence_blocks(data: TextData, tokenizer, *, seq_len: int,
                     max_tokens: int | None) -> Blocks:
    """One row per example, prose (``data.prose``) one row per sentence."""
    if data.prose:
        data = TextData([s for text in data.texts for s in sentences(text)], spec=data.spec,
                        warning=data.warning)
    return _row_blocks(data, tokenizer, seq_len=seq_len, max_tokens=max_tokens)


def _row_blocks(data: TextData, tokenizer, *, seq_len: int, max_tokens) -> Blocks:
    """One padded row per example (or pair), the examples read in order up to
    ``max_tokens`` and then ordered longest first, each with its label."""
    rows, total, n_truncated = [], 0, 0
    for i, text in enumerate(data.texts):
        second = data.pairs[i] if data.pairs is not None else None
        enc = tokenizer(text, second)["input_ids"]
        truncated = len(enc) > seq_len
        if truncated:  # encode again: the tokenizer knows how to cut a pair
            enc = tokenizer(text, second, truncation=True, max_length=seq_len)["input_ids"]
        # at most max_tokens, but always the first row
        if max_tokens is not None and rows and total + len(enc) > max_tokens:
            break
        n_truncated += truncated
        rows.append((i, enc))
        total += len(enc)
    if n_truncated:
        log.warning("%d of %d examples were longer than %d tokens and were truncated",
                    n_truncated, len(rows), seq_len)
    # longest first (ties in reading order): a batch of neighbouring rows is cut after its
    # longest row's last token, so rows of about one length waste little on padding
    rows.sort(key=lambda row: -len(row[1]))
    width = max(len(r) for _, r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (_, enc) in enumerate(rows):
        ids[row, : len(enc)] = torch.tensor(enc)
        mask[row, : len(enc)] = 1
    labels = None
    if data.labels is not None:
        labels = torch.tensor([data.labels[i] for i, _ in rows], dtype=torch.long)
    return Blocks(ids, mask, labels, data.spec)


# the text layouts; each kind of model names the one it reads (headlab.objectives)
LAYOUTS = {
    "stream": _stream_blocks,  # texts joined by EOS, cut into full blocks
    "wrapped-stream": _wrapped_stream_blocks,  # the same, each block in [CLS] ... [SEP]
    "rows": _row_blocks,  # one padded, truncated row per example or pair, longest first
    "sentences": _sentence_blocks,  # rows; prose one sentence per row
}


def layout_blocks(
    data: TextData,
    tokenizer,
    *,
    layout: str,
    seq_len: int,
    max_tokens: int | None = None,
) -> Blocks:
    """Tokenise ``data`` into blocks of ``layout`` (`LAYOUTS`), at most ``max_tokens``
    tokens; `headlab.objectives.make_blocks` picks the layout a kind of model reads."""
    if layout not in LAYOUTS:
        raise DataError(f"no text layout {layout!r}; known layouts: {', '.join(LAYOUTS)}")
    if not isinstance(data, TextData):
        raise DataError(f"make_blocks reads TextData (from headlab.load_texts), got "
                        f"{type(data).__name__}")
    if not data.texts:
        raise DataError(f"{data.spec}: no texts to make blocks of")
    if tokenizer is None:
        raise DataError("make_blocks needs the model's tokenizer (model.tokenizer), got None")
    if max_tokens is not None:
        max_tokens = check_int(max_tokens, "max_tokens", low=1)
    if check_int(seq_len, "seq_len") < 4:
        raise DataError(f"seq_len must be >= 4, got {seq_len}")
    blocks = LAYOUTS[layout](data, tokenizer, seq_len=seq_len, max_tokens=max_tokens)
    blocks.layout = layout
    return blocks


def check_blocks(blocks: Blocks, *, what: str) -> None:
    """Raise DataError unless ``blocks`` are non-empty Blocks: ``what`` names the caller
    in the message (a model's objective checks their layout, `Objective.check_blocks`)."""
    if not isinstance(blocks, Blocks):
        raise DataError(f"{what} takes Blocks (from headlab.make_blocks), got "
                        f"{type(blocks).__name__}")
    if len(blocks) == 0:
        raise DataError(f"{what}: {blocks.spec} holds no blocks")


def split_blocks(blocks: Blocks, *, heldout: float = 0.5, seed: int = 0) -> tuple[Blocks, Blocks]:
    """Seeded, disjoint split into (scoring, held-out); quality is reported on held-out."""
    check_blocks(blocks, what="split_blocks")
    if len(blocks) < 2:
        raise DataError(
            f"{blocks.spec}: {len(blocks)} block(s) cannot be split into scoring and held-out "
            "parts; give more data (--max-tokens) or a shorter --seq-len"
        )
    heldout = check_fraction(heldout, "held-out fraction", include_one=False, error=DataError)
    seed = check_seed(seed)
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    n_held = min(len(blocks) - 1, max(1, round(len(blocks) * heldout)))
    return blocks.subset(order[n_held:].sort().values), blocks.subset(order[:n_held].sort().values)
