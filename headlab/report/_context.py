"""Turn a results dict into what the template shows.

Only model, method, importance and heads_total are required; every other key may be
missing or null, and each reader below falls back to None, which the template shows
as "not measured". Nothing here raises on a partial or odd results file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from markupsafe import Markup

from . import _figures
from ._encoding import decode_attention

NOT_MEASURED = "not measured"

# Statistics columns in reading order; other numeric keys found in the records follow.
_STAT_COLUMNS = ["entropy", "first", "cls", "sep", "punct", "self", "prev", "next",
                 "confidence"]
_FILE_LABELS = {"results": "results (JSON)", "importance_csv": "importance scores (CSV)",
                "model": "pruned model (directory)"}
_URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^[/\\]{2}")


def get(d: Any, *keys: str) -> Any:
    """d[k1][k2]... or None where any level is missing, null or not a dict."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _dict(x: Any) -> dict:
    """x when it is a dict, else an empty one: a null or malformed section reads as absent."""
    return x if isinstance(x, dict) else {}


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) \
        and math.isfinite(x) else None


def pruned_mask(results: dict) -> list[list[bool]] | None:
    """mask[layer][head] = True where the head was pruned; None for a score-only run.

    kept_heads maps layer (a string in JSON) to the original indices kept; a layer
    absent from it kept no heads.
    """
    kept = results.get("kept_heads")
    if not isinstance(kept, dict):
        return None
    mask = []
    for layer, row in enumerate(results["importance"]):
        kept_here = kept.get(str(layer), kept.get(layer))
        kept_here = set(kept_here) if isinstance(kept_here, list) else set()
        mask.append([h not in kept_here for h in range(len(row))])
    return mask


def _change(before: float | None, after: float | None,
            higher_is_better: bool | None) -> tuple[str, str]:
    """Relative change text and a tone (good, bad or neutral) for the summary table. A
    change over 100 times its base (a fidelity loss that starts at rounding noise, 1e-8)
    reads as the absolute difference: a percentage of nothing says nothing."""
    if before is None or after is None or before == 0:
        return "", "neutral"
    rel = (after - before) / abs(before)
    if higher_is_better is None or abs(rel) < 5e-4:
        tone = "neutral"
    else:
        tone = "good" if (rel > 0) == higher_is_better else "bad"
    if abs(rel) > 100:
        return f"{after - before:+.4g}", tone
    return f"{rel * 100:+.1f}%", tone


def _row(label: str, before: Any, after: Any, fmt: Callable[[float], str], *,
         higher_is_better: bool | None = None, note: str = "") -> dict:
    """One summary line: both sides formatted, or "not measured", and the change."""
    b, a = _num(before), _num(after)
    change, tone = _change(b, a, higher_is_better)
    return {"label": label, "note": note, "change": change, "tone": tone,
            "before": fmt(b) if b is not None else NOT_MEASURED,
            "after": fmt(a) if a is not None else NOT_MEASURED}


def _sig(x: float) -> str:
    return f"{x:.4g}"


def _count(x: float) -> str:
    return f"{x:,.0f}"


def _params(x: float) -> str:
    return f"{x / 1e6:,.2f} M" if x >= 1e5 else _count(x)


def _ms(x: float) -> str:
    return f"{x:.1f} ms"


def _bytes(x: float) -> str:
    return f"{x / 1024:,.1f} KiB" if x >= 1024 else f"{x:,.0f} B"


def summary_rows(results: dict) -> list[dict]:
    """Before -> after rows: quality on held-out data, heads, parameters, speed, memory."""
    q = _dict(results.get("quality"))
    metric = q.get("metric") or "quality"
    hib = q.get("higher_is_better")
    heads_after = results.get("heads_kept") if results.get("kept_heads") else None
    lat = _dict(results.get("latency_ms"))
    lat_note = (f"batch {lat['batch']} x {lat['seq_len']} tokens"
                if lat.get("batch") and lat.get("seq_len") else "")
    return [
        _row(f"{metric} (held-out)", q.get("before"), q.get("after"), _sig,
             higher_is_better=hib),
        _row("loss (held-out)", q.get("loss_before"), q.get("loss_after"), _sig,
             higher_is_better=False),
        _row("attention heads", results.get("heads_total"), heads_after, _count),
        _row("parameters", get(results, "params", "before"), get(results, "params", "after"),
             _params, higher_is_better=False),
        _row("latency", lat.get("before"), lat.get("after"), _ms, higher_is_better=False,
             note=lat_note),
        _row("key/value cache per token", get(results, "kv_cache_bytes_per_token", "before"),
             get(results, "kv_cache_bytes_per_token", "after"), _bytes,
             higher_is_better=False),
    ]


