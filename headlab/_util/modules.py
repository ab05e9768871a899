"""A module that can also be called, so a public function and the module it lives in
share one name (``headlab.evaluate(model, blocks)`` and ``headlab.evaluate.needle``)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable


def make_callable(module_name: str, target: Callable[[], Callable]) -> None:
    """Calling the module ``module_name`` calls ``target()``'s result with the same
    arguments; ``target`` is asked at call time, so the function's own module may be
    imported lazily."""

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return target()(*args, **kwargs)

    sys.modules[module_name].__class__ = CallableModule
