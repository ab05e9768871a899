"""Notebook views of attention: bertviz adapters, an offline headlab view, rollout.

Two kinds of view, because they differ in what they need:

* `head_view` and `model_view` hand headlab's captured patterns to bertviz. Building
  them in Python fetches nothing, but the HTML they produce loads require.js, d3 and
  jquery from cdnjs.cloudflare.com when a browser shows it: they need internet there.
* `attention_html` renders the HTML report's own attention gallery, explorer and
  statistics table for one text: inline JS and CSS, no network, shown in an iframe.

`inspect_text` is what ``headlab inspect`` runs; `rollout_for` composes the layers'
attention into token-to-token flows (Abnar & Zuidema 2020).

Notation used for tensor shapes: L layers, H heads of a layer (H_l after pruning,
H0 before), S tokens of the text.
"""

from __future__ import annotations

import html as _html
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headlab._util.io import atomic_write_text
from headlab.analysis import (
    HeadStats,
    TokenRoles,
    display_token,
    head_statistics,
    rollout,
)
from headlab.analysis.attribution import LogitAttribution
from headlab.attention.hooks import capture
from headlab.errors import UserError
from headlab.models.base import HeadModel
from headlab.report import encode_attention, render
from headlab.results import BeforeAfter, DataSummary, RunResult, Sample

__all__ = [
    "AttentionView",
    "attention_for_bertviz",
    "attention_html",
    "head_view",
    "inspect_text",
    "model_view",
    "rollout_for",
]

# Decimal places of the statistics `inspect_text` returns: attention mass to 1e-4 is
# finer than anything a reader compares, and keeps tables and JSON short.
_DECIMALS = 4


@dataclass
class _Encoded:
    """One text as the model sees it, and what it did with it."""

    tokens: list[str]
    patterns: list[torch.Tensor]  # one (1, H_l, S, S) float32 CPU tensor per layer
    head_ids: list[list[int]]  # original index of each captured head, per layer
    sentence_b_start: int | None


def _tokenizer(model: HeadModel) -> Any:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise UserError(
            "this model has no tokenizer (model.tokenizer is None); load it with its "
            "tokenizer files, or set model.tokenizer = AutoTokenizer.from_pretrained(...)"
        )
    return tok


def _accepts_token_types(model: HeadModel) -> bool:
    return "token_type_ids" in inspect.signature(model.forward).parameters


@torch.no_grad()
def _encode(model: HeadModel, text: str, text_b: str | None = None) -> _Encoded:
    """Tokenise ``text`` (and ``text_b`` as the second sentence of a pair), run the
    model once and capture every layer's attention pattern."""
    if not isinstance(text, str) or not text:
        raise UserError(f"text must be a non-empty string; got {text!r}")
    tok = _tokenizer(model)
    limit = getattr(model, "max_positions", None)
    pair = text_b is not None
    if pair and not (_accepts_token_types(model) or getattr(tok, "sep_token", None)):
        raise UserError(
            f"sentence pairs need a model with segment embeddings (BERT) or a tokenizer "
            f"with a separator token (RoBERTa, ModernBERT); this is a "
            f"{getattr(model, 'family', type(model).__name__)} model: join the two texts "
            "into one and pass it as text"
        )
    enc = tok(text, text_b, return_tensors="pt")
    ids = enc["input_ids"]  # (1, S)
    if limit is not None and ids.shape[1] > limit:
        raise UserError(f"the text is {ids.shape[1]} tokens, beyond the model's {limit} "
                        "positions; give a shorter text (nothing is cut silently)")
    valid = enc.get("attention_mask")
    extra = {}
    sentence_b_start = None
    if pair:
        types = enc.get("token_type_ids")
        if types is not None and bool((types == 1).any()):
            sentence_b_start = int(types[0].tolist().index(1))
            if _accepts_token_types(model):
                extra["token_type_ids"] = types.to(model.device)
        else:  # no segments: sentence b starts after the first run of separators
            sentence_b_start = _after_separators(ids[0].tolist(), tok.sep_token_id)
    with capture(model, "pattern", dtype=torch.float32, device="cpu") as cap:
        model(ids.to(model.device),
              attention_mask=None if valid is None else valid.to(model.device), **extra)
    names = sorted(cap.keys(), key=lambda n: int(n.split(".")[1]))
    return _Encoded(
        tokens=[str(t) for t in tok.convert_ids_to_tokens(ids[0].tolist())],
        patterns=[cap[n] for n in names],
        head_ids=[list(cap.head_ids[n]) for n in names],
        sentence_b_start=sentence_b_start,
    )


def _after_separators(ids: list[int], sep_id: int | None) -> int:
    """The index after the first run of ``sep_id`` that has tokens after it: where the
    second text of a pair starts (RoBERTa's ``</s></s>``, DistilBERT's ``[SEP]``)."""
    run_end = None
    for i, token in enumerate(ids):
        if token == sep_id:
            run_end = i + 1
        elif run_end is not None:
            return run_end
    raise UserError(
        "the tokenizer marked sentence b neither with token_type_ids nor with a separator "
        "token between the two texts"
    )


