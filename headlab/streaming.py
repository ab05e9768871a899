"""Streaming heads: key/value heads demoted to a sink-plus-window cache.

A demoted key/value head (and every query head of its GQA group) attends only to the
first ``sinks`` positions and the last ``window`` positions (its own included), as the
streaming heads of DuoAttention and StreamingLLM do. Its cache holds exactly those:
``sinks`` slots, then a ring buffer of ``window`` slots, so its memory stops growing
once the window is full and a decoding step reads at most ``sinks + window`` keys.
The other heads of the layer keep their full cache (`KVCache`). Prefill uses the same
mask, so a demoted head computes, at every position, the function of a full-cache head
under the equivalent sink + window mask.

Shapes as in `headlab.attention`: B batch, H query heads, H_kv key/value heads, S new
positions, T keys, D head dim; a suffix f / s marks the full / streaming subset
(H_f + H_s = H), P = sinks + window the streaming cache's slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from headlab.hookpoint import run_hook
from headlab.kv_cache import KVCache

if TYPE_CHECKING:
    from headlab.attention import MultiHeadAttention
    from headlab.masks import Mask


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
    # whether a subset's groups are equal and contiguous: SDPA's enable_gqa then reads
    # each key/value head in place instead of a copy per query head
    regular_full: bool = False
    regular_stream: bool = False


def split_of(attn: MultiHeadAttention) -> _Split:
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
                   t(index_stream), _regular(index_full, len(kv_full)),
                   _regular(index_stream, len(kv_stream)))
    attn.__dict__["_streaming_split"] = (attn.kv_head_ids, attn.streaming, split)
    return split


def _regular(index: list[int], n_kv: int) -> bool:
    """Equal contiguous groups: [0, 0, 1, 1, ...] (each key/value head's query heads)."""
    return n_kv > 0 and len(index) % n_kv == 0 and index == [
        g for g in range(n_kv) for _ in range(len(index) // n_kv)]


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

    def held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The streaming keys, values (B, H_kv_s, n, D) and positions (n,) held."""
        if self.k is None:
            return None
        n = self.filled
        return self.k[:, :, :n], self.v[:, :, :n], self.positions[:n]

    def store(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Keep what the budget keeps of (B, H_kv_s, S, D) keys/values at positions
        start .. start + S - 1: the sinks among them and the last ``window``."""
        sinks, window = self.streaming.sinks, self.streaming.window
        if self.k is None:
            B, Hs, _, D = k.shape
            self.k = k.new_zeros(B, Hs, sinks + window, D)
            self.v = v.new_zeros(B, Hs, sinks + window, D)
            self.positions = torch.full((sinks + window,), -1, dtype=torch.long,
                                        device=k.device)
        pos = torch.arange(start, start + k.shape[2], device=k.device)  # (S,)
        keep = (pos < sinks) | (pos >= start + k.shape[2] - window)
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


def attend(
    attn: MultiHeadAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    cache: StreamingCache | None,
    *,
    eager: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of a layer with demoted heads: q (B, H, S, D), new k, v (B, H_kv, S, D).

    Returns z (B, H, S, D) in head order and, when ``eager``, the weights (B, H, S, T)
    over every position T = past + S (a streaming head's weights are 0 outside its
    sinks and window), after the ``scores`` and ``pattern`` hooks.
    """
    if cache is not None and not isinstance(cache, StreamingCache):
        raise TypeError("a layer with demoted heads needs the cache of model.new_cache()")
    sp, split = attn.streaming, split_of(attn)
    B, H, S, D = q.shape
    past = cache.length if cache is not None else 0
    T = past + S
    kf, vf = k[:, split.kv_full], v[:, split.kv_full]  # (B, H_kv_f, S, D)
    ks, vs = k[:, split.kv_stream], v[:, split.kv_stream]  # (B, H_kv_s, S, D)
    if cache is not None and split.kv_full.numel():
        kf, vf = cache.full.append(kf, vf)  # (B, H_kv_f, T, D)
    # the streaming keys: those held (sinks, ring) and the new ones, with their positions
    held = cache.held() if cache is not None else None
    kpos = torch.arange(past, T, device=q.device)  # (S,)
    if held is not None and held[2].numel():
        ks, vs = torch.cat([held[0], ks], dim=2), torch.cat([held[1], vs], dim=2)
        kpos = torch.cat([held[2], kpos])  # (T_s,)
    if cache is not None:
        cache.store(k[:, split.kv_stream], v[:, split.kv_stream], past)
        cache.length = T
        if not split.kv_full.numel():
            cache.full.length = T
    qpos = torch.arange(past, T, device=q.device)[:, None]  # (S, 1)
    allowed_s = (kpos[None] <= qpos) & ((kpos[None] < sp.sinks) | (kpos[None] > qpos - sp.window))
    allowed_s = allowed_s[None, None]  # (1, 1, S, T_s)
    bias_s = None
    if mask.allowed is not None:  # padding, windows and custom masks, at the kept keys
        allowed_s = allowed_s & _heads(mask.allowed, split.q_stream)[..., kpos]
    if mask.bias is not None:
        bias_s = _heads(mask.bias, split.q_stream)[..., kpos]
    full = (q[:, split.q_full], kf, vf, split.index_full, _heads(mask.allowed, split.q_full),
            _heads(mask.bias, split.q_full), mask.causal_only, split.regular_full)
    stream = (q[:, split.q_stream], ks, vs, split.index_stream, allowed_s, bias_s, False,
              split.regular_stream)
    if eager:
        return _eager(attn, full, stream, split, kpos, T)
    z = q.new_empty(B, H, S, D)
    for (qx, kx, vx, index, allowed, bias, causal, regular), heads in (
            (full, split.q_full), (stream, split.q_stream)):
        if heads.numel():
            z[:, heads] = _fast(attn, qx, kx, vx, index, allowed, bias, causal, regular)
    return z, None


def _heads(t: torch.Tensor | None, heads: torch.Tensor) -> torch.Tensor | None:
    """A mask's (B|1, H|1, S, T) tensor for a subset of the query heads."""
    return t if t is None or t.shape[1] == 1 else t[:, heads]


def _expand(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, H_kv_x, T, D) -> (B, H_x, T, D): each query head's key/value head."""
    return t.index_select(1, index)


def _fast(attn, q, k, v, index, allowed, bias, causal, regular) -> torch.Tensor:
    """SDPA over one subset; rows with no key give zeros. Returns z (B, H_x, S, D)."""
    if not regular:
        k, v = _expand(k, index), _expand(v, index)
    ok = None
    if allowed is not None:
        ok = allowed.any(-1, keepdim=True)  # (B|1, 1, S, 1)
        allowed = allowed | ~ok
    if bias is not None:
        bias = bias.to(q.dtype)
        allowed = bias if allowed is None else bias.masked_fill(~allowed, -math.inf)
    dropout = attn.dropout if attn.training else 0.0
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                       is_causal=causal, scale=attn.scale,
                                       enable_gqa=regular and k.shape[1] != q.shape[1])
    return z if ok is None else z * ok.to(z.dtype)


def _eager(attn, full, stream, split: _Split, kpos: torch.Tensor, T: int):
    """Scores of both subsets on every position (B, H, S, T), a streaming head's at the
    keys it keeps and -inf elsewhere, through the hooks; then z from the kept keys."""
    q = full[0] if full[0].shape[1] else stream[0]
    B, S = q.shape[0], q.shape[2]
    H = split.q_full.numel() + split.q_stream.numel()
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.full((B, H, S, T), -math.inf, dtype=acc, device=q.device)
    for (qx, kx, _, index, allowed, bias, causal, _), heads in ((full, split.q_full),
                                                              (stream, split.q_stream)):
        if not heads.numel():
            continue
        s = torch.matmul(qx.to(acc), _expand(kx, index).to(acc).transpose(-1, -2)) * attn.scale
        if bias is not None:
            s = s + bias.to(acc)
        if causal:
            allowed = torch.ones(S, s.shape[-1], dtype=torch.bool, device=q.device).tril(
                s.shape[-1] - S)
        if allowed is not None:
            s = s.masked_fill(~allowed, -math.inf)
        if heads is split.q_stream:
            scores[:, heads] = scores[:, heads].index_copy(-1, kpos, s)
        else:
            scores[:, heads] = s
    scores = run_hook(attn.scores, scores)
    ok = scores.isfinite().any(-1, keepdim=True)  # (B, H, S, 1): rows with a key
    weights = torch.softmax(scores.masked_fill(~ok, 0.0), dim=-1) * ok
    weights = run_hook(attn.pattern, weights)
    z = q.new_empty(B, H, S, q.shape[-1])
    if split.q_full.numel():
        w = weights[:, split.q_full]
        z[:, split.q_full] = torch.matmul(w.to(full[2].dtype), _expand(full[2], full[3]))
    if split.q_stream.numel():
        w = weights[:, split.q_stream][..., kpos]  # (B, H_s, S, T_s)
        z[:, split.q_stream] = torch.matmul(w.to(stream[2].dtype),
                                            _expand(stream[2], stream[3]))
    return z, weights


def n_streaming(attn: MultiHeadAttention) -> int:
    """How many of the layer's key/value heads are demoted."""
    return 0 if attn.streaming is None else split_of(attn).kv_stream.numel()


def cache_bytes(attn: MultiHeadAttention, length: int, *, dtype_size: int) -> int:
    """Bytes of one layer's key/value cache holding ``length`` positions (batch 1):
    full heads keep every position, demoted ones at most sinks + window."""
    per_head = 2 * attn.head_dim * dtype_size
    n_stream = n_streaming(attn)
    slots = 0 if attn.streaming is None else min(length, attn.streaming.slots)
    return per_head * ((attn.n_kv_heads - n_stream) * length + n_stream * slots)
