"""Per-head statistics, head clustering and attention rollout.

What each head does, measured over a dataset: how spread its attention is (entropy), how
sure it is (mean max weight, Voita et al. 2019), and how much of it goes to fixed places:
the first token, [CLS], [SEP], punctuation, the token itself, the previous and the next
token (Clark et al. 2019, "What does BERT look at?"). The statistics stream over batches
(`HeadStatsAccumulator`), so a dataset never has to fit in memory; `cluster_heads` groups
heads by these numbers and names each group by its behaviour; `rollout` composes the
layers' attention into token-to-token flows (Abnar & Zuidema 2020).

Notation used for tensor shapes:
    B   batch size
    H   heads of one layer (may differ per layer after pruning, hence lists of tensors)
    S   query length
    T   key length (statistics and rollout need self-attention, so T == S)
    N   heads over all layers, one record each
    F   extra features per head

Numeric conventions:
    * a pattern row holds one query's weights over its keys and sums to 1 over the valid
      keys; weights on masked keys are zeroed here, never renormalised;
    * invalid query rows, and rows with no weight left at all (fully masked), are skipped:
      they never enter a mean, so no NaN comes out of them;
    * 0 * log(0) = 0 in entropies (nats);
    * per-row values are computed in float64 and summed in float64, so streaming over
      batches gives the one-shot result up to float64 rounding.
"""

from __future__ import annotations

import html
import json
import math
import string
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "STAT_NAMES",
    "HeadClusters",
    "HeadStats",
    "HeadStatsAccumulator",
    "TokenRoles",
    "attention_entropy",
    "cluster_heads",
    "head_statistics",
    "pattern_features",
    "rollout",
]

# The per-head statistics, in record order (after "layer" and "head").
STAT_NAMES: tuple[str, ...] = (
    "entropy",  # mean entropy of a query's attention over valid keys, nats
    "first",  # mean mass on the first valid position (BOS / [CLS])
    "cls",  # mean mass on [CLS] tokens
    "sep",  # mean mass on [SEP] tokens
    "punct",  # mean mass on punctuation tokens
    "self",  # mean mass on key == query
    "prev",  # mean mass on key == query - 1
    "next",  # mean mass on key == query + 1
    "confidence",  # mean max weight of a row (Voita et al. 2019)
)

# Tokenizer word-boundary marks: GPT-2 byte-level space, newline and tab, SentencePiece
# space. WordPiece's "##" prefix and BPE's "</w>" suffix are handled as affixes.
_BOUNDARY_MARKS = "Ġ▁Ċĉ"

# Behaviours a cluster can be named after, in tie-break order, with their names. Each
# names the cluster whose mean of that statistic stands furthest above the overall mean.
_BEHAVIOUR_NAMES: dict[str, str] = {
    "prev": "previous-token heads",
    "next": "next-token heads",
    "self": "self heads",
    "first": "first-token sinks",
    "cls": "[CLS] heads",
    "sep": "[SEP] heads",
    "punct": "punctuation heads",
    "entropy": "broad (high-entropy) heads",
    "confidence": "focused heads",
}

# Spread below which a feature counts as constant when standardising: a 0.05 share of
# attention (or 0.05 nats). Without it, a column that is zero up to rounding (say [SEP]
# mass in a model that has no [SEP]) would be blown up to unit variance and drive both
# the clustering and the names.
_MIN_SPREAD = 0.05

# KMeans restarts: fixed, so that a seed fully determines the clustering.
_KMEANS_N_INIT = 10

# Largest number of clusters tried when choosing k by silhouette.
_MAX_AUTO_CLUSTERS = 8


# ---------------------------------------------------------------------------------------
# Token roles


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


# ---------------------------------------------------------------------------------------
# Per-head statistics


