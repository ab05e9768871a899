"""Progress bars (rich, on stderr) for loops that can take more than a second."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_enabled = False
_stop_requested = False


def request_stop() -> None:
    """Make every tracked loop raise KeyboardInterrupt at its next item. The CLI's
    signal handler calls this as well as raising: a KeyboardInterrupt raised while
    Python runs a finaliser (``__del__``, a weakref callback) is printed and dropped,
    and the run would go on."""
    global _stop_requested
    _stop_requested = True


def set_enabled(on: bool) -> None:
    """The CLI turns bars on (unless --quiet); library calls stay silent by default."""
    global _enabled
    _enabled = on


def track(items: Iterable[T], *, total: int | None = None, description: str = "",
          status: Callable[[], str] | None = None) -> Iterator[T]:
    """Iterate with a bar showing count, rate and ETA when bars are enabled; stop with
    KeyboardInterrupt once `request_stop` was called. ``status`` (a training loop's loss,
    say) is shown after the description, read again after each item."""
    if not _enabled:
        for item in items:
            if _stop_requested:
                raise KeyboardInterrupt
            yield item
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
            if _stop_requested:
                raise KeyboardInterrupt
            yield item
            bar.advance(task)
            if status is not None:
                bar.update(task, description=f"{description} {status()}")
