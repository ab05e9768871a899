"""Per-head statistics over a dataset: entropy, confidence and where the attention goes.

How spread a head's attention is (entropy), how sure it is (mean max weight, Voita et
al. 2019), and how much of it goes to fixed places: the first token, [CLS], [SEP],
punctuation, the token itself, the previous and the next token (Clark et al. 2019).
`HeadStatsAccumulator` streams over batches, so a dataset never has to fit in memory;
`head_statistics` is the one-batch shortcut. Shapes use the notation of headlab.analysis.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._checks import _as_layers, _check_4d, _check_head_ids, _check_square
from .roles import TokenRoles

__all__ = [
    "STAT_NAMES",
    "HeadStats",
    "HeadStatsAccumulator",
    "attention_entropy",
    "head_statistics",
    "pattern_features",
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
        """Sum the accumulators over torch.distributed ranks (every rank must call it; a
        rank that saw no batch contributes zeros); nothing happens outside torchrun."""
        import torch.distributed as dist

        from headlab.parallel import distributed

        if not distributed.data_parallel():
            return
        everyone: list = [None] * distributed.world_size()
        dist.all_gather_object(everyone, self._head_ids)
        seen = next((ids for ids in everyone if ids[0] is not None), None)
        if seen is None:
            raise ValueError("all_reduce needs at least one batch on some rank")
        for layer in range(self.n_layers):
            if self._sums[layer] is None:  # this rank had no rows to see
                H = len(seen[layer])
                self._sums[layer] = torch.zeros(H, len(STAT_NAMES), dtype=torch.float64)
                self._counts[layer] = torch.zeros(H, dtype=torch.long)
                self._head_ids[layer] = seen[layer]
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
