"""Input checks shared by the statistics and rollout: shapes, dtypes and head indices.

Each check raises with the shape it was given, the shape it expected and how to get
there, so a caller who passed one layer instead of a list sees what to change.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


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
