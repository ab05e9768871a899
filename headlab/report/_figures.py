"""Static figures of the report as inline SVG strings: sharp at any zoom, a few KB each.

Each builder takes plain lists (already pulled out of results.json by _context) and
returns Markup, so Jinja inserts it as is; every piece of text from the results passes
through escape() first. Hover values are SVG <title> elements (native tooltips, no JS).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from markupsafe import Markup, escape

# Viridis at 5 stops: perceptually even, readable in grey and by colour-blind readers.
_VIRIDIS = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
# Tableau 10: categorical colours for methods and clusters.
_PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
           "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]
_MISSING = "#d9d9d9"
_FLOOR_METHOD, _FLOOR_COLOUR = "random", "#888888"


def _fmt(x: float) -> str:
    """Short number for labels and tooltips: 4 significant digits."""
    return f"{x:.4g}"


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def viridis(t: float) -> str:
    """Hex colour of t in [0, 1] on the viridis ramp (piecewise linear between stops)."""
    t = min(max(t, 0.0), 1.0) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    f = t - i
    rgb = (round(a + (b - a) * f) for a, b in zip(_VIRIDIS[i], _VIRIDIS[i + 1], strict=True))
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _svg(width: float, height: float, body: list[str], *, css_class: str, label: str) -> Markup:
    return Markup(
        f'<svg class="{css_class}" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
        f'height="{height:.0f}" role="img" aria-label="{escape(label)}" '
        f'xmlns="http://www.w3.org/2000/svg">' + "".join(body) + "</svg>"
    )


def importance_heatmap(importance: Sequence[Sequence[float | None]],
                       pruned: Sequence[Sequence[bool]] | None, *, quantity: str,
                       scale: tuple[float, float] | None = None,
                       notes: Sequence[Sequence[str]] | None = None) -> Markup:
    """Layers (rows, layer 0 on top) x heads (columns), coloured by ``quantity``.

    Pruned heads carry a white cross; heads without a finite value are grey. The colour
    scale spans ``scale`` when given (a fixed range, the same on several maps), else the
    matrix's own min..max, and is drawn underneath with the quantity and its range.
    ``notes[layer][head]``, when given, is added to the cell's tooltip.
    """
    n_layers = len(importance)
    n_heads = max((len(row) for row in importance), default=0)
    values = [v for row in importance for v in row if _finite(v)]
    if scale is not None:
        lo, hi = scale
    else:
        lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    span = hi - lo or 1.0
    cell = max(10.0, min(34.0, 560.0 / max(n_heads, 1), 720.0 / max(n_layers, 1)))
    left, top = 54.0, 30.0
    width = left + cell * n_heads + 12
    grid_bottom = top + cell * n_layers
    height = grid_bottom + 62

    body = [f'<text x="{left + cell * n_heads / 2:.1f}" y="11" class="axis-title" '
            'text-anchor="middle">head</text>']
    label_every = 1 if cell >= 16 else 2
    for h in range(0, n_heads, label_every):
        body.append(f'<text x="{left + cell * (h + 0.5):.1f}" y="{top - 5:.1f}" '
                    f'text-anchor="middle">{h}</text>')
    for layer, row in enumerate(importance):
        y = top + cell * layer
        if layer % label_every == 0:
            body.append(f'<text x="{left - 6:.1f}" y="{y + cell / 2 + 4:.1f}" '
                        f'text-anchor="end">layer {layer}</text>')
        for head, v in enumerate(row):
            x = left + cell * head
            is_pruned = bool(pruned and layer < len(pruned) and head < len(pruned[layer])
                             and pruned[layer][head])
            fill = viridis((v - lo) / span) if _finite(v) else _MISSING
            value = _fmt(v) if _finite(v) else "not scored"
            tip = f"layer {layer}, head {head}: {quantity} {value}"
            tip += " (pruned)" if is_pruned else ""
            if notes and layer < len(notes) and head < len(notes[layer]) and notes[layer][head]:
                tip += f"; {notes[layer][head]}"
            body.append(f'<g class="cell" data-layer="{layer}" data-head="{head}">'
                        f'<rect x="{x:.1f}" y="{y:.1f}" width="{cell:.1f}" height="{cell:.1f}" '
                        f'fill="{fill}"><title>{escape(tip)}</title></rect>')
            if is_pruned:
                body.append(_cross(x, y, cell))
            body.append("</g>")

    # Colour bar with the scale's ends and what it measures, then the pruned-head key.
    bar_y, bar_w = grid_bottom + 14, max(160.0, min(220.0, cell * n_heads))
    body.append('<defs><linearGradient id="importance-ramp">' + "".join(
        f'<stop offset="{i / 4:.2f}" stop-color="{viridis(i / 4)}"/>' for i in range(5)
    ) + "</linearGradient></defs>")
    body.append(f'<rect x="{left}" y="{bar_y}" width="{bar_w:.1f}" height="10" '
                'fill="url(#importance-ramp)"/>')
    body.append(f'<text x="{left}" y="{bar_y + 24}">{_fmt(lo)}</text>')
    body.append(f'<text x="{left + bar_w:.1f}" y="{bar_y + 24}" text-anchor="end">'
                f"{_fmt(hi)}</text>")
    extent = "fixed scale" if scale is not None else "this map's range"
    title = f"{quantity}, {_fmt(lo)} to {_fmt(hi)} ({extent})"
    body.append(f'<text x="{left}" y="{bar_y + 38}" class="axis-title scale-title">'
                f"{escape(title)}</text>")
    width = max(width, left + 7 * len(title))
    if pruned:
        kx = left + bar_w + 24
        body.append(f'<rect x="{kx}" y="{bar_y - 2}" width="14" height="14" '
                    f'fill="{viridis(0.5)}"/>' + _cross(kx, bar_y - 2, 14))
        body.append(f'<text x="{kx + 20}" y="{bar_y + 9}">pruned</text>')
        width = max(width, kx + 80)
    return _svg(width, height, body, css_class="figure heatmap",
                label=f"{quantity} of each head, layers by heads")


def _cross(x: float, y: float, size: float) -> str:
    """A white x with a dark halo, visible on every colour of the ramp."""
    a, b = size * 0.22, size * 0.78
    lines = (f'M{x + a:.1f} {y + a:.1f}L{x + b:.1f} {y + b:.1f}'
             f'M{x + b:.1f} {y + a:.1f}L{x + a:.1f} {y + b:.1f}')
    return (f'<path d="{lines}" class="cross-halo"/>'
            f'<path d="{lines}" class="cross"/>')


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks per decade for a log axis, from the tick at or below lo to the one at
    or above hi, so both ends of the data sit on a labelled line."""
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)) - 1,
                                          math.ceil(math.log10(hi)) + 1) for m in (1, 2, 5)]
    first = max(t for t in ticks if t <= lo * (1 + 1e-9))
    last = min(t for t in ticks if t >= hi * (1 - 1e-9))
    return [t for t in ticks if first <= t <= last]


