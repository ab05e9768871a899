"""Hook points by name: capture activations and change them, always cleaned up.

Every attention block exposes (shapes for one forward):
    blocks.{i}.attn.q        (B, S, H, D)    queries after rotary
    blocks.{i}.attn.k        (B, S, H_kv, D) keys of the new positions, after rotary
    blocks.{i}.attn.v        (B, S, H_kv, D)
    blocks.{i}.attn.scores   (B, H, S, T)    scaled, masked, pre-softmax (float32)
    blocks.{i}.attn.pattern  (B, H, S, T)    attention weights (float32)
    blocks.{i}.attn.z        (B, S, H, D)    per-head outputs (gated), before W_O
    blocks.{i}.attn.out      (B, S, E)
    blocks.{i}.resid_pre / resid_mid / resid_post   (B, S, E)
Hooking ``scores`` or ``pattern`` switches that block to the eager path for the call,
so a capture is never silently empty.

The module is also the function: ``headlab.hooks(model, fns)`` calls `hooks`, while
``headlab.hooks.ablate_heads`` and ``headlab.hooks.mean_z`` stay its functions.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from headlab._util.checks import check_int
from headlab._util.modules import make_callable
from headlab.attention import MultiHeadAttention
from headlab.attention.hookpoint import HookPoint
from headlab.errors import CaptureTooLargeError, UserError

__all__ = [
    "Capture",
    "CaptureTooLargeError",
    "ablate_heads",
    "capture",
    "hook_names",
    "hooks",
    "mean_z",
]

# per-head tensors: which dim holds heads
_HEAD_DIM = {"q": 2, "k": 2, "v": 2, "z": 2, "scores": 1, "pattern": 1}
_DEFAULT_LIMIT = 2 * 2**30


def hook_names(model: nn.Module) -> list[str]:
    """All hook point names of a model, in forward order."""
    return [name for name, m in model.named_modules() if isinstance(m, HookPoint)]


def _resolve(model: nn.Module, names: str | Iterable[str], layers=None) -> dict[str, HookPoint]:
    """Hook points matching glob patterns; a pattern without a dot means any block's
    hook of that name (``"pattern"`` == ``"blocks.*.attn.pattern"``)."""
    patterns = [names] if isinstance(names, str) else list(names)
    patterns = [p if "." in p or "*" in p else f"*.{p}" for p in patterns]
    if layers is None and not any(c in p for p in patterns for c in "*?["):
        exact = _exact(model, patterns)  # no walk over every module: the recovery walk
        if exact is not None:  # asks for a few names of one layer per batch
            return exact
    points = {n: m for n, m in model.named_modules() if isinstance(m, HookPoint)}
    chosen = {n: m for n, m in points.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    if layers is not None:
        wanted = {check_int(i, "layers[...]") for i in layers}
        n_layers = len({layer_of(n) for n in points} - {None})
        beyond = sorted(i for i in wanted if not 0 <= i < n_layers)
        if beyond:
            raise UserError(f"layers {beyond} are beyond the model's {n_layers} layers "
                            f"(0..{n_layers - 1})")
        chosen = {n: m for n, m in chosen.items() if layer_of(n) in wanted}
    if not chosen:
        raise KeyError(
            f"no hook point matches {patterns}; examples of names: {list(points)[:9]}"
        )
    return chosen


def _exact(model: nn.Module, names: list[str]) -> dict[str, HookPoint] | None:
    """The hook points at these exact names, or None if one is not a hook point."""
    found = {}
    for name in names:
        try:
            point = model.get_submodule(name)
        except AttributeError:
            return None
        if not isinstance(point, HookPoint):
            return None
        found[name] = point
    return found


def layer_of(name: str) -> int | None:
    """The layer of a hook point name (``blocks.{i}.attn.pattern`` -> i), None outside the
    blocks."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "blocks" and parts[1].isdigit() else None