def _padded(enc: _Encoded, n_heads: int) -> list[torch.Tensor]:
    """Per layer (1, H0, S, S): each captured head at its original index, zeros where a
    head was pruned, so every layer has the same heads and head numbers stay original."""
    out = []
    for pattern, ids in zip(enc.patterns, enc.head_ids, strict=True):
        full = pattern.new_zeros((pattern.shape[0], n_heads, *pattern.shape[2:]))
        full[:, ids] = pattern  # (1, H0, S, S)
        out.append(full)
    return out


def _n_original_heads(model: HeadModel, enc: _Encoded) -> int:
    return max(getattr(model, "n_original_heads", 0),
               1 + max((h for ids in enc.head_ids for h in ids), default=-1))


def attention_for_bertviz(
    model: HeadModel, text: str, text_b: str | None = None
) -> tuple[tuple[torch.Tensor, ...], list[str], int | None]:
    """(attention, tokens, sentence_b_start) in the form bertviz's views take.

    ``attention`` holds one (1, H0, S, S) float32 CPU tensor per layer, captured from
    the ``pattern`` hook. bertviz needs the same number of heads in every layer, so in a
    pruned model each removed head is padded with an all-zero map at its original index:
    head numbers stay those of the unpruned model, and a pruned head shows no lines.
    ``tokens`` are the tokenizer's own strings (bertviz strips 'Ġ' and '▁' itself).
    With ``text_b`` (encoders) the two are tokenised as a sentence pair and
    ``sentence_b_start`` is the index of sentence b's first token: the first of segment
    1, or without segments the first after the separator run; else it is None.
    """
    enc = _encode(model, text, text_b)
    attention = tuple(_padded(enc, _n_original_heads(model, enc)))
    return attention, enc.tokens, enc.sentence_b_start


def head_view(model: HeadModel, text: str, text_b: str | None = None, **kw: Any) -> Any:
    """bertviz's head view of ``model`` on ``text`` (or the pair ``text``, ``text_b``).

    ``kw`` goes to ``bertviz.head_view`` (layer, heads, include_layers,
    prettify_tokens, html_action). By default bertviz displays the view in the notebook
    and returns None; ``html_action="return"`` returns an ``IPython.display.HTML``
    instead. Building it fetches nothing, but the view loads require.js, d3 and jquery
    from a CDN in the browser: it needs internet to draw. Pruned heads are blank (see
    `attention_for_bertviz`). For an offline view use `attention_html`.
    """
    from bertviz import head_view as _bertviz_head_view

    attention, tokens, sentence_b_start = attention_for_bertviz(model, text, text_b)
    return _bertviz_head_view(attention=attention, tokens=tokens,
                              sentence_b_start=sentence_b_start, **kw)


def model_view(model: HeadModel, text: str, text_b: str | None = None, **kw: Any) -> Any:
    """bertviz's model view (every layer x head at once) of ``model`` on ``text``.

    ``kw`` goes to ``bertviz.model_view`` (display_mode, include_layers,
    include_heads, prettify_tokens, html_action); as with `head_view`, the default
    displays in the notebook, ``html_action="return"`` returns the HTML, and drawing
    it needs internet (require.js, d3 and jquery come from a CDN).
    """
    from bertviz import model_view as _bertviz_model_view

    attention, tokens, sentence_b_start = attention_for_bertviz(model, text, text_b)
    return _bertviz_model_view(attention=attention, tokens=tokens,
                               sentence_b_start=sentence_b_start, **kw)


# ---------------------------------------------------------------------------------------
# The offline view


@dataclass
class AttentionView:
    """A standalone HTML page (``page``) of one text's attention, made by headlab.report.

    In Jupyter it shows inside an ``<iframe srcdoc=...>``: the page keeps its own
    Content-Security-Policy and scripts there, and cannot touch the notebook.
    ``save(path)`` writes the page to a file that opens in any browser, offline.
    """

    page: str
    height: int = 720

    def _repr_html_(self) -> str:
        return (
            f'<iframe srcdoc="{_html.escape(self.page, quote=True)}" '
            f'sandbox="allow-scripts" style="width:100%;height:{int(self.height)}px;'
            'border:1px solid #d0d7de" title="headlab attention view"></iframe>'
        )

    def save(self, path: str | Path) -> Path:
        """Write the page atomically; returns the path."""
        return atomic_write_text(path, self.page)

    def __str__(self) -> str:
        return self.page


def _statistics(model: HeadModel, enc: _Encoded) -> HeadStats:
    tok = _tokenizer(model)
    roles = TokenRoles.from_tokens([enc.tokens], cls_token=getattr(tok, "cls_token", None),
                                   sep_token=getattr(tok, "sep_token", None))
    return head_statistics(enc.patterns, roles, head_ids=enc.head_ids)