def curves_chart(curves: dict[str, Sequence[dict]], *, metric: str,
                 higher_is_better: bool | None, run_fraction: float | None) -> Markup:
    """Quality against fraction of heads pruned, one line per method.

    The `random` method is drawn grey and dashed as the floor to beat. The y axis turns
    logarithmic when quality spans more than 20x (perplexity explodes near 100% pruned).
    run_fraction, when given, draws a dashed marker at this run's fraction pruned.
    """
    series = {}
    for name, records in curves.items():
        pts = sorted(((r["fraction_pruned"], r["quality"], r.get("heads_kept"))
                      for r in records or [] if isinstance(r, dict)
                      and _finite(r.get("fraction_pruned")) and _finite(r.get("quality"))),
                     key=lambda p: p[0])
        if pts:
            series[name] = pts
    ys = [p[1] for pts in series.values() for p in pts]
    if not ys:
        return Markup("")
    y_lo, y_hi = min(ys), max(ys)
    log = y_lo > 0 and y_hi / y_lo > 20
    if log:
        y_ticks = _log_ticks(y_lo, y_hi)
        y_lo, y_hi = min(y_lo, y_ticks[0]), max(y_hi, y_ticks[-1])
    else:
        pad = (y_hi - y_lo) * 0.08 or abs(y_hi) * 0.05 or 1.0
        y_ticks = _nice_ticks(y_lo - pad, y_hi + pad)
        y_lo, y_hi = min(y_lo - pad, y_ticks[0]), max(y_hi + pad, y_ticks[-1])
    x_hi = max(1.0, max(p[0] for pts in series.values() for p in pts))

    width, height = 640.0, 360.0
    left, right, top, bottom = 64.0, 150.0, 16.0, 44.0
    pw, ph = width - left - right, height - top - bottom

    def sx(f: float) -> float:
        return left + pw * f / x_hi

    def sy(q: float) -> float:
        if log:
            t = (math.log(q) - math.log(y_lo)) / (math.log(y_hi) - math.log(y_lo))
        else:
            t = (q - y_lo) / ((y_hi - y_lo) or 1.0)
        return top + ph * (1 - t)

    body = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot-bg"/>']
    for f in _nice_ticks(0.0, x_hi):
        body.append(f'<line x1="{sx(f):.1f}" x2="{sx(f):.1f}" y1="{top}" y2="{top + ph}" '
                    'class="grid"/>'
                    f'<text x="{sx(f):.1f}" y="{top + ph + 16}" text-anchor="middle">'
                    f"{f * 100:.0f}%</text>")
    for q in y_ticks:
        body.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(q):.1f}" y2="{sy(q):.1f}" '
                    'class="grid"/>'
                    f'<text x="{left - 6}" y="{sy(q) + 4:.1f}" text-anchor="end">'
                    f"{_fmt(q)}</text>")
    direction = {True: " (higher is better)", False: " (lower is better)"}.get(higher_is_better,
                                                                              "")
    y_title = f"{metric}{direction}{', log scale' if log else ''}"
    body.append(f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" '
                'class="axis-title">fraction of heads pruned</text>'
                f'<text transform="translate(14 {top + ph / 2}) rotate(-90)" '
                f'text-anchor="middle" class="axis-title">{escape(y_title)}</text>')
    if run_fraction is not None and _finite(run_fraction):
        x = sx(run_fraction)
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" '
                    'class="run-marker"/>'
                    f'<text x="{x + 4:.1f}" y="{top + 12}" class="run-label">this run</text>')

    methods = [name for name in series if name != _FLOOR_METHOD]
    for i, (name, pts) in enumerate(series.items()):
        floor = name == _FLOOR_METHOD
        colour = _FLOOR_COLOUR if floor else _PALETTE[methods.index(name) % len(_PALETTE)]
        label = escape(name)
        path = _path([(sx(f), sy(q)) for f, q, _ in pts])
        body.append(f'<g class="series" data-method="{label}">'
                    f'<path d="{path}" stroke="{colour}" class="line'
                    f'{" floor" if floor else ""}"/>')
        for f, q, kept in pts:
            heads = f", {kept} heads kept" if kept is not None else ""
            body.append(f'<circle cx="{sx(f):.1f}" cy="{sy(q):.1f}" r="3" fill="{colour}">'
                        f"<title>{label}: {f * 100:.1f}% pruned{escape(heads)}, "
                        f"{escape(metric)} {_fmt(q)}</title></circle>")
        body.append(_legend(i, label, colour, " floor" if floor else "", x=left + pw, top=top)
                    + "</g>")
    return _svg(width, height, body, css_class="figure curve",
                label=f"{metric} against fraction of heads pruned")