def per_layer_rows(results: dict) -> list[dict]:
    """Heads and key/value heads per layer, before and after, as space-separated counts."""
    rows = []
    for key, label in (("heads_per_layer", "heads per layer"),
                       ("kv_heads_per_layer", "key/value heads per layer")):
        d = _dict(results.get(key))
        if d.get("before") is None and d.get("after") is None:
            continue
        rows.append({"label": label, **{
            side: " ".join(str(n) for n in d[side]) if isinstance(d.get(side), list)
            else NOT_MEASURED for side in ("before", "after")}})
    return rows


def run_facts(results: dict) -> dict[str, str]:
    """The header's key facts: what was run, on which data, with which settings."""
    data = _dict(results.get("data"))
    keep = _num(results.get("keep"))
    versions = _dict(results.get("versions"))
    facts = [
        ("model", results.get("model")),
        ("family / kind", " / ".join(str(x) for x in (results.get("family"),
                                                     results.get("kind")) if x)),
        ("method", results.get("method")),
        ("schedule", results.get("schedule")),
        ("keep", f"{keep:.0%} of heads" if keep is not None else None),
        ("data", data.get("spec")),
        ("tokens (scoring / held-out)", " / ".join(
            f"{data[k]:,}" if isinstance(data.get(k), int) else "?"
            for k in ("scoring_tokens", "heldout_tokens"))
            if data.get("scoring_tokens") or data.get("heldout_tokens") else None),
        # rows: blocks of a language model's stream, or examples (sentences) of an encoder
        ("examples (scoring / held-out)", " / ".join(
            f"{data[k]:,}" for k in ("scoring_examples", "heldout_examples"))
            if isinstance(data.get("scoring_examples"), int)
            and isinstance(data.get("heldout_examples"), int) else None),
        ("sequence length", data.get("seq_len")),
        ("importance normalisation", results.get("importance_normalisation")
         or ("none" if results.get("importance") else None)),
        ("status", results.get("status")),
        ("created", results.get("created")),
        ("versions", ", ".join(f"{k} {v}" for k, v in versions.items())),
    ]
    return {k: str(v) if v not in (None, "") else NOT_MEASURED for k, v in facts}


