"""The report's benchmark section: lm-eval task metrics before and after pruning, and
the needle test's exact-match grid (context length x depth) as heatmaps."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup, escape

from headlab.results import RunResult

from ._figures import _svg, viridis

_MISSING = "not measured"


def _value(metrics: dict[str, Any] | None, key: str) -> str:
    v = (metrics or {}).get(key)
    return f"{v:.4g}" if isinstance(v, int | float) and not isinstance(v, bool) else _MISSING


def task_rows(result: RunResult) -> list[tuple[str, str, str, str]]:
    """(task, metric, before, after) for each numeric metric lm-eval reported."""
    rows = []
    for name, ba in result.tasks.items():
        keys = [k for side in (ba.before, ba.after) for k, v in (side or {}).items()
                if isinstance(v, int | float) and not isinstance(v, bool)]
        for key in dict.fromkeys(keys):
            rows.append((name, key, _value(ba.before, key), _value(ba.after, key)))
    return rows


def needle_heatmap(lengths: list[int], depths: list[float], accuracy: list[list[float]],
                   *, title: str) -> Markup:
    """Context length (rows) x depth of the fact (columns), coloured by exact match 0..1."""
    cell, left, top = 46.0, 70.0, 30.0
    width = left + cell * len(depths) + 12
    height = top + cell * len(lengths) + 34
    body = [f'<text x="{left + cell * len(depths) / 2:.1f}" y="11" class="axis-title" '
            f'text-anchor="middle">{escape(title)}: depth of the fact</text>']
    for j, d in enumerate(depths):
        body.append(f'<text x="{left + cell * (j + 0.5):.1f}" y="{top - 5:.1f}" '
                    f'text-anchor="middle">{100 * d:.0f}%</text>')
    for i, (length, row) in enumerate(zip(lengths, accuracy, strict=True)):
        y = top + cell * i
        body.append(f'<text x="{left - 6:.1f}" y="{y + cell / 2 + 4:.1f}" '
                    f'text-anchor="end">{length} tok</text>')
        for j, acc in enumerate(row):
            x = left + cell * j
            tip = f"{length} tokens, fact at {100 * depths[j]:.0f}%: exact match {acc:.2f}"
            body.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{cell:.1f}" height="{cell:.1f}" '
                        f'fill="{viridis(acc)}"><title>{tip}</title></rect>'
                        f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2 + 4:.1f}" '
                        f'text-anchor="middle" class="cell-label">{acc:.2f}</text>')
    body.append(f'<text x="{left}" y="{height - 10:.1f}">exact match: 0 (dark) to 1 '
                "(bright)</text>")
    return _svg(width, height, body, css_class="figure needle",
                label=f"needle in a haystack, {title}: exact match by length and depth")


def benchmarks_view(result: RunResult) -> dict | None:
    """The section's content, or None when the run ran no task and no needle test."""
    needle = result.needle
    if not result.tasks and needle is None:
        return None
    maps = []
    if needle is not None:
        for side, grid in (("before", needle.before), ("after", needle.after)):
            if grid is not None:
                maps.append((side, grid.mean, needle_heatmap(
                    grid.lengths, grid.depths, grid.accuracy, title=f"{side} pruning")))
    trials = next((g.trials for g in (needle.before, needle.after) if g), None) if needle \
        else None
    return {"tasks": task_rows(result), "lm_eval": result.versions.get("lm_eval"),
            "needle": maps, "needle_trials": trials,
            "needle_filler": next((g.filler for g in (needle.before, needle.after) if g), None)
            if needle else None}
