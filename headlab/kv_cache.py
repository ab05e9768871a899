"""`KVCache`: one attention layer's keys and values of past positions, for decoding.

Shapes as in `headlab.attention`: B batch, H_kv key/value heads, T positions, D head dim.
"""

from __future__ import annotations

import torch


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
