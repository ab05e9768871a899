"""Quantities as a person reads them, one way everywhere: the terminal summary and the
HTML report print the same bytes and durations for the same run."""

from __future__ import annotations


def _scaled(value: float, unit: str, larger: tuple[tuple[str, float], ...]) -> str:
    """``value`` in ``unit`` to 3 significant digits, in the next of ``larger`` (name,
    how many of the current unit make one) wherever it would round to one of those:
    999.7 ms is 1 s, not 1e+03 ms."""
    for name, factor in larger:
        if float(f"{value:.3g}") < factor:
            break
        value, unit = value / factor, name
    return f"{value:.3g} {unit}"


def human_bytes(n: float | None) -> str:
    """Bytes in powers of 1000: 640 B, 9.2 KB, 1.5 MB; None is "-"."""
    if n is None:
        return "-"
    if round(n) < 1000:
        return f"{n:.0f} B"
    return _scaled(n / 1e3, "KB", (("MB", 1e3), ("GB", 1e3)))


def human_ms(ms: float | None) -> str:
    """A duration in milliseconds: 850 ms, 26.1 s, 3.2 min; None is "-"."""
    if ms is None:
        return "-"
    return _scaled(ms, "ms", (("s", 1000), ("min", 60)))