def _path(points: Sequence[tuple[float, float]]) -> str:
    """An SVG path through ``points`` (x, y) in order."""
    return "".join(f"{'M' if j == 0 else 'L'}{x:.1f} {y:.1f}" for j, (x, y) in enumerate(points))


def _legend(i: int, label: str, colour: str, css: str, *, x: float, top: float) -> str:
    """The i-th legend entry right of a plot ending at ``x``: a line of the series'
    colour and class (``css``: "" or " floor") and its (escaped) label."""
    y = top + 8 + 18 * i
    return (f'<line x1="{x + 14}" x2="{x + 38}" y1="{y}" y2="{y}" stroke="{colour}" '
            f'class="line{css}"/><text x="{x + 44}" y="{y + 4}">{label}</text>')


def speedup_chart(points: Sequence[dict]) -> Markup:
    """Speed-up (latency before / after pruning) against sequence length, log-2 x axis,
    one point per length measured; the FLOP-predicted speed-up, 1 / (1 - predicted
    drop), beside it (grey, dashed) where the points carry it. ``points``: dicts with
    ``seq_len``, ``batch``, ``before``, ``after`` (ms) and ``predicted_drop``."""
    measured, predicted = [], []
    for p in points:
        n, before, after = p.get("seq_len"), p.get("before"), p.get("after")
        if not (_finite(n) and n > 0 and _finite(before) and _finite(after) and after > 0):
            continue
        measured.append((n, before / after, p.get("batch"), before, after))
        drop = p.get("predicted_drop")
        if _finite(drop) and drop < 1:
            predicted.append((n, 1 / (1 - drop), p.get("batch"), None, None))
    if not measured:
        return Markup("")
    series = [("measured", _PALETTE[0], "", sorted(measured))]
    if predicted:
        series.append(("FLOP-predicted", _FLOOR_COLOUR, " floor", sorted(predicted)))
    lengths = sorted({p[0] for _, _, _, pts in series for p in pts})
    ys = [p[1] for _, _, _, pts in series for p in pts] + [1.0]  # 1.0: no change
    pad = (max(ys) - min(ys)) * 0.08 or 0.05
    y_ticks = _nice_ticks(min(ys) - pad, max(ys) + pad)
    y_lo, y_hi = min(min(ys) - pad, y_ticks[0]), max(max(ys) + pad, y_ticks[-1])
    x_lo, x_hi = math.log2(lengths[0]), math.log2(lengths[-1])
    width, height = 560.0, 320.0
    left, right, top, bottom = 64.0, 150.0, 16.0, 44.0
    pw, ph = width - left - right, height - top - bottom

    def sx(n: float) -> float:  # the ends inset from the frame; a lone length in the middle
        t = (math.log2(n) - x_lo) / (x_hi - x_lo) if x_hi > x_lo else 0.5
        return left + pw * (0.06 + 0.88 * t)

    def sy(v: float) -> float:
        return top + ph * (1 - (v - y_lo) / ((y_hi - y_lo) or 1.0))

    body = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot-bg"/>']
    for n in lengths:
        body.append(f'<line x1="{sx(n):.1f}" x2="{sx(n):.1f}" y1="{top}" y2="{top + ph}" '
                    f'class="grid"/><text x="{sx(n):.1f}" y="{top + ph + 16}" '
                    f'text-anchor="middle">{n:,}</text>')
    for v in y_ticks:
        body.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" '
                    f'class="grid"/><text x="{left - 6}" y="{sy(v) + 4:.1f}" '
                    f'text-anchor="end">{_fmt(v)}x</text>')
    body.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(1.0):.1f}" y2="{sy(1.0):.1f}" '
                'class="baseline"/>'
                f'<text x="{left + pw / 2}" y="{height - 6}" text-anchor="middle" '
                'class="axis-title">sequence length (tokens, log scale)</text>'
                f'<text transform="translate(14 {top + ph / 2}) rotate(-90)" '
                'text-anchor="middle" class="axis-title">speed-up (latency before / after, '
                'x)</text>')
    for i, (name, colour, floor, pts) in enumerate(series):
        path = _path([(sx(n), sy(v)) for n, v, *_ in pts])
        body.append(f'<g class="series" data-series="{name}"><path d="{path}" '
                    f'stroke="{colour}" class="line{floor}"/>')
        for n, v, batch, before, after in pts:
            times = f" ({_fmt(before)} ms -> {_fmt(after)} ms)" if before is not None else ""
            body.append(f'<circle cx="{sx(n):.1f}" cy="{sy(v):.1f}" r="3" fill="{colour}" '
                        f'class="point"><title>{name} speed-up at {n:,} tokens, batch '
                        f"{batch}: {_fmt(v)}x{escape(times)}</title></circle>")
        body.append(_legend(i, name, colour, floor, x=left + pw, top=top) + "</g>")
    return _svg(width, height, body, css_class="figure speedup",
                label="speed-up of the pruned model against sequence length")


