"""Keys and values an attention layer reads: `KeySet` (some query heads, the keys and
values they read, and the mask over them), `KVCache` (one layer's keys and values of
past positions, for decoding) and `Cache` (a model's, one per layer; `HeadModel.new_cache`
puts a `headlab.attention.streaming.StreamingCache` where a layer has demoted heads).

Shapes as in `headlab.attention`: B batch, S queries, H query heads, H_kv key/value
heads, T positions, D head dim; a suffix x marks a subset of heads (H_x) or keys (T_x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from headlab.attention.masks import Mask


@dataclass(frozen=True)
class KeySet:
    """Keys and values that some of a layer's query heads read, with their mask.

    Every head of a layer reads one set; a layer with demoted heads reads two
    (`headlab.attention.streaming`): the full heads their whole past, the streaming heads their
    sinks and window. Attention computes each set through the same maths.
    """

    k: torch.Tensor  # (B, H_kv_x, T_x, D)
    v: torch.Tensor  # (B, H_kv_x, T_x, D)
    mask: Mask  # broadcastable to (B, H_x, S, T_x)
    kv_index: torch.Tensor  # (H_x,) each query head's key/value head in k
    grouped: bool  # kv_index is `equal_groups`: SDPA reads k and v in place
    heads: torch.Tensor | None = None  # (H_x,) the query heads that read it; None: all H
    positions: torch.Tensor | None = None  # (T_x,) the keys' places among T; None: 0..T-1

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H_kv_x, T_x, D) -> (B, H_x, T_x, D): each query head's key/value head."""
        h, h_kv = self.kv_index.numel(), t.shape[1]
        if not self.grouped:
            return t.index_select(1, self.kv_index)
        return t if h == h_kv else t.repeat_interleave(h // h_kv, dim=1)


def equal_groups(kv_index: list[int], n_kv: int) -> bool:
    """Whether query heads read their ``n_kv`` key/value heads in equal contiguous groups,
    [0, 0, 1, 1, ...], which SDPA's ``enable_gqa`` reads in place (MHA included)."""
    h = len(kv_index)
    return n_kv > 0 and h % n_kv == 0 and kv_index == [
        g for g in range(n_kv) for _ in range(h // n_kv)]


class KVCache:
    """Keys and values of past positions for one attention layer.

    Storage is preallocated and doubled when full, so appending a token copies only
    that token: decoding n tokens costs O(n) per step, not a re-projection of the past.
    """

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None  # (B, H_kv, capacity, D)
        self._v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H_kv, S, D) keys/values; return views of all (B, H_kv, T, D)."""
        new = k.shape[2]
        if self._k is None:
            cap = max(16, 2 * new)
            self._k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            self._v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
        elif self.length + new > self._k.shape[2]:
            cap = max(2 * self._k.shape[2], self.length + new)
            self._k = _grow(self._k, cap, self.length)
            self._v = _grow(self._v, cap, self.length)
        end = self.length + new
        self._k[:, :, self.length : end] = k
        self._v[:, :, self.length : end] = v
        self.length = end
        return self._k[:, :, :end], self._v[:, :, :end]


def _grow(buf: torch.Tensor, capacity: int, used: int) -> torch.Tensor:
    out = buf.new_empty(buf.shape[0], buf.shape[1], capacity, buf.shape[3])
    out[:, :, :used] = buf[:, :, :used]
    return out


class Cache:
    """A model's key/value caches for incremental decoding, one per layer."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [KVCache() for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0
