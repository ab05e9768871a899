"""The repository's scripts/ as modules, for the tests that call their functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script(name: str) -> ModuleType:
    """scripts/NAME.py, imported (its own imports of scripts/ resolve as when run)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
