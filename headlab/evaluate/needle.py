"""Needle in a haystack, offline: can the model retrieve one fact from a long context?

Head-level KV work (DuoAttention, RazorAttention, HeadKV) measures this because
pruning or compressing the few retrieval heads destroys long-context recall while
perplexity barely moves. A key-value fact ("The secret code of the blue door is
482913.") is placed at depths 0-100% of filler text (headlab's bundled text, or any
`TextData`) cut to a target length in tokens; the model is asked for the value and
answers greedily; an answer is right when its first number is the value.

    result = needle_test(model, lengths=[256, 512], depths=[0, 0.5, 1])
    result.accuracy  # (lengths x depths) exact-match fractions

Shape notation: B batch (prompts of one length), S prompt length.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from headlab.data.texts import BUNDLED_SPEC, TextData, load_texts
from headlab.errors import UserError
from headlab.models.generation import generate
from headlab.objectives import objective_for

if TYPE_CHECKING:
    from headlab.models.base import HeadModel

__all__ = ["ANSWER_TOKENS", "DEFAULT_DEPTHS", "NeedleResult", "default_lengths", "needle_test"]

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MIN_LENGTH = 256
_KEYS = ("blue door", "old lighthouse", "north gate", "red bicycle", "glass tower",
         "river barge", "night train", "copper kettle", "west garden", "stone bridge")
ANSWER_TOKENS = 8
_NUMBER = re.compile(r"\d+")


@dataclass
class NeedleResult:
    """Exact-match accuracy per (length, depth): ``accuracy[i][j]`` is the fraction of
    ``trials`` prompts of ``lengths[i]`` tokens, fact at ``depths[j]``, answered right."""

    lengths: list[int]
    depths: list[float]
    accuracy: list[list[float]]
    trials: int
    filler: str

    @property
    def mean(self) -> float:
        return sum(map(sum, self.accuracy)) / max(1, len(self.lengths) * len(self.depths))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NeedleResult:
        return cls([int(n) for n in d["lengths"]], [float(x) for x in d["depths"]],
                   [[float(a) for a in row] for row in d["accuracy"]], int(d["trials"]),
                   str(d["filler"]))


def default_lengths(limit: int) -> list[int]:
    """256, 512, ... doubling up to the model's limit, the limit itself last."""
    if limit < MIN_LENGTH:
        return [limit]
    n = int(math.log2(limit / MIN_LENGTH))
    lengths = [MIN_LENGTH * 2 ** i for i in range(n + 1)]
    return lengths if lengths[-1] == limit else [*lengths, limit]


def _fact(key: str, value: str) -> str:
    return f"The secret code of the {key} is {value}. Remember it: {value}."


def _question(key: str) -> str:
    return f"\n\nWhat is the secret code of the {key}? The secret code of the {key} is"


def _prompt(filler: list[int], tokenizer, *, length: int, depth: float, key: str, value: str,
            offset: int) -> str:
    """Filler text of about ``length`` tokens with the fact at ``depth`` (moved to the
    nearest sentence end), then the question."""
    fixed = len(tokenizer(f" {_fact(key, value)} {_question(key)}",
                          add_special_tokens=False)["input_ids"])
    n = max(0, length - fixed - 2)
    window = [filler[(offset + i) % len(filler)] for i in range(n)]
    text = tokenizer.decode(window)
    at = _boundary(text, round(depth * len(text)))
    return f"{text[:at].rstrip()} {_fact(key, value)} {text[at:].lstrip()}".strip() + \
        _question(key)


