"""How the layer-wise walk (`headlab.recovery.layerwise`) reads a block's sublayers and
stands in for them: taps on the named hooks, sublayers answering with outputs computed
already, a down projection left out, and a batch's real tokens picked from (B, S, ...)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from headlab.attention import MultiHeadAttention
from headlab.attention.hooks import hooks
from headlab.models.base import HeadModel


class _Output(nn.Module):
    """Stands in for a block's sublayer: returns the output it was given, computed
    already, whatever it is called with."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.out


@contextlib.contextmanager
def fixed(model: HeadModel, i: int, attn_out: torch.Tensor,
           mlp_out: torch.Tensor | None) -> Iterator[None]:
    """Block i with its attention (and MLP, if given) answering with these outputs
    (B, S, E): the residual sums and norms around them are the block's own."""
    block = model.blocks[i]
    attn, mlp = block.attn, block.mlp
    block.attn = _Output(attn_out)
    if mlp_out is not None:
        block.mlp = _Output(mlp_out)
    try:
        yield
    finally:
        block.attn, block.mlp = attn, mlp


class _Zeros(nn.Module):
    """Stands in for a projection whose output is not needed: zeros (..., out_features)."""

    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)


@contextlib.contextmanager
def skipped_down(model: HeadModel, i: int) -> Iterator[None]:
    """Block i's MLP with its down projection answering zeros: the MLP's output is 0,
    and the residual it is added to (the block's output then) is all the block gives."""
    owner, name = down_owner(model, i)
    linear = getattr(owner, name)
    setattr(owner, name, _Zeros(linear.out_features))
    try:
        yield
    finally:
        setattr(owner, name, linear)


def down_projection(model: HeadModel, i: int) -> nn.Linear:
    owner, name = down_owner(model, i)
    return getattr(owner, name)


def down_owner(model: HeadModel, i: int) -> tuple[nn.Module, str]:
    """The module holding block i's MLP down projection, and its attribute name."""
    path, name = model.mlp_down.rsplit(".", 1)
    return model.blocks[i].get_submodule(path), name


@contextlib.contextmanager
def tap(model: HeadModel, layer: int, *, attn: bool = True,
         mlp: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Keep the layer's z (B, S, H, D) and attention output (B, S, E) of the next call
    (unless not ``attn``); with ``mlp`` the residual its MLP's output is added to
    ``mid`` (B, S, E, see the module docstring), the MLP's output ``mlp`` (B, S, E) and
    the down projection's input ``act`` (B, S, F)."""
    seen: dict[str, torch.Tensor] = {}

    def keep(t: torch.Tensor, name: str) -> None:
        seen[name.rsplit(".", 1)[-1]] = t

    names = {f"blocks.{layer}.attn.z": keep, f"blocks.{layer}.attn.out": keep} if attn else {}
    handles = []
    if mlp:
        names[f"blocks.{layer}.resid_mid"] = lambda t, name: seen.__setitem__("mid", t)
        names[f"blocks.{layer}.resid_post"] = lambda t, name: seen.__setitem__("post", t)
        block = model.blocks[layer]
        handles.append(block.mlp.register_forward_hook(
            lambda _m, _args, out: seen.__setitem__("mlp", out)))
        handles.append(down_projection(model, layer).register_forward_pre_hook(
            lambda _m, args: seen.__setitem__("act", args[0])))
    try:
        with hooks(model, names):
            yield seen
        if mlp and "mid" not in seen:  # a parallel residual (module docstring)
            seen["mid"] = seen["post"] - seen["mlp"]
    finally:
        for h in handles:
            h.remove()


def head_outputs(seen: dict[str, torch.Tensor], attn: MultiHeadAttention, real: Real):
    """The real tokens' z (N, H, D); a layer with no head left never reaches its z hook."""
    if "z" in seen:
        return real(seen["z"])
    return seen["out"].new_zeros(real.n, 0, attn.head_dim)


class Real:
    """One batch's real tokens (attention_mask (B, S)): ``real(t)`` is t[mask] (N, ...)
    for t (B, S, ...), a view of t when no token is padding."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask
        self.n = int(mask.sum())
        self.all = self.n == mask.numel()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.flatten(0, 1) if self.all else t[self.mask]
