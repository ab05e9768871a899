"""MultiHeadAttention: the one attention module every headlab model is built on (the
shape notation and the MHA / GQA / MQA layouts are in the package docstring,
`headlab.attention`).

Which keys a head reads: every head of a layer reads the same keys, except in a layer
with demoted heads (`headlab.attention.streaming`), whose streaming heads read only their
sinks and window. Each set of heads and the keys it reads is a `KeySet`; `_fast` and
`_eager` compute every set through the same maths (one scale, soft-capping, mask, softmax
and hooks), so demoted heads differ from full ones in their keys and mask only.

Numeric conventions, fixed here and nowhere else:
    * the scale is computed once in ``__init__`` (1/sqrt(D) unless overridden);
    * scores and softmax are computed in float32 at least (float64 stays float64);
    * boolean masks use True = may attend; a query row whose keys are all masked
      gives a zero output (and zero weights), never NaN, forward and backward;
    * a per-head gate (Michel et al.'s xi_h) multiplies each head's output before W_O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from headlab.attention.heads import group_index, head_rows, linear, slice_linear, slice_norm
from headlab.attention.hookpoint import HookPoint, run_hook
from headlab.attention.kv_cache import KeySet, KVCache, equal_groups
from headlab.attention.masks import Mask
from headlab.attention.rotary import apply_rotary
from headlab.attention.streaming import Streaming, key_sets

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention with MHA/GQA/MQA, masks, KV cache, head gates and pruning.

    Args (keyword-only):
        d_model: model dimension E.
        n_heads: query heads H.
        n_kv_heads: key/value heads H_kv (default H); H must be a multiple of it.
        head_dim: D (default E / H); independent of E / H when given.
        bias: bias on the Q, K, V projections.
        out_bias: bias on W_O (default: same as ``bias``).
        scale: factor on Q K^T (default 1/sqrt(D)).
        dropout: dropout on the attention weights, in training mode only.
        kv_index: the key/value head of each query head, for layouts left uneven by
            pruning (then n_heads need not be a multiple of n_kv_heads; 0 heads is
            allowed and the layer outputs W_O's bias).
        q_norm, k_norm: norms applied to Q and K before rotary (QK-norm), or None.
        qk_norm_scope: ``"head"``: the norms act on each head's D features (Qwen3,
            Gemma-3; pruning leaves them as they are); ``"projection"``: on all H*D (or
            H_kv*D) features at once (OLMo-2; pruning keeps the kept heads' weights, so
            the statistics then run over the kept heads only).
        softcap: attention logit soft-capping, scores -> softcap * tanh(scores /
            softcap) before the mask (Gemma-2); forces the eager path.

    ``forward`` returns the (B, S, E) output, or ``(output, weights)`` with the per-head
    weights (B, H, S, T) when ``need_weights=True``.
    """

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        scale: float | None = None,
        dropout: float = 0.0,
        kv_index: Iterable[int] | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        qk_norm_scope: str = "head",
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        kv_index = group_index(n_heads, n_kv_heads, kv_index)
        if head_dim is None:
            if n_heads < 1 or d_model % n_heads:
                raise ValueError(
                    f"d_model ({d_model}) is not divisible by n_heads ({n_heads}); "
                    "pass head_dim explicitly"
                )
            head_dim = d_model // n_heads
        out_bias = bias if out_bias is None else out_bias

        self.d_model = d_model
        self.head_dim = head_dim
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = dropout
        self.q_proj = linear(d_model, n_heads * head_dim, bias=bias)
        self.k_proj = linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.v_proj = linear(d_model, n_kv_heads * head_dim, bias=bias)
        self.o_proj = linear(n_heads * head_dim, d_model, bias=out_bias)
        if qk_norm_scope not in ("head", "projection"):
            raise ValueError(f"qk_norm_scope must be 'head' or 'projection', got {qk_norm_scope!r}")
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.qk_norm_scope = qk_norm_scope
        self.softcap = softcap

        # original indices of the heads still present, and each query head's kv head
        self.register_buffer("head_ids", torch.arange(n_heads), persistent=True)
        self.register_buffer("kv_head_ids", torch.arange(n_kv_heads), persistent=True)
        self.register_buffer("kv_index", kv_index, persistent=True)
        self.register_buffer("head_gate", torch.ones(n_heads), persistent=True)
        # heads before any pruning; models rebuilt from a pruned checkpoint set it
        self.n_original_heads = n_heads
        # A tensor set here ((H,), (B, H) or (B, S, H)) replaces head_gate for the next
        # forwards; importance scoring sets one that requires grad.
        self.gate_override: torch.Tensor | None = None
        # (gate tensor, its version, all ones?): holding the tensor itself, not its id,
        # so a new gate tensor can never be mistaken for a freed one at the same address
        self._gate_state: tuple[torch.Tensor | None, int, bool] = (None, -1, True)
        # demoted key/value heads with a sink + window cache (headlab.attention.streaming), or None
        self.streaming: Streaming | None = None
        self.refresh_layout()

        # Hook points, in the order the forward reaches them.
        self.q = HookPoint()  # (B, S, H, D) after rotary
        self.k = HookPoint()  # (B, S, H_kv, D) new positions, after rotary
        self.v = HookPoint()  # (B, S, H_kv, D) new positions
        self.scores = HookPoint()  # (B, H, S, T) scaled, masked (-inf), float32 or float64
        self.pattern = HookPoint()  # (B, H, S, T) softmax weights, float32 or float64
        self.z = HookPoint()  # (B, S, H, D) per-head outputs after the gate, before W_O
        self.out = HookPoint()  # (B, S, E)

    # ------------------------------------------------------------------ structure
    @property
    def n_heads(self) -> int:
        return self.head_ids.numel()

    @property
    def n_kv_heads(self) -> int:
        return self.kv_head_ids.numel()

    def refresh_layout(self) -> None:
        """Recompute whether K/V heads form equal contiguous groups (SDPA's enable_gqa); call
        it after ``kv_index`` changes other than by `prune_heads` (a state dict loaded)."""
        self._kv_regular = equal_groups(self.kv_index.tolist(), self.n_kv_heads)

    def _gate(self) -> torch.Tensor | None:
        """The gate to apply, or None when every gate is exactly 1 (nothing to do)."""
        if self.gate_override is not None:
            return self.gate_override
        g = self.head_gate
        seen, version, all_ones = self._gate_state
        if seen is not g or version != g._version:
            all_ones = bool(torch.all(g == 1))
            self._gate_state = (g, g._version, all_ones)
        return None if all_ones else g

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: Mask | None = None,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        window: int | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Self-attention over x (B, S, E).

        Pass either a prebuilt ``mask`` (models build it once per forward) or the
        ``causal`` / ``key_padding_mask`` (B, T; True = real token) / ``attn_mask`` /
        ``window`` arguments. ``rotary`` is (cos, sin), each (B|1, S, D), applied to Q
        and K. With ``cache``, keys/values of x are appended to it and attention runs
        over all cached positions.
        """
        B, S, _ = x.shape
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        past = cache.length if cache is not None else 0
        if mask is None:
            mask = Mask.build(
                batch=B, q_len=S, k_len=past + S, device=x.device, causal=causal,
                key_padding_mask=key_padding_mask, attn_mask=attn_mask, window=window,
            )
        if H == 0:
            return self._empty_output(x, past + S, need_weights)

        q = self._project(self.q_proj, self.q_norm, x, H).transpose(1, 2)  # (B, H, S, D)
        k = self._project(self.k_proj, self.k_norm, x, H_kv).transpose(1, 2)  # (B, H_kv, S, D)
        v = self.v_proj(x).view(B, S, H_kv, D).transpose(1, 2)  # (B, H_kv, S, D)
        if rotary is not None:
            q = apply_rotary(q, *rotary)
            k = apply_rotary(k, *rotary)
        if self.q._forward_hooks:
            q = self.q(q.transpose(1, 2)).transpose(1, 2)
        if self.k._forward_hooks:
            k = self.k(k.transpose(1, 2)).transpose(1, 2)
        if self.v._forward_hooks:
            v = self.v(v.transpose(1, 2)).transpose(1, 2)
        if self.streaming is not None:  # demoted heads read their sinks and window only
            sets = key_sets(self, k, v, mask, cache)
        else:
            if cache is not None:
                k, v = cache.append(k, v)  # (B, H_kv, T, D)
            sets = [KeySet(k, v, mask, self.kv_index, self._kv_regular)]

        if (need_weights or self.scores._forward_hooks or self.pattern._forward_hooks
                or self.softcap is not None):
            z, weights = self._eager(q, sets, past + S)
        else:
            z, weights = self._fast(q, sets), None

        gate = self._gate()
        if gate is not None:
            g = gate.to(z.dtype)
            if g.dim() == 1:  # (H,)
                g = g[None, :, None, None]
            elif g.dim() == 2:  # (B, H): one gate per example
                g = g[:, :, None, None]
            else:  # (B, S, H): one gate per example and position
                g = g.transpose(1, 2)[..., None]
            z = z * g

        z = z.transpose(1, 2)  # (B, S, H, D)
        if self.z._forward_hooks:
            z = self.z(z)
        out = self.o_proj(z.reshape(B, S, H * D))  # (B, S, E)
        out = run_hook(self.out, out)
        return (out, weights) if need_weights else out

    def _project(self, proj: nn.Linear, norm: nn.Module | None, x: torch.Tensor,
                 heads: int) -> torch.Tensor:
        """x (B, S, E) -> (B, S, heads, D) through ``proj`` and the QK-norm, if any."""
        B, S, _ = x.shape
        y = proj(x)  # (B, S, heads * D)
        if norm is not None and self.qk_norm_scope == "projection":
            y = norm(y)
        y = y.view(B, S, heads, self.head_dim)
        if norm is not None and self.qk_norm_scope == "head":
            y = norm(y)
        return y

    def _fast(self, q: torch.Tensor, sets: list[KeySet]) -> torch.Tensor:
        """SDPA over each key set: no weights materialised. Returns z (B, H, S, D)."""
        if len(sets) == 1 and sets[0].heads is None:
            return self._sdpa(q, sets[0])
        z = q.new_empty(q.shape)  # (B, H, S, D)
        for keys in sets:
            z[:, keys.heads] = self._sdpa(q[:, keys.heads], keys)
        return z

    def _sdpa(self, q: torch.Tensor, keys: KeySet) -> torch.Tensor:
        """q (B, H_x, S, D) over one key set; rows with no key give zeros. Returns z
        (B, H_x, S, D)."""
        k, v, mask = keys.k, keys.v, keys.mask
        if not keys.grouped:
            k, v = keys.expand(k), keys.expand(v)  # (B, H_x, T_x, D)
        attn: torch.Tensor | None = mask.allowed
        if mask.bias is not None:
            attn = mask.bias if attn is None else mask.bias.masked_fill(~attn, float("-inf"))
            attn = attn.to(q.dtype)
        dropout = self.dropout if self.training else 0.0
        z = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn, dropout_p=dropout, is_causal=mask.causal_only,
            scale=self.scale, enable_gqa=k.shape[1] != q.shape[1],
        )
        return z if mask.row_ok is None else z * mask.row_ok.to(z.dtype)

    def _eager(self, q: torch.Tensor, sets: list[KeySet], T: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Materialise per-head weights over all T keys, one softmax for every head, the
        ``scores`` and ``pattern`` hooks seeing them all. Returns z (B, H, S, D) and
        weights (B, H, S, T), 0 at the keys a head does not read."""
        B, H, S, _ = q.shape
        whole = len(sets) == 1 and sets[0].heads is None and sets[0].positions is None
        if whole:  # every head reads every key
            scores, row_ok = self._scores(q, sets[0]), sets[0].mask.row_ok  # (B, H, S, T)
        else:  # each set's scores at its heads and its keys' positions, -inf elsewhere
            acc = torch.promote_types(q.dtype, torch.float32)
            scores = q.new_full((B, H, S, T), float("-inf"), dtype=acc)
            row_ok = None
            for keys in sets:
                part = self._scores(q[:, keys.heads], keys)  # (B, H_x, S, T_x)
                if keys.positions is not None:
                    part = scores.new_full((B, part.shape[1], S, T), float("-inf")).index_copy_(
                        -1, keys.positions, part)  # (B, H_x, S, T)
                scores.index_copy_(1, keys.heads, part)
                if keys.mask.row_ok is not None:
                    if row_ok is None:
                        row_ok = torch.ones(B, H, S, 1, dtype=torch.bool, device=q.device)
                    row_ok[:, keys.heads] = keys.mask.row_ok
        scores = run_hook(self.scores, scores)
        weights = torch.softmax(scores, dim=-1)  # float32 (float64 for float64 inputs)
        if row_ok is not None:
            weights = weights * row_ok  # rows with no key give zeros
        weights = run_hook(self.pattern, weights)
        if self.training and self.dropout:
            weights = F.dropout(weights, p=self.dropout)
        if whole:
            v = sets[0].expand(sets[0].v)  # (B, H, T, D)
            z = torch.matmul(weights.to(v.dtype), v)  # (B, H, S, D)
        else:
            z = q.new_empty(q.shape)  # (B, H, S, D)
            for keys in sets:
                w = weights[:, keys.heads]  # (B, H_x, S, T)
                if keys.positions is not None:
                    w = w[..., keys.positions]  # (B, H_x, S, T_x)
                z[:, keys.heads] = torch.matmul(w.to(keys.v.dtype), keys.expand(keys.v))
        return (z, weights) if row_ok is None else (z * row_ok.to(z.dtype), weights)

    def _scores(self, q: torch.Tensor, keys: KeySet) -> torch.Tensor:
        """Scaled, soft-capped, biased and masked scores of q (B, H_x, S, D) at one key
        set: (B, H_x, S, T_x), float32 for half inputs (float64 stays float64)."""
        k, mask = keys.expand(keys.k), keys.mask  # (B, H_x, T_x, D)
        S, T = q.shape[2], k.shape[2]
        acc = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask.bias is not None:
            scores = scores + mask.bias.to(acc)
        allowed = mask.allowed
        if mask.causal_only:
            allowed = torch.ones(S, T, dtype=torch.bool, device=q.device).tril(T - S)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return scores

    def _empty_output(self, x: torch.Tensor, k_len: int, need_weights: bool):
        """A layer with every head pruned outputs W_O's bias (or zeros) at each position."""
        B, S, E = x.shape
        out = x.new_zeros(B, S, E)
        if self.o_proj.bias is not None:
            out = out + self.o_proj.bias
        out = run_hook(self.out, out)
        if need_weights:
            acc = torch.promote_types(x.dtype, torch.float32)
            return out, x.new_zeros(B, 0, S, k_len, dtype=acc)
        return out

    # ------------------------------------------------------------------ gates
    def set_gates(self, values: torch.Tensor | Iterable[float]) -> None:
        """Set the per-head gates (H,) in place, e.g. 0 to switch heads off."""
        values = torch.as_tensor(values, dtype=self.head_gate.dtype, device=self.head_gate.device)
        if values.shape != self.head_gate.shape:
            raise ValueError(f"gates must have shape ({self.n_heads},), got {tuple(values.shape)}")
        self.head_gate.copy_(values)

    # ------------------------------------------------------------------ output bias
    def ensure_out_bias(self) -> nn.Parameter:
        """Give W_O a bias if it has none, zero-initialised (the output is unchanged),
        and return it: recovery folds the removed heads' mean contribution into it.
        A saved model records which layers have one (`HeadModel.save`)."""
        if self.o_proj.bias is None:
            w = self.o_proj.weight
            self.o_proj.bias = nn.Parameter(
                torch.zeros(w.shape[0], dtype=w.dtype, device=w.device),
                requires_grad=w.requires_grad,
            )
        return self.o_proj.bias

    # ------------------------------------------------------------------ pruning
    def prune_heads(self, heads: Iterable[int]) -> None:
        """Physically remove query heads, given by their ORIGINAL indices.

        Removes their rows of W_Q (and bias) and columns of W_O; a key/value head goes
        only when every query head of its group is gone. Indices already pruned are
        ignored, so a plan can be applied step by step. Afterwards the module equals
        the unpruned module with those heads' gates at 0.
        """
        drop = {int(h) for h in heads}
        bad = sorted(h for h in drop if not 0 <= h < self.n_original_heads)
        if bad:
            raise ValueError(
                f"head indices {bad} out of range: this layer had "
                f"{self.n_original_heads} heads (original indices 0..{self.n_original_heads - 1})"
            )
        ids = self.head_ids.tolist()
        keep = [p for p, h in enumerate(ids) if h not in drop]
        if len(keep) == len(ids):
            return
        D = self.head_dim
        rows = head_rows(keep, D, self.head_ids.device)
        kv_keep = sorted({int(self.kv_index[p]) for p in keep})
        kv_rows = head_rows(kv_keep, D, self.head_ids.device)

        self.q_proj = slice_linear(self.q_proj, rows, dim=0)
        self.k_proj = slice_linear(self.k_proj, kv_rows, dim=0)
        self.v_proj = slice_linear(self.v_proj, kv_rows, dim=0)
        self.o_proj = slice_linear(self.o_proj, rows, dim=1)
        if self.qk_norm_scope == "projection":
            slice_norm(self.q_norm, rows)
            slice_norm(self.k_norm, kv_rows)

        remap = {old: new for new, old in enumerate(kv_keep)}
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.head_ids.device)
        self.kv_index = torch.tensor(
            [remap[int(self.kv_index[p])] for p in keep], dtype=torch.long,
            device=self.kv_index.device,
        )
        self.head_ids = self.head_ids[keep_t]
        self.kv_head_ids = self.kv_head_ids[
            torch.tensor(kv_keep, dtype=torch.long, device=self.kv_head_ids.device)
        ]
        self.head_gate = self.head_gate[keep_t]
        self._gate_state = (None, -1, True)
        self.refresh_layout()

    # ------------------------------------------------------------------ interop
    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """Build an equal module from ``torch.nn.MultiheadAttention`` (self-attention).

        Note the mask conventions differ: torch's ``key_padding_mask`` and boolean
        ``attn_mask`` use True = masked out; headlab's use True = may attend.
        """
        if not m._qkv_same_embed_dim:
            raise ValueError("from_torch supports kdim == vdim == embed_dim only")
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("from_torch does not support add_bias_kv or add_zero_attn")
        E, H = m.embed_dim, m.num_heads
        has_bias = m.in_proj_bias is not None
        w = m.in_proj_weight
        out = cls(d_model=E, n_heads=H, bias=has_bias, out_bias=m.out_proj.bias is not None,
                  dropout=m.dropout)
        out = out.to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            for proj, chunk in zip((out.q_proj, out.k_proj, out.v_proj), w.chunk(3), strict=True):
                proj.weight.copy_(chunk)
            if has_bias:
                for proj, chunk in zip(
                    (out.q_proj, out.k_proj, out.v_proj), m.in_proj_bias.chunk(3), strict=True
                ):
                    proj.bias.copy_(chunk)
            out.o_proj.weight.copy_(m.out_proj.weight)
            if m.out_proj.bias is not None:
                out.o_proj.bias.copy_(m.out_proj.bias)
        return out

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}"
        )