def config_rows(config: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Flatten the free-form run config to (dotted key, value text) pairs."""
    if not isinstance(config, dict):
        return []
    rows = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows += config_rows(value, f"{name}.")
        else:
            rows.append((name, "null" if value is None else str(value)))
    return rows


def statistics_table(results: dict, mask: list[list[bool]] | None) -> dict | None:
    """Columns and rows of the per-head statistics table, with importance and cluster.

    Each cell is (text, sort key); the sort key is a number, or "" when missing so the
    browser-side sort puts it last.
    """
    records = [r for r in results.get("statistics") or [] if isinstance(r, dict)]
    if not records:
        return None
    extra = [k for r in records for k, v in r.items()
             if k not in _STAT_COLUMNS and k not in ("layer", "head") and _num(v) is not None]
    stats = [c for c in _STAT_COLUMNS if any(c in r for r in records)]
    stats += list(dict.fromkeys(extra))
    clusters = _dict(results.get("clusters"))
    labels, names = clusters.get("labels") or [], _dict(clusters.get("names"))
    importance = results["importance"]

    rows = []
    for i, r in enumerate(records):
        layer, head = r.get("layer"), r.get("head")
        imp = None
        if isinstance(layer, int) and isinstance(head, int) and layer < len(importance) \
                and head < len(importance[layer]):
            imp = _num(importance[layer][head])
        is_pruned = bool(mask and isinstance(layer, int) and isinstance(head, int)
                         and layer < len(mask) and head < len(mask[layer]) and mask[layer][head])
        cluster = names.get(str(labels[i]), f"cluster {labels[i]}") if i < len(labels) else ""
        cells = [(str(layer), layer if isinstance(layer, int) else ""),
                 (str(head), head if isinstance(head, int) else "")]
        cells += [(f"{v:.3f}", v) if (v := _num(r.get(c))) is not None else ("", "")
                  for c in stats]
        cells.append((f"{imp:.3f}", imp) if imp is not None else ("", ""))
        cells.append((cluster, cluster))
        if mask is not None:
            cells.append(("pruned" if is_pruned else "kept", int(is_pruned)))
        rows.append({"cells": cells, "pruned": is_pruned})
    columns = ["layer", "head", *stats, "importance", "cluster"]
    columns += ["status"] if mask is not None else []
    return {"columns": columns, "rows": rows}


def file_links(results: dict) -> list[dict]:
    """Links to the run's files, relative to report.html; anything with a URL scheme
    (javascript:, http:) or a host is shown as text, never as a link."""
    files = results.get("files")
    if not isinstance(files, dict):
        return []
    links = []
    for key, path in files.items():
        if not isinstance(path, str) or not path:
            continue
        safe = not _URL_SCHEME.match(path.strip())
        links.append({"label": _FILE_LABELS.get(key, key), "path": path,
                      "href": path if safe else None})
    return links


def sample_view(results: dict) -> tuple[dict | None, str]:
    """The attention sample for the browser, checked, plus a note when it is unusable.

    The weights stay in their base64 form: report.js decodes them.
    """
    sample = results.get("sample")
    att = get(sample, "attention")
    tokens = get(sample, "tokens")
    if not isinstance(att, dict) or not isinstance(tokens, list):
        return None, NOT_MEASURED
    try:
        shape = decode_attention(att).shape  # (L, H, S, S)
    except (ValueError, KeyError, TypeError) as err:
        return None, f"attention sample unreadable: {err}"
    if len(shape) != 4 or shape[2] != shape[3]:
        return None, f"attention sample has shape {list(shape)}; expected [L, H, S, S]"
    if shape[2] != len(tokens):
        return None, (f"attention sample covers {shape[2]} positions but the sample has "
                      f"{len(tokens)} tokens; store the tokens the model saw")
    return {"tokens": [str(t) for t in tokens], "text": get(sample, "text"),
            "attention": {"shape": list(shape), "data": att["data"]}}, ""


def run_curves(results: dict) -> dict:
    """Method -> pruning curve: the compared ``curves``, else the run's own ``curve``."""
    curves = results.get("curves")
    if isinstance(curves, dict) and curves:
        return curves
    curve = results.get("curve")
    return {str(results.get("method")): curve} if isinstance(curve, list) else {}


def figures(results: dict, mask: list[list[bool]] | None) -> dict[str, Markup]:
    """The three static SVG figures; an empty Markup where the data is missing."""
    q = _dict(results.get("quality"))
    curves = run_curves(results)
    total, kept = _num(results.get("heads_total")), _num(results.get("heads_kept"))
    run_fraction = 1 - kept / total if results.get("kept_heads") and total and kept is not None \
        else None

    clusters = _dict(results.get("clusters"))
    records = [r for r in results.get("statistics") or [] if isinstance(r, dict)]
    heads = [(r.get("layer"), r.get("head")) for r in records]
    heads += [("?", "?")] * (len(clusters.get("coords") or []) - len(heads))
    pruned = {(layer, h) for layer, row in enumerate(mask or []) for h, p in enumerate(row) if p}
    scatter = Markup("")
    if isinstance(clusters.get("coords"), list) and isinstance(clusters.get("labels"), list):
        scatter = _figures.cluster_scatter(clusters["coords"], clusters["labels"],
                                           _dict(clusters.get("names")), heads, pruned)
    return {
        "heatmap": _figures.importance_heatmap(results["importance"], mask),
        "curve": _figures.curves_chart(curves, metric=q.get("metric") or "quality",
                                       higher_is_better=q.get("higher_is_better"),
                                       run_fraction=run_fraction),
        "clusters": scatter,
    }
