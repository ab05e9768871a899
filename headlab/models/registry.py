"""The model families headlab knows: each family module registers its classes once.

At the bottom of a family module::

    register(Qwen3, hf_types=("qwen3",), from_hf=from_hf)

names the class (its ``family`` is the name a saved directory records), the Hugging
Face ``model_type``s it reads and the function converting such a checkpoint. Loading
(`headlab.load`, the sharded reader) looks classes up here and nowhere else.
`register` refuses a class that leaves out a piece of the model interface
(`HeadModel.interface_gaps`), so a family missing one fails on import, not when the
piece is used.

No list of family modules is kept: the first lookup imports every module of
`headlab.models` (each registers itself on import), so the registry is full whichever
module a caller imported first, and adding a family touches only its own module.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from headlab.errors import ModelNotFoundError

# The classes registered here are `headlab.models.base.HeadModel`s, their configs
# `FamilyConfig`s and their maps `headlab.models.weights.WeightMap`s; they are typed by
# what this module asks of them (a HeadModel saves through `format`, which reads this
# registry, so base is not imported here, not even for type checking).


@dataclass(frozen=True)
class Family:
    """One registered class and how its Hugging Face checkpoints are read.

    ``from_hf(config, state, path=None)`` builds the model from an HF config dict and
    state dict. ``read_config`` (HF config dict -> family config) and ``weight_map``
    (family config -> `WeightMap`) are given where every headlab tensor is one checkpoint
    tensor renamed, so that each rank of a sharded load reads only its rows of it.
    """

    cls: type[nn.Module]
    hf_types: tuple[str, ...]
    from_hf: Callable[..., nn.Module]
    read_config: Callable[[dict], Any] | None = None
    weight_map: Callable[[Any], Any] | None = None


_BY_NAME: dict[str, Family] = {}
_BY_HF_TYPE: dict[str, Family] = {}
_complete = False


def register(cls: type[nn.Module], *, hf_types: tuple[str, ...],
             from_hf: Callable[..., nn.Module],
             read_config: Callable[[dict], Any] | None = None,
             weight_map: Callable[[Any], Any] | None = None) -> Family:
    """Record ``cls`` under its family name and ``hf_types``; TypeError where the class
    lacks a piece of the model interface or a name is another class's already."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    gaps = cls.interface_gaps()
    if gaps:
        raise TypeError(f"{where} does not declare the model interface of "
                        f"headlab.models.base.HeadModel: {'; '.join(gaps)}")
    if (read_config is None) != (weight_map is None):
        raise TypeError(f"{where}: give read_config and weight_map together, or neither")
    family = Family(cls, tuple(hf_types), from_hf, read_config, weight_map)
    for table, names in ((_BY_NAME, (cls.family,)), (_BY_HF_TYPE, family.hf_types)):
        for name in names:
            held = table.get(name)
            if held is not None and _qualified(held.cls) != where:
                raise TypeError(f"{where}: {name!r} is registered by {_qualified(held.cls)}")
            table[name] = family
    return family


def by_name(name: str) -> Family:
    """The family a headlab directory names (its config.json's ``family``)."""
    _import_all()
    if name not in _BY_NAME:
        raise ModelNotFoundError(f"unknown model family {name!r}; this headlab knows "
                                 f"{', '.join(sorted(_BY_NAME))}")
    return _BY_NAME[name]


def by_hf_type(model_type: str) -> Family:
    """The family reading Hugging Face checkpoints of ``model_type``."""
    _import_all()
    if model_type not in _BY_HF_TYPE:
        raise ModelNotFoundError(
            f"architecture {model_type!r} is not supported; supported model types: "
            f"{', '.join(sorted(_BY_HF_TYPE))}")
    return _BY_HF_TYPE[model_type]


def families() -> list[Family]:
    """Every registered family, in the order of their names."""
    _import_all()
    return [_BY_NAME[name] for name in sorted(_BY_NAME)]


def _import_all() -> None:
    """Import every module of `headlab.models` once: the family modules register."""
    global _complete
    if _complete:
        return
    import headlab.models as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    _complete = True


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
