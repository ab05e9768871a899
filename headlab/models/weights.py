"""Weight conversion: a family's Hugging Face checkpoint names mapped to headlab's as data
(`WeightMap`), converted with counts and shapes checked (`convert_state_dict`), and
loaded so that a missing or unexpected key is an error, never a silent random init
(`load_into`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class WeightMap:
    """How one family's HF checkpoint names map to headlab names.

    ``per_layer`` maps ``"...{}..."`` HF templates to headlab templates (the ``{}`` is
    the layer index); ``single`` maps names outside the layers. ``transforms`` names the
    headlab keys whose tensor needs a function (e.g. Conv1D weights transposed);
    ``splits`` maps one HF key template to several headlab ones, split along dim 0
    (GPT-2's fused c_attn). ``ignore`` lists regexes of HF keys that are known
    non-weights (causal-mask buffers in old checkpoints).
    """

    per_layer: Mapping[str, str]
    single: Mapping[str, str]
    transforms: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = None  # type: ignore[assignment]
    splits: Mapping[str, tuple[str, ...]] = None  # type: ignore[assignment]
    ignore: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    # sizes along dim 0 of the pieces of a split whose parts differ (Phi-3's fused
    # qkv_proj with fewer key/value heads); splits not named here are equal chunks
    split_sizes: Mapping[str, tuple[int, ...]] = None  # type: ignore[assignment]


def convert_state_dict(
    hf_state: Mapping[str, torch.Tensor],
    wmap: WeightMap,
    n_layers: int,
    *,
    prefixes: tuple[str, ...] = ("",),
) -> dict[str, torch.Tensor]:
    """Rename an HF state dict to headlab names; every HF key must be used exactly once.

    ``prefixes`` lists alternative leading strings the checkpoint may use (e.g. both
    ``transformer.h.0...`` and ``h.0...``); the first that matches the keys wins.
    Raises ValueError naming the missing and unexpected keys.
    """
    prefix = _pick_prefix(hf_state, wmap, prefixes)
    ignore = [re.compile(p) for p in wmap.ignore]
    splits = wmap.splits or {}
    transforms = wmap.transforms or {}

    plan: dict[str, tuple[str, ...]] = {}  # hf key -> headlab key(s)
    sizes: dict[str, tuple[int, ...]] = {}  # hf key -> sizes of its unequal pieces
    for hf_t, hl_t in wmap.single.items():
        plan[_with_prefix(prefix, hf_t)] = (hl_t,)
    for i in range(n_layers):
        for hf_t, hl_t in wmap.per_layer.items():
            plan[_with_prefix(prefix, hf_t.format(i))] = (hl_t.format(i),)
        for hf_t, parts in splits.items():
            plan[_with_prefix(prefix, hf_t.format(i))] = tuple(p.format(i) for p in parts)
            if hf_t in (wmap.split_sizes or {}):
                sizes[_with_prefix(prefix, hf_t.format(i))] = wmap.split_sizes[hf_t]

    optional = {_with_prefix(prefix, o) for o in wmap.optional}
    missing = sorted(k for k in plan if k not in hf_state and k not in optional)
    unexpected = sorted(
        k for k in hf_state if k not in plan and not any(r.search(k) for r in ignore)
    )
    if missing or unexpected:
        raise ValueError(
            "checkpoint does not match the expected weights: "
            f"missing {missing[:10]}{' ...' if len(missing) > 10 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''} "
            f"({len(unexpected)})"
        )

    out: dict[str, torch.Tensor] = {}
    for hf_key, targets in plan.items():
        if hf_key not in hf_state:
            continue
        tensor = hf_state[hf_key]
        fn = _find_transform(transforms, hf_key)
        tensor = fn(tensor) if fn else tensor
        if hf_key in sizes:
            if sum(sizes[hf_key]) != tensor.shape[0]:
                raise ValueError(f"{hf_key} has {tensor.shape[0]} rows, the config "
                                 f"expects {' + '.join(map(str, sizes[hf_key]))}")
            pieces = tensor.split(sizes[hf_key], dim=0)
        else:
            pieces = tensor.chunk(len(targets), dim=0) if len(targets) > 1 else (tensor,)
        for name, piece in zip(targets, pieces, strict=True):
            out[name] = piece
    return out


def _with_prefix(prefix: str, key: str) -> str:
    """Templates starting with '^' sit outside the backbone prefix (e.g. ``^lm_head.weight``)."""
    return key[1:] if key.startswith("^") else prefix + key


def _pick_prefix(hf_state: Mapping[str, torch.Tensor], wmap: WeightMap, prefixes) -> str:
    probe = next(iter(wmap.per_layer)).format(0)
    for p in prefixes:
        if p + probe in hf_state:
            return p
    raise ValueError(
        f"checkpoint has no key like {[p + probe for p in prefixes]}; "
        f"its first keys are {sorted(hf_state)[:5]}"
    )


def _find_transform(transforms, name: str):
    for pattern, fn in transforms.items():
        if re.fullmatch(pattern, name):
            return fn
    return None


def load_into(model: nn.Module, state: Mapping[str, torch.Tensor], *, what: str) -> None:
    """Load weights with every parameter required and shapes checked, naming bad keys.

    headlab's own buffers (head ids, gates) may be absent: an HF checkpoint has none
    and the unpruned defaults apply.
    """
    own = model.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    missing = sorted(set(own) - set(state) - buffers)
    unexpected = sorted(set(state) - set(own))
    bad = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in set(own) & set(state)
        if tuple(own[k].shape) != tuple(state[k].shape)
    )
    if missing or unexpected or bad:
        raise ValueError(
            f"{what}: weights do not fit the model: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}, wrong shapes {bad[:8]}"
        )
    broken = sorted(k for k, v in state.items()
                    if v.is_floating_point() and not bool(torch.isfinite(v).all()))
    if broken:
        raise ValueError(
            f"{what}: tensors {broken[:8]} hold NaN or inf values; the checkpoint is "
            "corrupt (or was saved after a diverged run): headlab will not score it"
        )
    model.load_state_dict(state, strict=False)
    for attn in getattr(model, "attentions", []):
        attn.refresh_layout()