def attention_entropy(pattern: Tensor, valid_keys: Tensor | None = None) -> Tensor:
    """Entropy (nats) of each query's attention over the valid keys: (B, H, S, T) -> (B, H, S).

    Weights on invalid keys (``valid_keys`` (B, T), True = valid) are taken as 0, and
    0 * log(0) = 0, so a one-hot row has entropy 0 and a uniform row over n keys log(n).
    Computed in the pattern's dtype, at least float32.
    """
    _check_4d(pattern, "pattern")
    p = pattern.to(torch.promote_types(pattern.dtype, torch.float32))
    if valid_keys is not None:
        keys = torch.as_tensor(valid_keys, dtype=torch.bool, device=p.device)
        if keys.shape != (p.shape[0], p.shape[-1]):
            raise ValueError(
                f"valid_keys has shape {tuple(keys.shape)}; expected (B, T) = "
                f"{(p.shape[0], p.shape[-1])} for a pattern of shape {tuple(p.shape)}."
            )
        p = p.masked_fill(~keys[:, None, None, :], 0.0)
    return torch.special.entr(p).sum(dim=-1)  # (B, H, S)


def _row_statistics(pattern: Tensor, roles: TokenRoles) -> tuple[Tensor, Tensor]:
    """Each statistic for each query row, and which rows count.

    Returns rows (B, H, S, len(STAT_NAMES)) in float64 and keep (B, H, S) bool: the query
    is valid and some weight is left on its valid keys.
    """
    p = pattern.to(torch.float64)  # (B, H, S, T)
    valid = roles.valid.to(p.device)  # (B, S)
    pair = valid[:, None, :, None] & valid[:, None, None, :]  # (B, 1, S, T)
    p = p.masked_fill(~pair, 0.0)
    keep = valid[:, None, :] & (p.sum(dim=-1) > 0)  # (B, H, S)

    entropy = torch.special.entr(p).sum(dim=-1)  # (B, H, S)
    places = torch.stack([roles.first, roles.cls, roles.sep, roles.punct], dim=-1)  # (B, T, 4)
    mass = p @ places.to(device=p.device, dtype=p.dtype)[:, None]  # (B, H, S, 4)
    zero = p.new_zeros(p.shape[:-2] + (1,))  # (B, H, 1)
    on_self = torch.diagonal(p, offset=0, dim1=-2, dim2=-1)  # (B, H, S)
    # Below the diagonal, p[q, q-1] for q = 1..S-1; query 0 has no previous token.
    on_prev = torch.cat([zero, torch.diagonal(p, offset=-1, dim1=-2, dim2=-1)], dim=-1)
    # Above it, p[q, q+1] for q = 0..S-2; the last query has no next token.
    on_next = torch.cat([torch.diagonal(p, offset=1, dim1=-2, dim2=-1), zero], dim=-1)
    confidence = p.amax(dim=-1)  # (B, H, S)
    rows = torch.stack(
        [entropy, *mass.unbind(dim=-1), on_self, on_prev, on_next, confidence], dim=-1
    )  # (B, H, S, 9)
    return rows, keep