def _result(model: HeadModel, text: str, enc: _Encoded, stats: HeadStats) -> RunResult:
    """The smallest RunResult that headlab.report's one-text view renders: the sample's
    attention and the statistics (``importance``, which the view does not show, holds
    per-head confidence, since a RunResult requires it)."""
    n_heads = _n_original_heads(model, enc)
    confidence = [[math.nan] * n_heads for _ in enc.patterns]
    for record in stats.records:
        confidence[record["layer"]][record["head"]] = record["confidence"]
    pruned = any(len(ids) < n_heads for ids in enc.head_ids)
    attention = torch.cat(_padded(enc, n_heads))  # (L, H0, S, S)
    return RunResult(
        model=str(getattr(model, "source", None) or type(model).__name__),
        method="inspect", importance=confidence, heads_total=len(enc.patterns) * n_heads,
        family=getattr(model, "family", None), kind=getattr(model, "kind", None),
        # a pruned model's missing heads show as pruned; an unpruned one is "score only"
        heads_kept=sum(len(ids) for ids in enc.head_ids) if pruned else None,
        kept_heads=dict(enumerate(enc.head_ids)) if pruned else None,
        data=DataSummary(spec=f"one text, {len(enc.tokens)} tokens", seq_len=len(enc.tokens)),
        params=BeforeAfter(model.num_parameters()),
        sample=Sample(text, [display_token(t) for t in enc.tokens],
                      encode_attention(attention)),
        statistics=stats.records,
    )


def attention_html(model: HeadModel, text: str, *, height: int = 720) -> AttentionView:
    """An offline view of ``model``'s attention on ``text``: headlab's report page with
    the attention gallery (one map per head), the bertviz-style explorer and the
    per-head statistics.

    Everything is inline (no CDN, no network; the page's policy forbids fetches), and
    tokens are escaped, so a hostile text cannot run code. Heads a pruned model lacks
    are marked pruned and shown as empty maps. Returns an `AttentionView`: displays in
    Jupyter, ``.page`` is the HTML, ``.save(path)`` writes it.
    """
    enc = _encode(model, text)
    page = render(_result(model, text, enc, _statistics(model, enc)), view="text")
    return AttentionView(page, height=height)


# ---------------------------------------------------------------------------------------
# One text, from the command line or a notebook


def _load(model_or_name: HeadModel | str | Path, device: str) -> HeadModel:
    if isinstance(model_or_name, torch.nn.Module):
        return model_or_name
    from headlab.models import load
    from headlab.runs.config import resolve_device

    return load(model_or_name, device=resolve_device(device))


def _rounded(value: Any) -> Any:
    return round(value, _DECIMALS) if isinstance(value, float) and math.isfinite(value) \
        else value


def inspect_text(
    model_or_name: HeadModel | str | Path,
    text: str,
    *,
    html: str | Path | None = None,
    device: str = "auto",
    attribution: LogitAttribution | None = None,
) -> tuple[list[dict[str, Any]], Path | None]:
    """Per-head statistics of one text, and optionally the offline HTML view of it.

    ``model_or_name``: a loaded model, or a name or path for `headlab.load` (then
    ``device``, "auto", "cpu" or "cuda", says where it goes). Returns (records, path):
    one dict per present head with ``layer``, ``head`` (original index) and the
    statistics of `headlab.analysis.STAT_NAMES` (entropy in nats; first, cls, sep,
    punct, self, prev, next as mean attention mass; confidence), rounded to 4 decimals;
    and the file written (atomically) when ``html`` is given, else None; the page shows
    ``attribution`` (`headlab.logit_attribution` of the same text) where given.
    """
    model = _load(model_or_name, device)
    enc = _encode(model, text)
    stats = _statistics(model, enc)
    written = None
    if html is not None:
        page = render(_result(model, text, enc, stats), view="text", attribution=attribution)
        written = atomic_write_text(html, page)
    records = [{k: _rounded(v) for k, v in r.items()} for r in stats.records]
    return records, written


def rollout_for(
    model: HeadModel, text: str, *, head_fusion: str = "mean"
) -> tuple[list[str], torch.Tensor]:
    """(tokens, R) with R (S, S) the attention rollout of ``model`` on ``text``.

    Row i of R says how much of position i's final representation flows from each
    input token, composing all layers with the residual stream (Abnar & Zuidema 2020;
    see `headlab.analysis.rollout`). Heads are fused per layer by ``head_fusion``
    ("mean", "max" or "min") over the heads the model has: pruned heads do not count.
    """
    enc = _encode(model, text)
    flow = rollout(enc.patterns, head_fusion=head_fusion)  # (1, S, S)
    return [display_token(t) for t in enc.tokens], flow[0]
