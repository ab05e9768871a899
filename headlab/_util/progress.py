"""Progress on stderr (rich) for what can take more than a second: a bar for a loop
(`track`), a spinner for a phase that has no count to show (`spinner`). Both are
silent unless the CLI turned them on, and off under --quiet or --json."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
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


def _console():
    from rich.console import Console

    return Console(file=sys.stderr)


def enabled() -> bool:
    """Whether bars and spinners show."""
    return _enabled


@contextmanager
def spinner(description: str) -> Iterator[None]:
    """A spinner with ``description`` while the block runs, when progress is on."""
    if not _enabled:
        yield
        return
    with _console().status(description):
        yield


def tokens_in(batch: dict) -> int:
    """The real tokens of a batch (`headlab.data.Blocks.batches`): what a bar counts."""
    return int(batch["attention_mask"].sum())


def track(items: Iterable[T], *, total: int | None = None, description: str = "",
          size: Callable[[T], int] | None = None, unit: str = "it",
          status: Callable[[], str] | None = None) -> Iterator[T]:
    """Iterate with a bar showing count, rate and ETA when bars are enabled; stop with
    KeyboardInterrupt once `request_stop` was called. With ``size`` the bar counts
    ``size(item)`` per item (tokens per batch: a few batches still move the bar in
    steps a reader sees) and ``total`` is in that ``unit``. ``status`` (a training
    loop's loss, say) is shown after the description, read again after each item."""
    if not _enabled:
        for item in items:
            if _stop_requested:
                raise KeyboardInterrupt
            yield item
        return
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
            speed = task.speed
            return Text(f"{speed:,.{0 if speed and speed >= 100 else 2}f} {unit}/s"
                        if speed else f"-- {unit}/s")

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               RateColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=_console(), transient=True) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            if _stop_requested:
                raise KeyboardInterrupt
            yield item
            bar.advance(task, size(item) if size is not None else 1)
            if status is not None:
                bar.update(task, description=f"{description} {status()}")