@dataclass
class HeadStats:
    """Per-head statistics over a dataset: one record per head, layer by layer.

    Each record is a dict with keys ``layer``, ``head`` (the original head index) and the
    statistics in STAT_NAMES: entropy (nats), first, cls, sep, punct, self, prev, next
    (mean attention mass) and confidence (mean max weight). A head that never had a row
    to average has NaN values.
    """

    records: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.records)

    def to_records(self) -> list[dict[str, Any]]:
        """A copy of the records (list of dicts), safe to modify."""
        return [dict(record) for record in self.records]

    def to_dataframe(self) -> Any:
        """The records as a pandas DataFrame, one row per head."""
        try:
            import pandas as pd
        except ImportError as err:
            raise ImportError(
                "HeadStats.to_dataframe needs pandas: pip install pandas "
                "(or use HeadStats.to_records() for plain dicts)."
            ) from err
        return pd.DataFrame(self.to_records(), columns=["layer", "head", *STAT_NAMES])

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict {"records": [...]}; NaN becomes null, as JSON has no NaN."""
        return {
            "records": [
                {key: _nan_to_none(value) for key, value in record.items()}
                for record in self.records
            ]
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> HeadStats:
        """Inverse of to_json; also accepts the dict serialised as a JSON string."""
        if isinstance(data, str):
            data = json.loads(data)
        if not isinstance(data, dict) or "records" not in data:
            raise ValueError(
                "HeadStats.from_json expects the dict written by HeadStats.to_json, "
                f"with a 'records' list; got {type(data).__name__}."
            )
        records = []
        for record in data["records"]:
            missing = {"layer", "head", *STAT_NAMES} - set(record)
            if missing:
                raise ValueError(f"a HeadStats record lacks {sorted(missing)}: {record}")
            out = {"layer": int(record["layer"]), "head": int(record["head"])}
            for name in STAT_NAMES:
                value = record[name]
                out[name] = math.nan if value is None else float(value)
            records.append(out)
        return cls(records)

    def _repr_html_(self) -> str:
        columns = ["layer", "head", *STAT_NAMES]
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = []
        for record in self.records:
            cells = [str(record["layer"]), str(record["head"])]
            cells += [_format_number(record[name]) for name in STAT_NAMES]
            body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        n_layers = len({record["layer"] for record in self.records})
        caption = (
            f"HeadStats: {len(self.records)} heads in {n_layers} layers "
            "(entropy in nats; other columns are mean attention mass)"
        )
        return (
            '<table class="headlab-headstats" style="border-collapse:collapse;'
            'font-family:monospace;font-size:12px;text-align:right">'
            f"<caption style=\"text-align:left\">{html.escape(caption)}</caption>"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        )


def _nan_to_none(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def _format_number(value: float) -> str:
    return "&ndash;" if value is None or math.isnan(value) else f"{value:.3f}"


class HeadStatsAccumulator:
    """Streams per-head statistics over batches.

    Sums (float64) and row counts are kept per head, so ``result()`` after several
    ``update`` calls equals ``head_statistics`` on the concatenated batches. Batches may
    differ in size and length; each layer's heads must stay the same across batches.
    """

    def __init__(self, n_layers: int) -> None:
        if n_layers < 1:
            raise ValueError(f"n_layers must be at least 1; got {n_layers}.")
        self.n_layers = n_layers
        self._sums: list[Tensor | None] = [None] * n_layers  # each (H, len(STAT_NAMES))
        self._counts: list[Tensor | None] = [None] * n_layers  # each (H,)
        self._head_ids: list[list[int] | None] = [None] * n_layers

    def update(
        self,
        patterns: Sequence[Tensor] | Tensor,
        roles: TokenRoles,
        head_ids: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Add one batch: per-layer patterns (B, H_l, S, S) and the batch's TokenRoles.

        ``head_ids[l]`` names the original index of each head of layer l (default
        0..H_l-1), so the records of a pruned model keep the indices of the full one.
        """
        layers = _as_layers(patterns)
        if len(layers) != self.n_layers:
            raise ValueError(
                f"got patterns for {len(layers)} layers; this accumulator was made for "
                f"{self.n_layers}. Pass one (B, H, S, S) tensor per layer."
            )
        if not isinstance(roles, TokenRoles):
            raise TypeError(
                f"roles must be a TokenRoles, got {type(roles).__name__}; build one with "
                "TokenRoles.from_tokens(...) or TokenRoles.from_mask(attention_mask)."
            )
        ids = _check_head_ids(head_ids, layers)
        for layer, pattern in enumerate(layers):
            _check_square(pattern, f"patterns[{layer}]")
            if (pattern.shape[0], pattern.shape[2]) != roles.shape:
                raise ValueError(
                    f"patterns[{layer}] has shape {tuple(pattern.shape)} (B, H, S, S) but "
                    f"roles are (B, S) = {roles.shape}; build the roles from the same batch."
                )
            known = self._head_ids[layer]
            if known is not None and known != ids[layer]:
                raise ValueError(
                    f"layer {layer} had heads {known} in earlier batches and {ids[layer]} "
                    "now; use one accumulator per model (heads must not change between "
                    "batches)."
                )
        for layer, pattern in enumerate(layers):
            rows, keep = _row_statistics(pattern, roles)
            sums = torch.where(keep[..., None], rows, 0.0).sum(dim=(0, 2)).cpu()  # (H, 9)
            counts = keep.sum(dim=(0, 2)).cpu()  # (H,)
            if self._sums[layer] is None:
                self._sums[layer], self._counts[layer] = sums, counts
                self._head_ids[layer] = ids[layer]
            else:
                self._sums[layer] += sums
                self._counts[layer] += counts

    def all_reduce(self) -> None:
        """Sum the accumulators over torch.distributed ranks (every rank must call it,
        each having seen at least one batch); nothing happens outside torchrun."""
        from headlab import distributed

        if not distributed.active():
            return
        for layer in range(self.n_layers):
            if self._sums[layer] is None:
                raise ValueError("all_reduce needs at least one batch on every rank")
            self._sums[layer] = distributed.all_reduce_sum(self._sums[layer])
            self._counts[layer] = distributed.all_reduce_sum(self._counts[layer])

    def result(self) -> HeadStats:
        """The mean of each statistic per head over every row seen so far."""
        if self._sums[0] is None:
            raise ValueError("no data yet: call update(patterns, roles) with a batch first.")
        records = []
        for layer in range(self.n_layers):
            sums, counts = self._sums[layer], self._counts[layer]
            for h, head in enumerate(self._head_ids[layer]):
                n = int(counts[h])
                means = (sums[h] / n).tolist() if n else [math.nan] * len(STAT_NAMES)
                stat_values = dict(zip(STAT_NAMES, means, strict=True))
                records.append({"layer": layer, "head": head, **stat_values})
        return HeadStats(records)


