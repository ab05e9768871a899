"""Streaming heads: key/value heads demoted to a sink-plus-window cache.

A demoted key/value head (and every query head of its GQA group) attends only to the
first ``sinks`` positions and the last ``window`` positions (its own included), as the
streaming heads of DuoAttention and StreamingLLM do. Its cache holds exactly those:
``sinks`` slots, then a ring buffer of ``window`` slots, so its memory stops growing
once the window is full and a decoding step reads at most ``sinks + window`` keys.
The other heads of the layer keep their full cache (`KVCache`).

Only the keys differ: `key_sets` gives the layer's full and streaming heads each the
keys they read and the mask over them, and `headlab.attention` computes both sets
through its one maths. A demoted head thus computes, at every position, the function
of a full-cache head under the equivalent sink + window mask.

Shapes as in `headlab.attention`: B batch, H query heads, H_kv key/value heads, S new
positions, T keys, D head dim; a suffix f / s marks the full / streaming subset
(H_f + H_s = H), P = sinks + window the streaming cache's slots, T_s the keys a
streaming head reads in one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from headlab.attention.kv_cache import KeySet, KVCache, equal_groups
from headlab.attention.masks import Mask


class HeadLayout(Protocol):
    """What this module reads of an attention layer (`MultiHeadAttention` is one): its
    heads' original ids and groups, and its demoted heads. A protocol, so that the
    attention module, which calls `key_sets`, is not imported back here."""

    head_dim: int
    kv_head_ids: torch.Tensor  # (H_kv,) original ids of the key/value heads present
    kv_index: torch.Tensor  # (H,) each query head's key/value head position
    streaming: Streaming | None

    @property
    def n_kv_heads(self) -> int: ...


@dataclass(frozen=True)
class Streaming:
    """The demoted key/value heads of one layer (original indices) and their budget."""

    kv_heads: tuple[int, ...]
    sinks: int = 4
    window: int = 256

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 1:
            raise ValueError(f"sinks must be >= 0 and window >= 1, got {self.sinks} and "
                             f"{self.window}")

    @property
    def slots(self) -> int:
        """Positions a demoted key/value head keeps: P = sinks + window."""
        return self.sinks + self.window

    def to_json(self) -> dict:
        return {"kv_heads": list(self.kv_heads), "sinks": self.sinks, "window": self.window}

    @classmethod
    def from_json(cls, d: dict) -> Streaming:
        return cls(tuple(int(h) for h in d["kv_heads"]), int(d["sinks"]), int(d["window"]))


@dataclass(frozen=True)
class _Split:
    """Positions of a layer's heads in the full and the streaming subsets."""

    q_full: torch.Tensor  # (H_f,) query-head positions
    q_stream: torch.Tensor  # (H_s,)
    kv_full: torch.Tensor  # (H_kv_f,) key/value-head positions
    kv_stream: torch.Tensor  # (H_kv_s,)
    index_full: torch.Tensor  # (H_f,) each full query head's key/value head in kv_full
    index_stream: torch.Tensor  # (H_s,)
    grouped_full: bool  # a subset's groups are equal and contiguous (`kv_cache.equal_groups`)
    grouped_stream: bool


def split_of(attn: HeadLayout) -> _Split:
    """The layer's heads split by `Streaming.kv_heads`, memoised on its current layout
    (pruning replaces ``kv_head_ids``, so a stale split is never used)."""
    memo = attn.__dict__.get("_streaming_split")
    if memo is not None and memo[0] is attn.kv_head_ids and memo[1] is attn.streaming:
        return memo[2]
    demoted = set(attn.streaming.kv_heads)
    kv_ids = attn.kv_head_ids.tolist()
    kv_stream = [p for p, h in enumerate(kv_ids) if h in demoted]
    kv_full = [p for p, h in enumerate(kv_ids) if h not in demoted]
    kv_index = attn.kv_index.tolist()
    q_stream = [p for p, kv in enumerate(kv_index) if kv in set(kv_stream)]
    q_full = [p for p, kv in enumerate(kv_index) if kv not in set(kv_stream)]
    dev = attn.kv_index.device

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=dev)

    index_full = [kv_full.index(kv_index[p]) for p in q_full]
    index_stream = [kv_stream.index(kv_index[p]) for p in q_stream]
    split = _Split(t(q_full), t(q_stream), t(kv_full), t(kv_stream), t(index_full),
                   t(index_stream), equal_groups(index_full, len(kv_full)),
                   equal_groups(index_stream, len(kv_stream)))
    attn.__dict__["_streaming_split"] = (attn.kv_head_ids, attn.streaming, split)
    return split