def cluster_scatter(coords: Sequence[Sequence[float]], labels: Sequence[int],
                    names: dict[str, str], heads: Sequence[tuple[int, int]],
                    pruned: set[tuple[int, int]]) -> Markup:
    """Heads as points in the 2-D embedding, coloured by cluster, legend with names.

    heads[i] is the (layer, head) of coords[i]; pruned heads are drawn as rings.
    """
    pts = [(c[0], c[1], lab, lh) for c, lab, lh in zip(coords, labels, heads, strict=False)
           if len(c) >= 2 and _finite(c[0]) and _finite(c[1])]
    if not pts:
        return Markup("")
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x_lo, x_hi, y_lo, y_hi = min(xs), max(xs), min(ys), max(ys)
    width, height, pad, legend_w = 640.0, 400.0, 16.0, 210.0
    pw, ph = width - legend_w - 2 * pad, height - 2 * pad

    def sx(x: float) -> float:
        return pad + pw * ((x - x_lo) / ((x_hi - x_lo) or 1.0))

    def sy(y: float) -> float:
        return pad + ph * (1 - (y - y_lo) / ((y_hi - y_lo) or 1.0))

    cluster_ids = sorted({p[2] for p in pts})
    colour = {c: _PALETTE[i % len(_PALETTE)] for i, c in enumerate(cluster_ids)}
    body = [f'<rect x="0" y="0" width="{pw + 2 * pad}" height="{height}" class="plot-bg"/>']
    for x, y, lab, (layer, head) in pts:
        name = names.get(str(lab), f"cluster {lab}")
        is_pruned = (layer, head) in pruned
        style = f'fill="none" stroke="{colour[lab]}"' if is_pruned else f'fill="{colour[lab]}"'
        body.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" {style} class="point">'
                    f"<title>layer {layer}, head {head}: {escape(name)}"
                    f'{" (pruned)" if is_pruned else ""}</title></circle>')
    lx = pw + 2 * pad + 12
    for i, c in enumerate(cluster_ids):
        n = sum(1 for p in pts if p[2] == c)
        name = names.get(str(c), f"cluster {c}")
        y = pad + 10 + 20 * i
        body.append(f'<circle cx="{lx + 6}" cy="{y}" r="5" fill="{colour[c]}"/>'
                    f'<text x="{lx + 16}" y="{y + 4}">{escape(name)} ({n})</text>')
    if pruned:
        y = pad + 10 + 20 * len(cluster_ids) + 8
        body.append(f'<circle cx="{lx + 6}" cy="{y}" r="5" fill="none" stroke="#555"/>'
                    f'<text x="{lx + 16}" y="{y + 4}">ring: pruned head</text>')
    return _svg(width, height, body, css_class="figure clusters",
                label="heads in two dimensions, coloured by cluster")