def head_statistics(
    patterns: Sequence[Tensor] | Tensor,
    roles: TokenRoles,
    head_ids: Sequence[Sequence[int]] | None = None,
) -> HeadStats:
    """Per-head statistics of one batch (or a whole dataset held in memory).

    ``patterns`` holds one (B, H_l, S, S) tensor per layer (a stacked (L, B, H, S, S)
    tensor also works); see HeadStatsAccumulator to stream over batches.
    """
    layers = _as_layers(patterns)
    accumulator = HeadStatsAccumulator(len(layers))
    accumulator.update(layers, roles, head_ids)
    return accumulator.result()


def pattern_features(
    patterns: Sequence[Tensor] | Tensor,
    *,
    valid: Tensor | None = None,
    max_offset: int = 8,
) -> np.ndarray:
    """Mean attention by relative position, one row per head: (N, 2 * max_offset + 2).

    Column j < 2 * max_offset + 1 is the mean mass on key = query + (j - max_offset); the
    last column is the mass further away. Unlike cropped mean patterns this does not
    depend on sequence length or padding, so it is a fair extra input for cluster_heads.
    Rows follow the record order of head_statistics on the same patterns.
    """
    if max_offset < 0:
        raise ValueError(f"max_offset must be >= 0; got {max_offset}.")
    layers = _as_layers(patterns)
    out = []
    for layer, pattern in enumerate(layers):
        _check_square(pattern, f"patterns[{layer}]")
        n_batch, _, length, _ = pattern.shape
        keys = torch.ones(n_batch, length, dtype=torch.bool) if valid is None else valid
        keys = torch.as_tensor(keys, dtype=torch.bool, device=pattern.device)
        if keys.shape != (n_batch, length):
            raise ValueError(
                f"valid has shape {tuple(keys.shape)}; expected (B, S) = {(n_batch, length)}."
            )
        p = pattern.to(torch.float64)  # (B, H, S, S)
        p = p.masked_fill(~(keys[:, None, :, None] & keys[:, None, None, :]), 0.0)
        keep = keys[:, None, :] & (p.sum(dim=-1) > 0)  # (B, H, S)
        count = keep.sum(dim=(0, 2)).clamp_min(1).to(torch.float64)  # (H,)
        columns = []
        for offset in range(-max_offset, max_offset + 1):
            if abs(offset) >= length:
                columns.append(p.new_zeros(p.shape[1]))
                continue
            diagonal = torch.diagonal(p, offset=offset, dim1=-2, dim2=-1)  # (B, H, S-|d|)
            rows = keep[..., -offset:] if offset < 0 else keep[..., : length - offset]
            columns.append(torch.where(rows, diagonal, 0.0).sum(dim=(0, 2)))
        window = torch.stack(columns, dim=-1)  # (H, 2 * max_offset + 1)
        total = torch.where(keep, p.sum(dim=-1), 0.0).sum(dim=(0, 2))  # (H,)
        beyond = (total - window.sum(dim=-1)).clamp_min(0.0)
        out.append(torch.cat([window, beyond[:, None]], dim=-1) / count[:, None])
    return torch.cat(out, dim=0).cpu().numpy()


