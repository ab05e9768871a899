"""Quantities as a person reads them, one way everywhere: the terminal summary and the
HTML report print the same bytes and durations for the same run."""

from __future__ import annotations


def human_bytes(n: float | None) -> str:
    """Bytes in powers of 1000: 640 B, 9.2 KB, 1.5 MB; None is "-"."""
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def human_ms(ms: float | None) -> str:
    """A duration in milliseconds: 850 ms, 26.1 s, 3.2 min; None is "-"."""
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms:.3g} ms"
    return f"{ms / 1000:.3g} s" if ms < 60_000 else f"{ms / 60_000:.3g} min"