@dataclass
class Capture:
    """Activations stored by `capture`, by hook name: ``cap["blocks.0.attn.pattern"]``.

    Each forward inside the context replaces what the previous one stored.
    ``head_ids[name]`` gives the original head index of each stored head.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    head_ids: dict[str, list[int]] = field(default_factory=dict)
    forwards: int = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"{name!r} was not captured; captured: {list(self.tensors)[:8]}")
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self):
        return self.tensors.keys()

    def items(self):
        return self.tensors.items()

    def per_layer(self, kind: str = "pattern") -> list[torch.Tensor]:
        """The captured tensors of one kind, one per layer in order (heads may differ)."""
        return [self.tensors[n] for n in self._names(kind)]

    def stack(self, kind: str = "pattern") -> torch.Tensor:
        """The captured tensors of one kind as one tensor, layers first: (L, B, H, S, T)
        for ``pattern``, (L, B, S, H, D) for ``z``, (L, B, S, E) for ``out``. Where
        layers hold different heads (a pruned model), the head dim spans every original
        head id any layer holds, in order, and a head a layer lacks is NaN."""
        names = self._names(kind)
        tensors = [self.tensors[n] for n in names]
        ids = [self.head_ids.get(n) for n in names]
        if all(t.shape == tensors[0].shape for t in tensors) and all(i == ids[0] for i in ids):
            return torch.stack(tensors)
        dim = _HEAD_DIM[kind]
        union = sorted({h for i in ids for h in i})
        shape = list(tensors[0].shape)
        shape[dim] = len(union)
        dtype = tensors[0].dtype if tensors[0].is_floating_point() else torch.float32
        out = torch.full((len(tensors), *shape), math.nan, dtype=dtype,
                         device=tensors[0].device)
        for layer, (t, i) in enumerate(zip(tensors, ids, strict=True)):
            index = torch.tensor([union.index(h) for h in i], dtype=torch.long,
                                 device=t.device)
            out[layer].index_copy_(dim, index, t.to(dtype))
        return out

    def _names(self, kind: str) -> list[str]:
        names = sorted((n for n in self.tensors if n.endswith(f".{kind}")),
                       key=lambda n: layer_of(n) or 0)
        if not names:
            raise KeyError(f"no {kind!r} tensors were captured; captured: "
                           f"{list(self.tensors)[:8]}")
        return names

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{n}</td><td>{tuple(t.shape)}</td><td>{str(t.dtype).replace('torch.', '')}"
            "</td></tr>"
            for n, t in self.tensors.items()
        )
        return (
            f"<div><b>headlab Capture</b>: {len(self.tensors)} tensors, "
            f"{self.nbytes() / 2**20:.1f} MiB, {self.forwards} forward(s)"
            "<table><tr><th>name</th><th>shape</th><th>dtype</th></tr>"
            f"{rows}</table></div>"
        )


def _estimate(model: nn.Module, points: Mapping[str, HookPoint], batch: int, seq: int,
              past: int, heads: list[int] | None, dtype: torch.dtype | None) -> int:
    """Bytes a capture of these points will store for one forward of (batch, seq)."""
    param = next(model.parameters(), None)
    stored = param.dtype if param is not None and param.is_floating_point() else torch.float32
    total = 0
    for name in points:
        kind = name.rsplit(".", 1)[-1]
        attn = _owner_attention(model, name)
        own = stored
        if kind in ("scores", "pattern"):  # float32 at least (see headlab.attention)
            own = torch.promote_types(stored, torch.float32)
        size = torch.finfo(dtype or own).bits // 8
        if attn is not None and kind in _HEAD_DIM:
            h = attn.n_heads if heads is None else sum(
                int(i) in heads for i in attn.head_ids.tolist())
            if kind in ("k", "v"):
                h = attn.n_kv_heads
            if kind in ("scores", "pattern"):
                total += batch * h * seq * (past + seq) * size
            else:
                total += batch * seq * h * attn.head_dim * size
        else:
            width = getattr(attn, "d_model", None) or _model_width(model)
            total += batch * seq * width * size
    return total


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB"


def _owner_attention(model: nn.Module, name: str):
    parent = name.rsplit(".", 1)[0]
    try:
        mod = model.get_submodule(parent)
    except AttributeError:
        return None
    # an isinstance test: HeadModel itself has a head_ids() method
    return mod if isinstance(mod, MultiHeadAttention) else None


def _model_width(model: nn.Module) -> int:
    attn = next((m for m in model.modules() if isinstance(m, MultiHeadAttention)), None)
    return attn.d_model if attn is not None else 1


@contextlib.contextmanager
def capture(
    model: nn.Module,
    names: str | Iterable[str] = "pattern",
    *,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    max_bytes: int | None = None,
) -> Iterator[Capture]:
    """Store the activations at the named hook points during forwards in the context.

    ``names``: hook names or globs (``"pattern"``, ``"blocks.*.attn.z"``, ``["q", "k"]``).
    ``heads``: original head indices to keep of per-head tensors. ``dtype`` (e.g.
    torch.float16) and ``device`` (e.g. "cpu") convert what is stored. Before each
    forward the storage is estimated and CaptureTooLargeError raised above
    ``max_bytes`` (default 2 GiB, or the HEADLAB_CAPTURE_LIMIT environment variable).
    """
    points = _resolve(model, names, layers)
    limit = (max_bytes if max_bytes is not None
             else int(os.environ.get("HEADLAB_CAPTURE_LIMIT", _DEFAULT_LIMIT)))
    head_set = None if heads is None else [int(h) for h in heads]
    store = Capture()
    handles = []

    def pre_forward(_module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is None or ids.dim() != 2:
            return
        cache = kwargs.get("cache")
        past = cache.length if cache is not None else 0
        need = _estimate(model, points, ids.shape[0], ids.shape[1], past, head_set, dtype)
        if need > limit:
            raise CaptureTooLargeError(
                f"capturing {len(points)} hook points for a batch of {tuple(ids.shape)} "
                f"needs about {_mib(need)} ({need} bytes), over the limit of {_mib(limit)} "
                f"({limit} bytes). "
                "Capture fewer layers (layers=...) or heads (heads=...), store float16 "
                "(dtype=torch.float16), use a shorter text or smaller batch, or raise the "
                "limit (max_bytes=... or HEADLAB_CAPTURE_LIMIT)",
                needed=need, limit=limit,
            )
        store.forwards += 1

    def make_hook(name: str, kind: str, attn):
        def hook(_module, _inputs, output):
            t = output.detach()
            ids = None
            if attn is not None and kind in _HEAD_DIM:
                # k and v hold key/value heads, which keep their own ids under GQA
                ids = (attn.kv_head_ids if kind in ("k", "v") else attn.head_ids).tolist()
            if head_set is not None and ids is not None and kind not in ("k", "v"):
                pos = [p for p, h in enumerate(ids) if h in head_set]
                index = torch.tensor(pos, dtype=torch.long, device=t.device)
                t = t.index_select(_HEAD_DIM[kind], index)
                ids = [ids[p] for p in pos]
            if dtype is not None or device is not None:
                t = t.to(device=device or t.device, dtype=dtype or t.dtype)
            store.tensors[name] = t
            if ids is not None:
                store.head_ids[name] = ids
        return hook

    if isinstance(model, nn.Module) and hasattr(model, "blocks"):
        handles.append(model.register_forward_pre_hook(pre_forward, with_kwargs=True))
    try:
        for name, point in points.items():
            kind = name.rsplit(".", 1)[-1]
            handles.append(point.register_forward_hook(make_hook(name, kind,
                                                                  _owner_attention(model, name))))
        yield store
    finally:
        for h in handles:
            h.remove()


HookFn = Callable[[torch.Tensor, str], torch.Tensor | None]


@contextlib.contextmanager
def hooks(model: nn.Module, fns: Mapping[str, HookFn]) -> Iterator[None]:
    """Change activations: ``{name_or_glob: fn(tensor, name) -> tensor | None}``.

    A returned tensor replaces the activation; None keeps it. Hooks are removed on
    exit, also when the body raises.
    """
    handles = []
    try:
        for pattern, fn in fns.items():
            for name, point in _resolve(model, pattern).items():
                def hook(_module, _inputs, output, _fn=fn, _name=name):
                    return _fn(output, _name)
                handles.append(point.register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


def ablate_heads(
    model: nn.Module,
    heads: Mapping[int, Iterable[int]],
    *,
    means: Mapping[int, torch.Tensor] | None = None,
) -> dict[str, HookFn]:
    """Hook functions that ablate {layer: original head ids} at ``z``.

    Zero-ablation by default (equal to gating those heads to 0); with ``means``
    ({layer: (H, D)} from `mean_z`) each head's output is replaced by its dataset mean.
    Use as ``with hooks(model, ablate_heads(model, {0: [3]})): model(ids)``.
    """
    fns: dict[str, HookFn] = {}
    for layer, ids in heads.items():
        attn = model.blocks[int(layer)].attn
        pos = [p for p, h in enumerate(attn.head_ids.tolist()) if h in {int(i) for i in ids}]
        if not pos:
            continue
        mean = None if means is None else means[int(layer)]

        def fn(z: torch.Tensor, _name: str, _pos=pos, _mean=mean) -> torch.Tensor:
            z = z.clone()  # (B, S, H, D)
            if _mean is None:
                z[:, :, _pos] = 0
            else:
                z[:, :, _pos] = _mean[_pos].to(z.dtype)
            return z

        fns[f"blocks.{int(layer)}.attn.z"] = fn
    return fns


@torch.no_grad()
def mean_z(
    model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]]
) -> dict[int, torch.Tensor]:
    """Mean per-head output z over all valid tokens of a dataset: {layer: (H, D)}."""
    sums: dict[int, torch.Tensor] = {}
    count = 0.0
    device = next(model.parameters()).device
    for batch in batches:
        ids = batch["input_ids"].to(device)
        valid = batch.get("attention_mask")
        valid = valid.to(device) if valid is not None else None
        with capture(model, "z") as cap:
            model(ids, attention_mask=valid)
        w = (valid if valid is not None else torch.ones_like(ids)).double()
        for name, z in cap.items():
            layer = layer_of(name)
            s = torch.einsum("bshd,bs->hd", z.double(), w)
            sums[layer] = sums.get(layer, 0) + s
        count += float(w.sum())
    if not count or math.isnan(count):
        raise ValueError("mean_z needs at least one valid token")
    return {layer: (s / count).float() for layer, s in sums.items()}


make_callable(__name__, lambda: hooks)