# ---------------------------------------------------------------------------------------
# Attention rollout


def rollout(
    patterns: Sequence[Tensor] | Tensor,
    *,
    add_residual: bool = True,
    head_fusion: Literal["mean", "max", "min"] = "mean",
    valid: Tensor | None = None,
) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020): (B, S, S) flow from input tokens.

    Per layer the heads are fused (mean, max or min over heads), the residual stream is
    added as A' = 0.5 * A + 0.5 * I, rows are renormalised, and the layers are multiplied
    in order: R = A'_L @ ... @ A'_1. Row i of R says how much of output position i comes
    from each input token. With ``valid`` (B, S), padding gets no flow and its rows are 0.
    Computed in float64, returned in the patterns' dtype (at least float32).
    """
    if head_fusion not in ("mean", "max", "min"):
        raise ValueError(f"head_fusion must be 'mean', 'max' or 'min'; got {head_fusion!r}.")
    layers = _as_layers(patterns)
    first = layers[0]
    for layer, pattern in enumerate(layers):
        _check_square(pattern, f"patterns[{layer}]")
        if (pattern.shape[0], pattern.shape[2]) != (first.shape[0], first.shape[2]):
            raise ValueError(
                f"patterns[{layer}] has shape {tuple(pattern.shape)} but patterns[0] has "
                f"{tuple(first.shape)}; every layer must cover the same (B, S)."
            )
    n_batch, length = first.shape[0], first.shape[2]
    pair = None
    if valid is not None:
        mask = torch.as_tensor(valid, dtype=torch.bool, device=first.device)
        if mask.shape != (n_batch, length):
            raise ValueError(
                f"valid has shape {tuple(mask.shape)}; expected (B, S) = {(n_batch, length)}."
            )
        pair = mask[:, :, None] & mask[:, None, :]  # (B, S, S)
    eye = torch.eye(length, dtype=torch.float64, device=first.device)  # (S, S)
    flow = None
    for pattern in layers:
        p = pattern.to(torch.float64)  # (B, H, S, S)
        if head_fusion == "mean":
            a = p.mean(dim=1)  # (B, S, S)
        elif head_fusion == "max":
            a = p.amax(dim=1)
        else:
            a = p.amin(dim=1)
        if pair is not None:
            a = a.masked_fill(~pair, 0.0)
        if add_residual:
            a = 0.5 * a + 0.5 * eye
        total = a.sum(dim=-1, keepdim=True)  # (B, S, 1)
        a = a / torch.where(total > 0, total, 1.0)  # rows with no weight stay 0, not NaN
        flow = a if flow is None else a @ flow
    if pair is not None:
        flow = flow.masked_fill(~pair, 0.0)
    return flow.to(torch.promote_types(first.dtype, torch.float32))


# ---------------------------------------------------------------------------------------
# Clustering


@dataclass
class HeadClusters:
    """Heads grouped by behaviour.

    ``labels[i]`` is the cluster of ``stats.records[i]``; ``coords[i]`` its [x, y] on the
    first two principal components of the standardised features; ``names`` maps each
    cluster to a readable, unique name; ``method`` says how it was computed.
    """

    labels: list[int]
    coords: list[list[float]]
    names: dict[int, str]
    method: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict {"labels", "coords", "names", "method"} (names keyed by str)."""
        return {
            "labels": list(self.labels),
            "coords": [list(xy) for xy in self.coords],
            "names": {str(k): v for k, v in self.names.items()},
            "method": self.method,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> HeadClusters:
        """Inverse of to_json; also accepts the dict serialised as a JSON string."""
        if isinstance(data, str):
            data = json.loads(data)
        missing = {"labels", "coords", "names", "method"} - set(data)
        if missing:
            raise ValueError(f"HeadClusters.from_json: missing keys {sorted(missing)}.")
        return cls(
            labels=[int(x) for x in data["labels"]],
            coords=[[float(x), float(y)] for x, y in data["coords"]],
            names={int(k): str(v) for k, v in data["names"].items()},
            method=str(data["method"]),
        )

    def _repr_html_(self) -> str:
        sizes = {c: self.labels.count(c) for c in self.names}
        rows = "".join(
            f"<tr><td>{c}</td><td style=\"color:{_colour(c)}\">&#9679;</td>"
            f"<td style=\"text-align:left\">{html.escape(name)}</td><td>{sizes[c]}</td></tr>"
            for c, name in sorted(self.names.items())
        )
        return (
            '<div class="headlab-clusters" style="font-family:monospace;font-size:12px">'
            f"{self._scatter_svg()}"
            '<table style="border-collapse:collapse;text-align:right">'
            "<thead><tr><th>cluster</th><th></th><th>name</th><th>heads</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
            f"<div>{html.escape(self.method)}</div></div>"
        )

    def _scatter_svg(self, width: int = 320, height: int = 220, pad: int = 10) -> str:
        """An inline SVG scatter of coords, coloured by cluster (no scripts, no CDN)."""
        if not self.coords:
            return ""
        xs = [xy[0] for xy in self.coords]
        ys = [xy[1] for xy in self.coords]
        span_x = (max(xs) - min(xs)) or 1.0
        span_y = (max(ys) - min(ys)) or 1.0
        dots = []
        for i, ((x, y), label) in enumerate(zip(self.coords, self.labels, strict=True)):
            cx = pad + (x - min(xs)) / span_x * (width - 2 * pad)
            cy = height - pad - (y - min(ys)) / span_y * (height - 2 * pad)
            title = html.escape(f"#{i}: {self.names.get(label, label)}")
            dots.append(
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{_colour(label)}" '
                f'fill-opacity="0.8"><title>{title}</title></circle>'
            )
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'style="border:1px solid #ccc">{"".join(dots)}</svg>'
        )


