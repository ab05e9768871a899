"""What a benchmark is told and what it reports: `Timing` (the repeat settings every timed
benchmark's sizes share), `Figure` (median and quartiles of repeated measurements),
`Target` (a ratio held against a goal, with ``meets``), `BenchResult` (one benchmark's
figures, targets, method and checks, as JSON) and the Markdown table of all targets."""

from __future__ import annotations

import math
import platform
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BenchResult", "Figure", "Target", "Timing", "markdown_table", "max_diff",
           "versions"]


@dataclass(frozen=True, kw_only=True)
class Timing:
    """How a timed benchmark repeats itself: ``warmup`` untimed rounds, then ``repeats``
    interleaved timed ones (`headlab._util.timing.time_interleaved`). Every timed benchmark's
    sizes extend it, so the two settings mean the same in every preset."""

    repeats: int = 3
    warmup: int = 1


@dataclass(frozen=True)
class Figure:
    """Median and quartiles of repeated measurements (or of per-round ratios); the
    samples are kept in the order they were taken (round by round)."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int
    unit: str
    samples: tuple[float, ...] = ()

    @property
    def spread(self) -> float:
        """Interquartile range, q3 - q1, in the figure's unit."""
        return self.q3 - self.q1

    @classmethod
    def of(cls, samples: Sequence[float], unit: str) -> Figure:
        taken = tuple(float(x) for x in samples)
        xs = sorted(taken)
        if not xs:
            raise ValueError("a figure needs at least one sample")
        if len(xs) == 1:
            q1 = q3 = xs[0]
        else:
            q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return cls(statistics.median(xs), q1, q3, xs[0], xs[-1], len(xs), unit, taken)

    def to_json(self) -> dict[str, Any]:
        return {"median": _num(self.median), "spread": _num(self.spread), "q1": _num(self.q1),
                "q3": _num(self.q3), "min": _num(self.min), "max": _num(self.max),
                "n": self.n, "unit": self.unit, "samples": [_num(x) for x in self.samples]}


@dataclass(frozen=True)
class Target:
    """A ratio figure held against a goal: ``ratio >= target`` or ``ratio <= target``."""

    figure: str
    what: str
    ratio: float
    q1: float
    q3: float
    target: float
    op: str  # ">=" or "<="

    def __post_init__(self) -> None:
        if self.op not in (">=", "<="):
            raise ValueError(f"target op must be '>=' or '<=', got {self.op!r}")

    @classmethod
    def judge(cls, figure: str, fig: Figure, *, target: float, op: str, what: str) -> Target:
        return cls(figure, what, fig.median, fig.q1, fig.q3, target, op)

    @property
    def meets(self) -> bool:
        """Computed from the median ratio; a ratio that is not a number never meets."""
        if not math.isfinite(self.ratio):
            return False
        return self.ratio >= self.target if self.op == ">=" else self.ratio <= self.target

    def to_json(self) -> dict[str, Any]:
        return {"figure": self.figure, "what": self.what, "ratio": _num(self.ratio),
                "spread": _num(self.q3 - self.q1), "q1": _num(self.q1), "q3": _num(self.q3),
                "target": self.target, "op": self.op, "meets": self.meets}


@dataclass
class BenchResult:
    """What one benchmark measured: figures by name, targets on some ratio figures,
    headline ratios without a target (``info``), how each thing was measured
    (``method``), correctness checks against the references (``checks``)."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Figure] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    info: list[tuple[str, str]] = field(default_factory=list)  # (figure, what)
    method: dict[str, str] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    elapsed_s: float = 0.0

    @classmethod
    def of_sizes(cls, name: str, sizes: Any, **config: Any) -> BenchResult:
        """An empty result whose config records every field of ``sizes``, the dtype
        (float32 throughout) and any ``config`` a benchmark adds, so each JSON says what
        was run."""
        return cls(name, config={**sizes.__dict__, "dtype": "float32", **config})

    def add(self, name: str, samples: Sequence[float], unit: str) -> Figure:
        fig = Figure.of(samples, unit)
        self.figures[name] = fig
        return fig

    def add_target(self, figure: str, *, target: float, op: str, what: str) -> Target:
        t = Target.judge(figure, self.figures[figure], target=target, op=op, what=what)
        self.targets.append(t)
        return t

    def to_json(self, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            **dict(context or {}),
            "config": _jsonable(self.config),
            "figures": {k: f.to_json() for k, f in self.figures.items()},
            "targets": [t.to_json() for t in self.targets],
            "info": [{"figure": f, "what": w, "value": _num(self.figures[f].median)}
                     for f, w in self.info],
            "method": self.method,
            "checks": _jsonable(self.checks),
            "error": self.error,
            "elapsed_s": round(self.elapsed_s, 2),
            "definitions": {
                "median": "median over repeats (for ratios: of the per-round paired ratios)",
                "spread": "interquartile range q3 - q1, in the figure's unit",
                "samples": "every measurement, in the order taken (round by round)",
            },
        }


def _num(x: float) -> float | None:
    """JSON has no NaN: a figure that could not be computed is null."""
    return float(x) if math.isfinite(x) else None


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return _num(x)
    if isinstance(x, int | str | bool) or x is None:
        return x
    return str(x)  # a ModelSpec says its name


def against(value: float, target: float) -> str:
    """``value`` to 3 significant digits, or more (up to 6) where 3 would print the
    target itself for a value that is not it: 1.0047 against a target of 1 reads 1.005."""
    for digits in range(3, 7):
        text = f"{value:.{digits}g}"
        if value == target or not math.isfinite(value) or float(text) != target:
            break
    return text


def markdown_table(results: Sequence[BenchResult]) -> str:
    """One row per target (and per headline ratio without one); failed benchmarks say why."""
    rows = ["| benchmark | measure | median | q1–q3 | target | meets |",
            "|---|---|---|---|---|---|"]
    for r in results:
        if r.error is not None:
            rows.append(f"| {r.name} | NOT MEASURED: {_cell(r.error)} | | | | **error** |")
        for t in r.targets:
            rows.append(f"| {r.name} | {_cell(t.what)} | {against(t.ratio, t.target)} | "
                        f"{t.q1:.3g}–{t.q3:.3g} | {t.op} {t.target:g} | "
                        f"{'yes' if t.meets else '**no**'} |")
        for name, what in r.info:
            f = r.figures[name]
            rows.append(f"| {r.name} | {_cell(what)} | {f.median:.3g} | "
                        f"{f.q1:.3g}–{f.q3:.3g} | — | — |")
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference between two outputs."""
    return float((a.float() - b.float()).abs().max())


def versions() -> dict[str, str]:
    """headlab, torch, transformers and Python versions."""
    import transformers

    import headlab

    return {"headlab": headlab.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}