class StreamingCache:
    """One layer's cache with demoted heads: a `KVCache` for the full heads and, for the
    streaming heads, ``sinks`` slots then a ring of ``window`` slots, (B, H_kv_s, P, D).

    ``positions`` (P,) holds the position stored in each slot (-1: empty). Position p
    goes to slot p when p < sinks, else to slot sinks + (p - sinks) % window.
    """

    def __init__(self, streaming: Streaming) -> None:
        self.streaming = streaming
        self.full = KVCache()
        self.k: torch.Tensor | None = None  # (B, H_kv_s, P, D)
        self.v: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # (P,)
        self.length = 0

    @property
    def filled(self) -> int:
        """Slots in use: min(length, P); slots fill in order until the ring wraps."""
        return min(self.length, self.streaming.slots)

    def extend(self, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store the streaming heads' new keys/values (B, H_kv_s, S, D) and return what
        their queries read: keys, values (B, H_kv_s, T_s, D) and the keys' positions
        (T_s,), None when they are the new ones alone (positions 0 .. S-1)."""
        past, S = self.length, k.shape[2]
        if past and S > 1:  # the held slots then the chunk, read before it overwrites them
            n = self.filled
            held = (torch.cat([self.k[:, :, :n], k], dim=2),
                    torch.cat([self.v[:, :, :n], v], dim=2),
                    torch.cat([self.positions[:n],
                               torch.arange(past, past + S, device=k.device)]))
        self._store(k, v, past)
        self.length = past + S
        if past == 0:  # nothing was held: the new keys
            return k, v, None
        if S == 1:  # the new key has replaced the one leaving the window: the slots are
            n = self.filled  # exactly what the new query reads (views, no copy)
            return self.k[:, :, :n], self.v[:, :, :n], self.positions[:n]
        return held

    def _store(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Keep what the budget keeps of (B, H_kv_s, S, D) keys/values at positions
        start .. start + S - 1: the sinks among them and the last ``window``."""
        sinks, window = self.streaming.sinks, self.streaming.window
        if self.k is None:
            B, Hs, _, D = k.shape
            self.k = k.new_zeros(B, Hs, sinks + window, D)
            self.v = v.new_zeros(B, Hs, sinks + window, D)
            self.positions = torch.full((sinks + window,), -1, dtype=torch.long,
                                        device=k.device)
        S = k.shape[2]
        if S == 1:  # a decoding step: its slot, with no index tensors (no device sync)
            slot = start if start < sinks else sinks + (start - sinks) % window
            self.k[:, :, slot] = k[:, :, 0]
            self.v[:, :, slot] = v[:, :, 0]
            self.positions[slot] = start
            return
        pos = torch.arange(start, start + S, device=k.device)  # (S,)
        keep = (pos < sinks) | (pos >= start + S - window)
        pos, k, v = pos[keep], k[:, :, keep], v[:, :, keep]
        slot = torch.where(pos < sinks, pos, sinks + (pos - sinks) % window)
        self.k[:, :, slot] = k
        self.v[:, :, slot] = v
        self.positions[slot] = pos

    def nbytes(self) -> int:
        """Bytes of the key/value entries held, full and streaming heads."""
        total = 0
        if self.full._k is not None:
            k = self.full._k
            total += 2 * k.shape[0] * k.shape[1] * self.full.length * k.shape[3] * k.element_size()
        if self.k is not None:
            total += 2 * self.k[:, :, : self.filled].numel() * self.k.element_size()
        return total


def key_sets(attn: HeadLayout, k: torch.Tensor, v: torch.Tensor, mask: Mask,
             cache: StreamingCache | None) -> list[KeySet]:
    """What the heads of a layer with demoted heads read, given its new keys and values
    k, v (B, H_kv, S, D) and the model's ``mask``: the full heads their whole past, the
    streaming heads their sinks and window, each with its mask. Appends k, v to
    ``cache``, if any."""
    if cache is not None and not isinstance(cache, StreamingCache):
        raise TypeError("a layer with demoted heads needs the cache of model.new_cache()")
    split = split_of(attn)
    past, S = (cache.length if cache is not None else 0), k.shape[2]
    sets = []
    if split.q_full.numel():
        kf, vf = k[:, split.kv_full], v[:, split.kv_full]  # (B, H_kv_f, S, D)
        if cache is not None:
            kf, vf = cache.full.append(kf, vf)  # (B, H_kv_f, T, D)
        sets.append(KeySet(kf, vf, mask.heads(split.q_full), split.index_full,
                           split.grouped_full, split.q_full))
    ks, vs = k[:, split.kv_stream], v[:, split.kv_stream]  # (B, H_kv_s, S, D)
    positions = None
    if cache is not None:
        ks, vs, positions = cache.extend(ks, vs)  # (B, H_kv_s, T_s, D), (T_s,) or None
    if split.q_stream.numel():
        smask = _streaming_mask(mask, attn.streaming, positions, past, S, k.device)
        sets.append(KeySet(ks, vs, smask.heads(split.q_stream), split.index_stream,
                           split.grouped_stream, split.q_stream, positions))
    return sets


def _streaming_mask(mask: Mask, streaming: Streaming, positions: torch.Tensor | None,
                    past: int, S: int, device: torch.device) -> Mask:
    """``mask`` for streaming heads at the keys they read (``positions``, None: all T):
    causal, within the sinks and the window, and within ``mask`` there. Built once per
    forward: the layers sharing ``mask`` read keys at the same positions."""
    key = ("streaming", streaming.sinks, streaming.window, past, S)
    if key in mask.memo:
        return mask.memo[key]

    def at(t: torch.Tensor | None) -> torch.Tensor | None:  # (..., T) -> (..., T_s)
        return t if t is None or positions is None else t[..., positions]

    allowed, bias = at(mask.allowed), at(mask.bias)
    if mask.row_ok is not None:  # close again the rows that had no key
        allowed = mask.row_ok if allowed is None else allowed & mask.row_ok
    if S > 1:  # (one new query reads exactly its sinks and window)
        kpos = torch.arange(past + S, device=device) if positions is None else positions
        qpos = torch.arange(past, past + S, device=device)[:, None]  # (S, 1)
        budget = (kpos <= qpos) & ((kpos < streaming.sinks) | (kpos > qpos - streaming.window))
        allowed = budget[None, None] if allowed is None else allowed & budget  # (.., S, T_s)
    out = Mask.of(allowed=allowed, bias=bias)
    mask.memo[key] = out
    return out


def n_streaming(attn: HeadLayout) -> int:
    """How many of the layer's key/value heads are demoted."""
    return 0 if attn.streaming is None else split_of(attn).kv_stream.numel()


def cache_bytes(attn: HeadLayout, length: int, *, dtype_size: int) -> int:
    """Bytes of one layer's key/value cache holding ``length`` positions (batch 1):
    full heads keep every position, demoted ones at most sinks + window."""
    per_head = 2 * attn.head_dim * dtype_size
    n_stream = n_streaming(attn)
    slots = 0 if attn.streaming is None else min(length, attn.streaming.slots)
    return per_head * ((attn.n_kv_heads - n_stream) * length + n_stream * slots)
