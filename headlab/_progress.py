"""Progress bars (rich, on stderr) for loops that can take more than a second."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_enabled = False


def set_enabled(on: bool) -> None:
    """The CLI turns bars on (unless --quiet); library calls stay silent by default."""
    global _enabled
    _enabled = on


def track(items: Iterable[T], *, total: int | None = None, description: str = "") -> Iterator[T]:
    """Iterate with a bar showing count, rate and ETA when bars are enabled."""
    if not _enabled:
        yield from items
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed:.2f} it/s" if task.speed else "-- it/s")

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               RateColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
