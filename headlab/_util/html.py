"""Layers x heads maps as self-contained HTML tables: the notebook views (`_repr_html_`)
of `HeadScores`, logit attribution and activation patching."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

# a present head's cell: (layer, head, value) -> (CSS background, hover title, text)
Cell = Callable[[int, int, float], tuple[str, str, str]]


def head_map(grid: Sequence[Sequence[float]], cell: Cell, *, caption: str,
             absent: str = "") -> str:
    """``grid`` [layer][head] as a table under ``caption`` (HTML, escaped by the caller);
    a NaN head is absent: a grey dot, with ``absent`` as its title where given."""
    title = f' title="{absent}"' if absent else ""
    rows = []
    for layer, row in enumerate(grid):
        cells = []
        for head, v in enumerate(row):
            if math.isnan(v):
                cells.append(f'<td style="background:#eee"{title}>·</td>')
                continue
            background, hover, text = cell(layer, head, v)
            cells.append(f'<td style="background:{background}" title="{hover}">{text}</td>')
        rows.append(f"<tr><th>L{layer}</th>{''.join(cells)}</tr>")
    header = "".join(f"<th>H{h}</th>" for h in range(max(len(r) for r in grid)))
    return (f'<div>{caption}<table style="font-size:11px;border-collapse:collapse"><tr>'
            f"<th></th>{header}</tr>{''.join(rows)}</table></div>")


def signed_colour(v: float, bound: float) -> str:
    """Red for a positive value, blue for a negative one, as opaque as |v| / bound."""
    rgb = "200,60,30" if v > 0 else "30,90,200"
    return f"rgba({rgb},{min(abs(v) / bound, 1.0):.2f})"