_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")


def _colour(label: int) -> str:
    return _PALETTE[label % len(_PALETTE)]


def cluster_heads(
    stats: HeadStats,
    *,
    pattern_features: Any = None,
    n_clusters: int | None = None,
    seed: int = 0,
) -> HeadClusters:
    """Group heads by their statistics with KMeans and name each group by its behaviour.

    Features are the STAT_NAMES columns of ``stats``, standardised, plus optional extra
    features (N, F) aligned with ``stats.records`` (e.g. from ``pattern_features``),
    standardised and scaled so that the F extra columns together weigh as much as the
    statistics. With ``n_clusters`` None, k is chosen by silhouette over 2..min(8, N-1).
    Cluster numbers follow the order of first appearance in the records. A cluster is named
    after the statistic whose cluster mean stands furthest above the overall mean (in
    standard deviations): "previous-token heads", "first-token sinks", "[SEP] heads",
    "broad (high-entropy) heads", ...; a repeated name gets " 2", " 3" appended.
    """
    # scikit-learn is imported here, not at module level: it takes about a second to load
    # and only clustering needs it.
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA
    from sklearn.metrics import silhouette_score

    records = stats.records
    n_heads = len(records)
    if n_heads == 0:
        raise ValueError("cluster_heads needs at least one head; stats.records is empty.")
    values = np.array([[r[name] for name in STAT_NAMES] for r in records], dtype=np.float64)
    if not np.isfinite(values).all():
        bad = [(r["layer"], r["head"]) for r, row in zip(records, values, strict=True)
               if not np.isfinite(row).all()]
        raise ValueError(
            f"heads {bad} (layer, head) have non-finite statistics (no valid rows were seen); "
            "drop those records before clustering."
        )
    z_stats = _standardise(values)  # (N, 9)
    blocks = [z_stats]
    n_extra = 0
    if pattern_features is not None:
        extra = np.asarray(pattern_features, dtype=np.float64)
        if extra.ndim == 1:
            extra = extra[:, None]
        if extra.ndim != 2 or extra.shape[0] != n_heads:
            raise ValueError(
                f"pattern_features has shape {extra.shape}; expected ({n_heads}, F), one row "
                "per record of stats, in the same order."
            )
        if not np.isfinite(extra).all():
            raise ValueError("pattern_features contains NaN or infinite values.")
        n_extra = extra.shape[1]
        blocks.append(_standardise(extra) * math.sqrt(len(STAT_NAMES) / max(n_extra, 1)))
    features = np.concatenate(blocks, axis=1)  # (N, 9 + F)
    n_distinct = len(np.unique(features.round(12), axis=0))

    if n_clusters is not None:
        if not 1 <= n_clusters <= n_heads:
            raise ValueError(f"n_clusters must be between 1 and {n_heads} heads; got {n_clusters}.")
        k = n_clusters
        how = "k given"
    else:
        k_max = min(_MAX_AUTO_CLUSTERS, n_heads - 1, n_distinct)
        k, how = 1, "k = 1: fewer than 2 distinct heads"
        best = -math.inf
        for candidate in range(2, k_max + 1):
            labels = _kmeans(KMeans, features, candidate, seed)
            score = float(silhouette_score(features, labels))
            if score > best:
                k, best = candidate, score
                how = f"k by silhouette over 2..{k_max}, best {best:.3f}"
    labels = _kmeans(KMeans, features, k, seed) if k > 1 else np.zeros(n_heads, dtype=int)
    labels = _relabel_by_appearance(labels)

    coords = np.zeros((n_heads, 2))
    if n_distinct > 1:
        n_components = min(2, n_heads, features.shape[1])
        projected = PCA(n_components=n_components, svd_solver="full").fit_transform(features)
        coords[:, :n_components] = projected

    return HeadClusters(
        labels=[int(x) for x in labels],
        coords=[[float(x), float(y)] for x, y in coords],
        names=_name_clusters(z_stats, labels),
        method=(
            f"KMeans(n_clusters={k}, n_init={_KMEANS_N_INIT}, random_state={seed}); {how}; "
            f"features: {len(STAT_NAMES)} standardised statistics + {n_extra} pattern "
            "features; coords: PCA, 2 components"
        ),
    )