def _boundary(text: str, at: int) -> int:
    """The sentence end nearest ``at`` (the ends of the text count), else the nearest
    space: the fact never splits a sentence, or at least a word."""
    for mark in (". ", " "):
        ends = [0, len(text)] + [i + 1 for i in (text.rfind(mark, 0, at), text.find(mark, at))
                                 if i >= 0]
        best = min(ends, key=lambda e: abs(e - at))
        if mark == " " or abs(best - at) <= max(1, len(text) // 8):
            return best
    return at


def _correct(answer: str, value: str) -> bool:
    found = _NUMBER.search(answer)
    return found is not None and found.group() == value


@torch.no_grad()
def needle_test(model: HeadModel, *, lengths: list[int] | None = None,
                depths: list[float] | tuple[float, ...] = DEFAULT_DEPTHS, trials: int = 1,
                filler: TextData | str | None = None, seed: int = 0,
                batch_size: int = 4) -> NeedleResult:
    """Exact-match retrieval of a planted fact for each (length, depth), greedy answers.

    ``lengths``: prompt lengths in tokens (default 256 doubling up to the model's
    limit); ``depths``: where the fact sits, 0 (start) to 1 (end); ``trials``: prompts
    per cell, each with its own key, value and stretch of filler (seeded); ``filler``:
    a `TextData` or a data spec (default headlab's bundled text).
    """
    if not objective_for(model).generates or model.tokenizer is None:
        raise UserError("the needle test asks a causal language model with a tokenizer, "
                        f"got a {model.kind}")
    limit = model.max_positions
    lengths = list(lengths) if lengths is not None else default_lengths(limit)
    too_long = [n for n in lengths if n + ANSWER_TOKENS > limit]
    if too_long or not lengths or min(lengths) < 64:
        raise UserError(f"needle lengths must be >= 64 and leave {ANSWER_TOKENS} tokens for "
                        f"the answer within the model's limit of {limit}; got {lengths}")
    if trials < 1 or not depths or any(not 0 <= d <= 1 for d in depths):
        raise UserError(f"needle trials must be >= 1 and depths in [0, 1]; got {trials}, "
                        f"{list(depths)}")
    data = filler if isinstance(filler, TextData) else load_texts(filler or BUNDLED_SPEC)
    tok = model.tokenizer
    stream = tok(" ".join(" ".join(data.texts).split()), add_special_tokens=False)["input_ids"]
    if len(stream) < max(lengths) // 2:
        raise UserError(f"{data.spec}: {len(stream)} filler tokens are too few for needle "
                        f"contexts of {max(lengths)}; give more text")
    gen = torch.Generator().manual_seed(seed)
    cells = []  # (length index, depth index, prompt, value)
    for i, length in enumerate(lengths):
        for j, depth in enumerate(depths):
            for _ in range(trials):
                key = _KEYS[int(torch.randint(len(_KEYS), (1,), generator=gen))]
                value = str(int(torch.randint(100_000, 1_000_000, (1,), generator=gen)))
                offset = int(torch.randint(len(stream), (1,), generator=gen))
                cells.append((i, j, _prompt(stream, tok, length=length, depth=depth,
                                            key=key, value=value, offset=offset), value))
    hits = [[0] * len(depths) for _ in lengths]
    for start in range(0, len(cells), batch_size):
        batch = cells[start:start + batch_size]
        for (i, j, _, value), answer in zip(batch, _answers(model, [c[2] for c in batch]),
                                            strict=True):
            hits[i][j] += _correct(answer, value)
    return NeedleResult(lengths, [float(d) for d in depths],
                        [[h / trials for h in row] for row in hits], trials, data.spec)


def _answers(model: HeadModel, prompts: list[str]) -> list[str]:
    """Greedy continuations of left-padded prompts on the KV cache."""
    tok = model.tokenizer
    encoded = [tok(p)["input_ids"][-(model.max_positions - ANSWER_TOKENS):] for p in prompts]
    width = max(map(len, encoded))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)  # (B, S)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(encoded):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    out = generate(model, ids.to(model.device), attention_mask=mask.to(model.device),
                   max_new_tokens=ANSWER_TOKENS, pad_token_id=pad)
    return [tok.decode(row[width:], skip_special_tokens=True) for row in out.tolist()]
