"""The one way a script rewrites a generated block of a Markdown page (the README's
capability table, the benchmark tables): replace it, or with ``check`` only say
whether it is stale."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def update(path: Path, find: Callable[[str], str], new: str, *, check: bool, what: str,
           markers: str, script: str) -> int:
    """Put ``new`` where ``find(text)`` finds the block of ``path``; exit status 0, or
    1 where ``check`` finds it stale, or 2 where the page lacks ``markers``."""
    text = path.read_text()
    try:
        old = find(text)
    except ValueError:
        print(f"{path} lacks the markers {markers}: add them where the {what} belongs",
              file=sys.stderr)
        return 2
    if check:
        if old != new:
            print(f"{path}: the {what} is stale; run python {script}", file=sys.stderr)
            return 1
        return 0
    path.write_text(text.replace(old, new))
    return 0