def _standardise(x: np.ndarray) -> np.ndarray:
    """Column z-scores, with spreads below _MIN_SPREAD taken as _MIN_SPREAD."""
    return (x - x.mean(axis=0)) / np.maximum(x.std(axis=0), _MIN_SPREAD)


def _kmeans(kmeans: Any, features: np.ndarray, k: int, seed: int) -> np.ndarray:
    model = kmeans(n_clusters=k, n_init=_KMEANS_N_INIT, random_state=seed)
    return model.fit_predict(features)


def _relabel_by_appearance(labels: np.ndarray) -> np.ndarray:
    """Renumber clusters 0, 1, ... in order of first appearance, so runs compare."""
    order: dict[int, int] = {}
    for label in labels:
        order.setdefault(int(label), len(order))
    return np.array([order[int(label)] for label in labels], dtype=int)


def _name_clusters(z_stats: np.ndarray, labels: np.ndarray) -> dict[int, str]:
    """Name each cluster after its most distinctive behaviour; make the names unique."""
    clusters = sorted(set(int(x) for x in labels))
    if len(clusters) == 1:
        return {clusters[0]: "all heads"}
    # z_stats columns have overall mean 0, so a cluster's column mean is its deviation.
    columns = [STAT_NAMES.index(name) for name in _BEHAVIOUR_NAMES]
    base: dict[int, tuple[str, float]] = {}
    for c in clusters:
        deviation = z_stats[labels == c][:, columns].mean(axis=0)
        best = int(np.argmax(deviation))  # first of equals: _BEHAVIOUR_NAMES order
        if deviation[best] > 0:
            base[c] = (list(_BEHAVIOUR_NAMES.values())[best], float(deviation[best]))
        else:
            base[c] = ("mixed heads", 0.0)
    names: dict[int, str] = {}
    for name in dict.fromkeys(n for n, _ in base.values()):
        # The most distinctive cluster keeps the plain name; the others are numbered.
        same = sorted((c for c in clusters if base[c][0] == name), key=lambda c: -base[c][1])
        for rank, c in enumerate(same, start=1):
            names[c] = name if rank == 1 else f"{name} {rank}"
    return dict(sorted(names.items()))


