"""`Mask`: which keys each query may attend to, built once per forward and shared by
every layer of a model (causal, sliding-window, key-padding and custom masks).

Shapes as in `headlab.attention`: B batch, H heads, S queries, T keys. Boolean masks use
True = may attend; a query row with no key left is flagged in ``row_ok`` so attention
can open it for the softmax and zero its output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Mask:
    """Which keys each query may attend to, built once per forward and shared by layers.

    ``allowed`` is a boolean tensor broadcastable to (B, H, S, T) with True = may attend,
    or None when every key is allowed (beyond causality). ``bias`` is an additive float
    mask of the same broadcast shape, or None. ``causal_only`` marks the plain square
    causal case, which the fast path hands to SDPA as ``is_causal`` without a tensor.
    ``row_ok`` (broadcastable to (B, H, S, 1)) is set only when some query row has no
    key left; those rows are opened for the softmax and zeroed afterwards.
    ``memo`` keeps masks derived from this one (the streaming heads',
    `headlab.attention.streaming`), so the layers that share this mask build them once per forward.
    """

    allowed: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    causal_only: bool = False
    row_ok: torch.Tensor | None = None
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(
        *,
        batch: int,
        q_len: int,
        k_len: int,
        device: torch.device | str = "cpu",
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        window: int | None = None,
    ) -> Mask:
        """Combine causal, sliding-window, key-padding and custom masks into one Mask.

        Args:
            causal: query i (at absolute position k_len - q_len + i) sees keys <= itself.
            key_padding_mask: (B, T) with True (or 1) = real token that may be attended.
            attn_mask: boolean (True = may attend) or additive float, broadcastable to
                (B, H, S, T): shape (S, T), (B|1, S, T) or (B|1, H|1, S, T).
            window: with causal, each query sees only its last ``window`` keys
                (itself included), as in Mistral's sliding-window attention.
        """
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if window is not None and not causal:
            raise ValueError("a sliding window needs causal=True")
        if causal and q_len > k_len:
            raise ValueError(f"causal attention needs q_len <= k_len, got {q_len} > {k_len}")

        allowed: torch.Tensor | None = None
        bias: torch.Tensor | None = None
        past = k_len - q_len
        # The plain square causal case needs no tensor: SDPA's is_causal covers it.
        causal_only = (
            causal and q_len > 1 and past == 0 and window is None
            and key_padding_mask is None and attn_mask is None
        )
        # A single new query sees every cached key, unless a window cuts the oldest.
        if causal and not causal_only and (q_len > 1 or window is not None):
            q_pos = torch.arange(past, past + q_len, device=device)[:, None]  # (S, 1)
            k_pos = torch.arange(k_len, device=device)[None, :]  # (1, T)
            allowed = k_pos <= q_pos  # (S, T)
            if window is not None:
                allowed = allowed & (k_pos > q_pos - window)
            allowed = allowed[None, None]  # (1, 1, S, T)

        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, k_len):
                raise ValueError(
                    f"key_padding_mask must have shape (B, T) = ({batch}, {k_len}), "
                    f"got {tuple(key_padding_mask.shape)}"
                )
            pad = key_padding_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
            allowed = pad if allowed is None else allowed & pad  # (B, 1, S|1, T)

        if attn_mask is not None:
            attn_mask = _as_4d(attn_mask.to(device), q_len, k_len)
            if attn_mask.dtype == torch.bool:
                allowed = attn_mask if allowed is None else allowed & attn_mask
            else:
                bias = attn_mask

        return Mask.of(allowed=allowed, bias=bias, causal_only=causal_only)

    @staticmethod
    def of(*, allowed: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           causal_only: bool = False) -> Mask:
        """The Mask of ``allowed`` (boolean) and ``bias`` (additive), broadcastable to
        (B, H, S, T), with the query rows they leave without a key flagged in ``row_ok``
        and opened."""
        row_ok = None
        if allowed is not None or bias is not None:
            ok = torch.ones(1, 1, 1, 1, dtype=torch.bool,
                            device=(allowed if allowed is not None else bias).device)
            if allowed is not None:
                ok = allowed.any(dim=-1, keepdim=True)
            if bias is not None:
                finite = bias > float("-inf")
                if allowed is not None:
                    finite = finite & allowed
                ok = ok & finite.any(dim=-1, keepdim=True)
            if not bool(ok.all()):
                row_ok = ok  # (B|1, H|1, S, 1)
                if allowed is not None:
                    allowed = allowed | ~ok
                if bias is not None:
                    bias = bias.masked_fill(~ok, 0.0)
        return Mask(allowed=allowed, bias=bias, causal_only=causal_only, row_ok=row_ok)

    def heads(self, index: torch.Tensor) -> Mask:
        """This mask for the query heads at ``index`` (H_x,): (B|1, H_x|1, S, T)."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or t.shape[1] == 1 else t.index_select(1, index)

        if all(t is None or t.shape[1] == 1 for t in (self.allowed, self.bias, self.row_ok)):
            return self  # the same for every head
        return Mask(allowed=pick(self.allowed), bias=pick(self.bias),
                    causal_only=self.causal_only, row_ok=pick(self.row_ok))


def _as_4d(mask: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """Reshape a (S, T), (B, S, T) or (B, H, S, T) mask to 4-D (B|1, H|1, S, T)."""
    if mask.shape[-2:] != (q_len, k_len):
        raise ValueError(
            f"attn_mask must end in (S, T) = ({q_len}, {k_len}), got {tuple(mask.shape)}"
        )
    if mask.dim() == 2:
        return mask[None, None]
    if mask.dim() == 3:
        return mask[:, None]
    if mask.dim() == 4:
        return mask
    raise ValueError(f"attn_mask must be 2-, 3- or 4-D, got {mask.dim()}-D")
