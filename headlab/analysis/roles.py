"""Token roles: which positions of a batch are valid, first, [CLS], [SEP] or punctuation.

The per-head statistics measure how much attention goes to these places (Clark et al.
2019, "What does BERT look at?"), so the roles are computed once per batch, from the
token strings or the attention mask, and passed beside the patterns. Tokenizers mark
word boundaries in their token strings ('Ġ', '▁', '##', '</w>'); this module also knows
how to read those marks, for punctuation and for `display_token`.
"""

from __future__ import annotations

import string
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

__all__ = ["TokenRoles", "display_token"]

# Tokenizer word-boundary marks: GPT-2 byte-level space, newline and tab, SentencePiece
# space. WordPiece's "##" prefix and BPE's "</w>" suffix are handled as affixes.
_BOUNDARY_MARKS = "Ġ▁Ċĉ"

# How a reader writes a token: the byte-level marks of space, newline and tab (GPT-2's
# Ġ, Ċ, ĉ) and SentencePiece's space become the characters they stand for, and BPE's
# end-of-word suffix goes. The report and the notebook views show real newlines and
# tabs as visible symbols, so they are mapped to the real characters, not to escapes.
_DISPLAY = str.maketrans({"Ġ": " ", "▁": " ", "Ċ": "\n", "ĉ": "\t"})


def display_token(token: str) -> str:
    """A token as a reader would write it: "Ġcat" -> " cat", "Ċ" -> "\\n", "cat</w>" -> "cat".

    WordPiece's "##" prefix stays: it says the token continues a word, which a reader
    of the attention wants to see.
    """
    return token.removesuffix("</w>").translate(_DISPLAY)


@dataclass(eq=False)  # tensors have no single truth value to compare by
class TokenRoles:
    """Which positions of each example are valid, first, [CLS], [SEP] or punctuation.

    Every field is a bool tensor (B, S), aligned with the query (and key) positions of the
    attention patterns. ``valid`` is the attention mask (True = a real token); the other
    roles are cleared on invalid positions, so padding never counts as anything.
    Lists and arrays are accepted and converted.
    """

    valid: Tensor
    first: Tensor
    cls: Tensor
    sep: Tensor
    punct: Tensor

    def __post_init__(self) -> None:
        names = [f.name for f in fields(self)]
        for name in names:
            setattr(self, name, torch.as_tensor(getattr(self, name), dtype=torch.bool))
        shape = self.valid.shape
        if len(shape) != 2:
            raise ValueError(
                f"TokenRoles.valid must have shape (B, S); got {tuple(shape)}. "
                "Pass one row per example, e.g. the tokenizer's attention_mask."
            )
        for name in names[1:]:
            value = getattr(self, name)
            if value.shape != shape:
                raise ValueError(
                    f"TokenRoles.{name} has shape {tuple(value.shape)} but valid has "
                    f"{tuple(shape)}; every role is a (B, S) mask over the same positions."
                )
            setattr(self, name, value.to(self.valid.device) & self.valid)

    @property
    def shape(self) -> tuple[int, int]:
        """(B, S)."""
        return (int(self.valid.shape[0]), int(self.valid.shape[1]))

    def to(self, device: torch.device | str) -> TokenRoles:
        """The same roles on another device."""
        return TokenRoles(*(getattr(self, f.name).to(device) for f in fields(self)))

    @classmethod
    def from_mask(cls, valid: Any) -> TokenRoles:
        """Roles known from the attention mask alone: valid and first; nothing else.

        For statistics where the token strings are not at hand; cls, sep and punct then
        stay 0.
        """
        valid = torch.as_tensor(valid, dtype=torch.bool)
        none = torch.zeros_like(valid)
        return cls(valid=valid, first=_first_valid(valid), cls=none, sep=none, punct=none)

    @classmethod
    def from_tokens(
        cls,
        tokens: Sequence[Sequence[str]],
        *,
        cls_token: str | Iterable[str] | None = None,
        sep_token: str | Iterable[str] | None = None,
        valid: Any = None,
    ) -> TokenRoles:
        """Roles from token strings, one list per example.

        Rows of different lengths are right-padded (the padding is invalid). ``valid``
        (B, S), when given, marks the real tokens, e.g. for left-padded batches whose token
        lists include the pad tokens; S must be the longest row. [CLS] and [SEP] are matched
        by exact token string (one string or several); nothing is marked when None.
        Punctuation is a token whose text, stripped of word-boundary marks ('Ġ', '▁', '##'
        and the like), is all punctuation or symbol characters. ``first`` is the first
        valid position of each row.
        """
        if isinstance(tokens, str) or any(isinstance(row, str) for row in tokens):
            raise TypeError(
                "tokens must be a list of token lists, one per example, e.g. "
                "[tokenizer.convert_ids_to_tokens(ids) for ids in batch]; got a string."
            )
        n_rows, length = len(tokens), max((len(row) for row in tokens), default=0)
        in_row = torch.zeros(n_rows, length, dtype=torch.bool)
        for b, row in enumerate(tokens):
            in_row[b, : len(row)] = True
        if valid is None:
            valid = in_row
        else:
            valid = torch.as_tensor(valid, dtype=torch.bool).cpu()
            if valid.shape != (n_rows, length):
                raise ValueError(
                    f"valid has shape {tuple(valid.shape)} but tokens give "
                    f"({n_rows}, {length}) (examples, longest row); pass one mask entry "
                    "per token, padding included."
                )
            valid = valid & in_row
        cls_set, sep_set = _as_token_set(cls_token), _as_token_set(sep_token)

        def mark(test: Any) -> Tensor:
            out = torch.zeros(n_rows, length, dtype=torch.bool)
            for b, row in enumerate(tokens):
                for s, token in enumerate(row):
                    out[b, s] = bool(test(token))
            return out

        return cls(
            valid=valid,
            first=_first_valid(valid),
            cls=mark(cls_set.__contains__),
            sep=mark(sep_set.__contains__),
            punct=mark(_is_punctuation),
        )


def _as_token_set(token: str | Iterable[str] | None) -> frozenset[str]:
    if token is None:
        return frozenset()
    if isinstance(token, str):
        return frozenset([token])
    return frozenset(token)


def _first_valid(valid: Tensor) -> Tensor:
    """(B, S) bool: True at the first valid position of each row (left padding aware)."""
    first = torch.zeros_like(valid)
    if valid.numel() == 0:
        return first
    index = valid.to(torch.uint8).argmax(dim=-1)  # (B,): the first True, 0 if none
    rows = torch.arange(valid.shape[0], device=valid.device)
    first[rows, index] = valid[rows, index]
    return first


def _is_punctuation(token: str) -> bool:
    """True for a token that is punctuation once word-boundary marks are removed."""
    text = token.strip(_BOUNDARY_MARKS + string.whitespace)
    core = text.removeprefix("##").removesuffix("</w>").strip(_BOUNDARY_MARKS)
    # "##" alone, or "#" continued, is itself punctuation: keep it when stripping empties it.
    text = core or text
    return bool(text) and all(
        unicodedata.category(c).startswith("P") or c in string.punctuation for c in text
    )