# ---------------------------------------------------------------------------------------
# Input checks


def _as_layers(patterns: Sequence[Tensor] | Tensor) -> list[Tensor]:
    """One (B, H, S, T) tensor per layer, from a list or a stacked (L, B, H, S, T) tensor."""
    if isinstance(patterns, Tensor):
        if patterns.dim() == 5:
            return list(patterns.unbind(dim=0))
        raise ValueError(
            f"got one tensor of shape {tuple(patterns.shape)}; pass a list with one "
            "(B, H, S, T) tensor per layer (e.g. [pattern] for a single layer), or a "
            "stacked (L, B, H, S, T) tensor."
        )
    layers = list(patterns)
    if not layers:
        raise ValueError("patterns is empty; pass one (B, H, S, T) tensor per layer.")
    for layer, pattern in enumerate(layers):
        if not isinstance(pattern, Tensor):
            raise TypeError(
                f"patterns[{layer}] is a {type(pattern).__name__}; expected a torch.Tensor "
                "of shape (B, H, S, T)."
            )
        _check_4d(pattern, f"patterns[{layer}]")
    return layers


def _check_4d(pattern: Tensor, what: str) -> None:
    if pattern.dim() != 4:
        raise ValueError(
            f"{what} has shape {tuple(pattern.shape)}; expected (B, H, S, T). Add a batch "
            "dimension with .unsqueeze(0) for a single example."
        )
    if not pattern.is_floating_point():
        raise TypeError(f"{what} has dtype {pattern.dtype}; attention weights are floats.")


def _check_square(pattern: Tensor, what: str) -> None:
    _check_4d(pattern, what)
    if pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(
            f"{what} has shape {tuple(pattern.shape)}: S={pattern.shape[-2]} queries but "
            f"T={pattern.shape[-1]} keys. Self-attention over the whole sequence is needed "
            "(S == T); capture without a KV cache."
        )


def _check_head_ids(
    head_ids: Sequence[Sequence[int]] | None, layers: list[Tensor]
) -> list[list[int]]:
    if head_ids is None:
        return [list(range(pattern.shape[1])) for pattern in layers]
    ids = [[int(h) for h in row] for row in head_ids]
    if len(ids) != len(layers):
        raise ValueError(
            f"head_ids has {len(ids)} layers but patterns have {len(layers)}; give one list "
            "of original head indices per layer."
        )
    for layer, (row, pattern) in enumerate(zip(ids, layers, strict=True)):
        if len(row) != pattern.shape[1]:
            raise ValueError(
                f"head_ids[{layer}] names {len(row)} heads but patterns[{layer}] has "
                f"{pattern.shape[1]} (shape {tuple(pattern.shape)})."
            )
        if len(set(row)) != len(row):
            raise ValueError(f"head_ids[{layer}] repeats a head: {row}.")
    return ids
