"""The real-text benchmarks' data: (scoring, held-out) blocks of a source, prepared by the
model's objective, as a run would build them (`headlab.runs.inputs.build_sets`)."""

from __future__ import annotations

from headlab.data import enwiki, protocol
from headlab.data.blocks import Blocks, split_blocks
from headlab.data.texts import load_texts
from headlab.models.base import HeadModel
from headlab.objectives import objective_for
from headlab.runs.inputs import build_sets


def scoring_and_heldout(model: HeadModel, spec: str | None, *, seq_len: int, max_tokens: int,
                        batch_size: int, seed: int = 0) -> tuple[Blocks, Blocks]:
    """``enwiki``: its articles split by seed into calibration and evaluation, each read as
    the model's kind reads a corpus (``max_tokens`` from each part); anything else (None:
    the bundled text) cut into blocks under ``max_tokens``, the blocks split in half."""
    objective = objective_for(model)
    texts = load_texts(spec)
    if texts.documents:
        settings = protocol.Settings(kind=model.kind, seq_len=seq_len, max_tokens=max_tokens,
                                     seed=seed)
        scoring, heldout = build_sets(settings, model.tokenizer, texts, None)
    else:
        blocks = objective.make_blocks(texts, model.tokenizer, seq_len=seq_len,
                                       max_tokens=max_tokens)
        scoring, heldout = split_blocks(blocks, seed=seed)
    return (objective.prepare(model, scoring, batch_size=batch_size, seed=seed),
            objective.prepare(model, heldout, batch_size=batch_size, seed=seed + 1))


def describe(spec: str | None) -> str:
    """The benchmark JSON's account of the data."""
    if spec == enwiki.SPEC:
        return (f"{enwiki.SOURCE}: its articles split by seed 0, half for calibration "
                "(scoring, and what recovery fits on) and half for evaluation, no article in "
                "both; a causal LM reads each half's articles joined by blank lines in "
                "windows of the given length, a seeded sample of them under the token "
                "budget (the budget applies to each half)")
    return ("the bundled English text in blocks of the given length under the token budget, "
            "split in half (seed 0): scoring blocks choose the heads, held-out blocks measure")
