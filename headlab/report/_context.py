"""Turn a `RunResult` into what the template shows.

A figure the run did not measure is None in the result, and the template shows it as
"not measured". `RunResult.from_json` has already turned absent or malformed parts of a
results.json into None, so the readers below only decide how each figure reads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from markupsafe import Markup

from headlab._util.units import human_bytes, human_ms
from headlab.importance import gates
from headlab.objectives import OBJECTIVES, Objective
from headlab.results import RunResult

from . import _figures
from ._encoding import decode_attention

NOT_MEASURED = "not measured"

_FILE_LABELS = {"results": "results (JSON)", "importance_csv": "importance scores (CSV)",
                "model": "pruned model (directory)"}
_URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^[/\\]{2}")


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) \
        and math.isfinite(x) else None


def pruned_mask(result: RunResult) -> list[list[bool]] | None:
    """mask[layer][head] = True where the head was pruned; None for a score-only run.
    A layer absent from kept_heads kept no heads."""
    if result.kept_heads is None:
        return None
    return [[h not in set(result.kept_heads.get(layer, ())) for h in range(len(row))]
            for layer, row in enumerate(result.importance)]


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


def _objective(result: RunResult) -> Objective | None:
    """The objective of the run's kind of model; None for a kind this headlab lacks."""
    return OBJECTIVES.get(result.kind or "")


def summary_rows(result: RunResult) -> list[dict]:
    """Before -> after rows: quality on held-out data, heads, parameters, speed, memory.

    Rows that do not apply to the model's kind are left out: the loss where the metric
    compares with the unpruned model (its loss is the metric's complement, and the
    model as it came scores 0 up to rounding), the key/value cache where the model does
    not generate text (an encoder keeps no cache)."""
    q, lat = result.quality, result.latency_ms
    objective = _objective(result)
    lat_note = f"batch {lat.batch} x {lat.seq_len} tokens" if lat and lat.batch \
        and lat.seq_len else ""
    rows = [_row(f"{q.metric or 'quality'} (held-out)", q.before, q.after, _sig,
                 higher_is_better=q.higher_is_better)]
    if objective is None or not objective.needs_reference:
        rows.append(_row("loss (held-out)", q.loss_before, q.loss_after, _sig,
                         higher_is_better=False))
    rows += [
        _row("attention heads", result.heads_total,
             None if result.score_only else result.heads_kept, _count),
        _row("parameters", result.params.before, result.params.after, _params,
             higher_is_better=False),
        _row("latency", lat.before if lat else None, lat.after if lat else None, human_ms,
             higher_is_better=False, note=lat_note),
        *[_row(f"latency at {x.seq_len:,} tokens", x.before, x.after, human_ms,
               higher_is_better=False, note=f"batch {x.batch}; the FLOPs predict "
               f"{x.predicted_drop:.0%} less" if x.predicted_drop is not None else "")
          for x in (lat.by_length[1:] if lat else [])],
    ]
    if objective is None or objective.generates:
        rows += [_row("key/value cache per token", result.kv_cache_bytes_per_token.before,
                      result.kv_cache_bytes_per_token.after, human_bytes, higher_is_better=False),
                 *kv_cache_rows(result)]
    return rows


def kv_cache_rows(result: RunResult) -> list[dict]:
    """The cache at the evaluation and the maximum length, decoding speed per context,
    and the demoted heads (kv-group and demotion runs)."""
    kv = result.kv_cache
    if kv is None:
        return []
    rows = [_row(f"key/value cache per token at {n:,} tokens", *pair, human_bytes,
                 higher_is_better=False, note=note)
            for n, pair, note in ((kv.eval_length, kv.bytes_per_token_eval, "evaluation length"),
                                  (kv.max_length, kv.bytes_per_token_max, "model maximum"))
            if n]
    rows += [_row(f"decoding at {d.context:,} tokens of context", d.before, d.after,
                  lambda x: f"{x:,.1f} tokens/s", higher_is_better=True,
                  note=f"batch 1, greedy, median of {d.steps} steps") for d in kv.decode]
    if kv.demoted:
        n = sum(len(v) for v in kv.demoted.values())
        note = (f"sinks {kv.sinks} + window {kv.window}; chosen by {kv.selection}, "
                f"{kv.unit}")
        if kv.alphas:  # DuoAttention's: the importance map shows each group's
            alphas = [a for row in kv.alphas for a in row]
            note += f"; gate alphas {min(alphas):.2f} to {max(alphas):.2f}"
        rows.append(_row("demoted (streaming) heads", 0, n, _count, note=note))
        q = result.quality
        if kv.quality_removed is not None:
            rows.append(_row(f"{q.metric or 'quality'} with those groups removed instead",
                             q.before, kv.quality_removed, _sig,
                             higher_is_better=q.higher_is_better))
    return rows


def _sig_or_missing(v: Any) -> str:
    return _sig(v) if _num(v) is not None else NOT_MEASURED


def recovery_view(result: RunResult) -> dict | None:
    """What recovery did: the method and its options, held-out quality as it came, after
    pruning and after recovery side by side, and each layer's reconstruction error
    before and after the fit; None where no recovery ran."""
    rec = result.recovery
    if rec is None:
        return None
    q = result.quality
    options = ", ".join(f"{k} {_sig_or_missing(v) if isinstance(v, float) else v}"
                        for k, v in rec.options.items()) or "none"
    pruned_change, pruned_tone = _change(_num(q.before), _num(q.pruned), q.higher_is_better)
    after_change, after_tone = _change(_num(q.before), _num(q.after), q.higher_is_better)
    return {
        "method": rec.method, "options": options, "tokens": f"{rec.tokens:,}",
        "seconds": f"{rec.seconds:.1f} s", "metric": q.metric or "quality",
        "quality": [("as it came", _sig_or_missing(q.before), "", "neutral"),
                    ("pruned", _sig_or_missing(q.pruned), pruned_change, pruned_tone),
                    (f"pruned + {rec.method}", _sig_or_missing(q.after), after_change,
                     after_tone)],
        "layers": [(e.layer, _sig_or_missing(e.error_before), _sig_or_missing(e.error_after),
                    _sig_or_missing(e.mlp_error_before), _sig_or_missing(e.mlp_error_after))
                   for e in rec.layers],
        # the MLP's errors, where lsq refitted its down projection
        "mlp": any(e.mlp_error_before is not None for e in rec.layers),
        "notes": list(rec.notes),
    }


def per_layer_rows(result: RunResult) -> list[dict]:
    """Heads and key/value heads per layer, before and after, as space-separated counts."""
    rows = []
    objective = _objective(result)
    for counts, label in ((result.heads_per_layer, "heads per layer"),
                          (result.kv_heads_per_layer, "key/value heads per layer")):
        if counts.before is None and counts.after is None or (
                label.startswith("key") and objective is not None and not objective.generates):
            continue
        rows.append({"label": label, **{
            side: NOT_MEASURED if value is None else " ".join(str(n) for n in value)
            for side, value in (("before", counts.before), ("after", counts.after))}})
    return rows


def _pair(a: int | None, b: int | None) -> str | None:
    """"a / b" with thousands separators, '?' for a missing side; None when both are."""
    if a is None and b is None:
        return None
    return " / ".join("?" if n is None else f"{n:,}" for n in (a, b))


def run_facts(result: RunResult) -> dict[str, str]:
    """The header's key facts: what was run, on which data, with which settings."""
    data = result.data
    facts = [
        ("model", result.model),
        ("family / kind", " / ".join(x for x in (result.family, result.kind) if x)),
        ("method", result.method),
        ("schedule", result.schedule),
        ("keep", f"{result.keep:.0%} of heads" if result.keep is not None else None),
        ("data", data.spec),
        ("tokens (scoring / held-out)", _pair(data.scoring_tokens, data.heldout_tokens)),
        # rows: blocks of a language model's stream, or examples (sentences) of an encoder
        ("examples (scoring / held-out)", _pair(data.scoring_examples, data.heldout_examples)
         if data.scoring_examples is not None and data.heldout_examples is not None
         else None),
        ("sequence length", data.seq_len),
        ("importance normalisation", result.importance_normalisation
         or ("none" if result.importance else None)),
        ("status", result.status),
        ("created", result.created),
        ("versions", ", ".join(f"{k} {v}" for k, v in result.versions.items())),
    ]
    trained = gates.ended(result.scoring_details)
    if trained is not None:  # only where gates were trained
        facts.insert(facts.index(("schedule", result.schedule)) + 1, ("gate training", trained))
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


def _is_statistic(v: Any) -> bool:
    """A number (NaN included) or null: what a statistics record holds per column."""
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool))


def statistics_table(result: RunResult, mask: list[list[bool]] | None, *,
                     with_importance: bool = True) -> dict | None:
    """Columns and rows of the per-head statistics table, with importance (unless not
    ``with_importance``) and cluster (where the run clustered the heads).

    Each cell is (text, sort key); the sort key is a number, or "" when missing so the
    browser-side sort puts it last.
    """
    records = result.statistics
    if not records:
        return None
    # The columns are the records' own keys, in the order headlab.analysis writes them
    # (STAT_NAMES), so the report needs no copy of that list and shows any statistic a
    # later version adds. A null is a statistic that had no rows to average.
    # A column that is zero for every head says nothing about any of them ([CLS] and
    # [SEP] in a model without them, the next token under a causal mask): left out.
    stats = [c for c in dict.fromkeys(k for r in records for k, v in r.items()
                                      if k not in ("layer", "head") and _is_statistic(v))
             if any(_num(r.get(c)) for r in records)]
    clusters = result.clusters
    labels = clusters.labels if clusters else []
    names = clusters.names if clusters else {}
    importance = result.importance

    rows = []
    for i, r in enumerate(records):
        layer, head = r.get("layer"), r.get("head")
        imp = None
        if isinstance(layer, int) and isinstance(head, int) and layer < len(importance) \
                and head < len(importance[layer]):
            imp = _num(importance[layer][head])
        is_pruned = bool(mask and isinstance(layer, int) and isinstance(head, int)
                         and layer < len(mask) and head < len(mask[layer]) and mask[layer][head])
        cluster = names.get(labels[i], f"cluster {labels[i]}") if i < len(labels) else ""
        cells = [(str(layer), layer if isinstance(layer, int) else ""),
                 (str(head), head if isinstance(head, int) else "")]
        cells += [(f"{v:.3f}", v) if (v := _num(r.get(c))) is not None else ("", "")
                  for c in stats]
        if with_importance:
            cells.append((f"{imp:.3f}", imp) if imp is not None else ("", ""))
        if clusters is not None:
            cells.append((cluster, cluster))
        if mask is not None:
            cells.append(("pruned" if is_pruned else "kept", int(is_pruned)))
        rows.append({"cells": cells, "pruned": is_pruned})
    columns = ["layer", "head", *stats, *(["importance"] if with_importance else []),
               *(["cluster"] if clusters is not None else [])]
    columns += ["status"] if mask is not None else []
    return {"columns": columns, "rows": rows}


def file_links(result: RunResult) -> list[dict]:
    """Links to the run's files, relative to report.html; anything with a URL scheme
    (javascript:, http:) or a host is shown as text, never as a link."""
    links = []
    for key, path in result.files.items():
        if not path:
            continue
        safe = not _URL_SCHEME.match(path.strip())
        links.append({"label": _FILE_LABELS.get(key, key), "path": path,
                      "href": path if safe else None})
    return links


def sample_view(result: RunResult) -> tuple[dict | None, str]:
    """The attention sample for the browser, checked, plus a note when it is unusable.

    The weights stay in their base64 form: report.js decodes them.
    """
    sample = result.sample
    if sample is None:
        return None, NOT_MEASURED
    try:
        shape = decode_attention(sample.attention).shape  # (L, H, S, S)
    except (ValueError, KeyError, TypeError) as err:
        return None, f"attention sample unreadable: {err}"
    if len(shape) != 4 or shape[2] != shape[3]:
        return None, f"attention sample has shape {list(shape)}; expected [L, H, S, S]"
    if shape[2] != len(sample.tokens):
        return None, (f"attention sample covers {shape[2]} positions but the sample has "
                      f"{len(sample.tokens)} tokens; store the tokens the model saw")
    return {"tokens": sample.tokens, "text": sample.text,
            "attention": {"shape": list(shape), "data": sample.attention["data"]}}, ""


def run_curves(result: RunResult) -> dict[str, list[dict]]:
    """Method -> pruning curve (as dicts): the compared ``curves``, else the run's own."""
    curves = result.curves or ({result.method: result.curve} if result.curve else {})
    return {m: [p.to_json() for p in c] for m, c in curves.items()}


def figures(result: RunResult, mask: list[list[bool]] | None) -> dict[str, Markup]:
    """The static SVG figures (importance map, pruning curve, clusters, speed-up by
    length); an empty Markup where the data is missing."""
    q = result.quality
    run_fraction = None
    if not result.score_only and result.heads_total and result.heads_kept is not None:
        run_fraction = 1 - result.heads_kept / result.heads_total

    clusters = result.clusters
    heads = [(r.get("layer"), r.get("head")) for r in result.statistics]
    scatter = Markup("")
    if clusters is not None:
        heads += [("?", "?")] * (len(clusters.coords) - len(heads))
        pruned = {(layer, h) for layer, row in enumerate(mask or [])
                  for h, p in enumerate(row) if p}
        scatter = _figures.cluster_scatter(clusters.coords, clusters.labels,
                                           {str(k): v for k, v in clusters.names.items()},
                                           heads, pruned)
    return {
        "heatmap": _importance_heatmap(result, mask),
        "curve": _figures.curves_chart(run_curves(result), metric=q.metric or "quality",
                                       higher_is_better=q.higher_is_better,
                                       run_fraction=run_fraction),
        "clusters": scatter,
        "speedup": _figures.speedup_chart(
            [asdict(x) for x in result.latency_ms.by_length] if result.latency_ms else []),
    }


def _importance_heatmap(result: RunResult, mask: list[list[bool]] | None) -> Markup:
    """The scores that chose each removal where the run wrote them, else the first
    scoring; each pruned head's tooltip names the scoring that chose it."""
    quantity = f"{result.method} score"
    removal = result.removal_scores
    if removal is None or mask is None:
        return _figures.importance_heatmap(result.importance, mask, quantity=quantity)
    notes = [[f"chosen for removal by scoring {k}" if k is not None else ""
              for k in row] for row in removal.scoring]
    return _figures.importance_heatmap(removal.scores, mask, quantity=quantity, notes=notes)


def importance_caption(result: RunResult) -> str:
    """Which scores the importance map shows: it must say, since an iterative schedule
    re-scores the heads left and the first scoring did not choose the later removals."""
    how = result.method + (f", normalised {result.importance_normalisation}"
                           if result.importance_normalisation else "")
    if result.score_only:
        return f"Score of each head ({how}) on the unpruned model; brighter matters more."
    removal = result.removal_scores
    if removal is None:
        later = (" The iterative schedule re-scored the heads left after each step; those "
                 "scores, which chose the later removals, are not in this results.json."
                 if result.schedule == "iterative" else "")
        return (f"Score of each head ({how}) in the first scoring, of the unpruned model; "
                f"brighter matters more.{later}")
    if removal.scorings == 1:
        return (f"Score of each head ({how}) in the one scoring, of the unpruned model, "
                "that chose every removal; brighter matters more.")
    return (f"The scores that chose each removal ({how}): a pruned head shows its score in "
            f"the scoring that removed it (the iterative schedule ran {removal.scorings} "
            "scorings, the first on the unpruned model, each later one on the heads left), "
            f"a kept head its score in the last scoring ({removal.scorings - 1}). Scores of "
            "different scorings rate different models (the heads left then); brighter "
            "matters more.")


# a head counts as of a type from this detector score on (the scores are in [0, 1])
HEAD_TYPE_THRESHOLD = 0.5


def head_types_view(result: RunResult, mask: list[list[bool]] | None) -> list[dict]:
    """Per detector kind: its layers x heads map, its top heads, and the pruned heads
    that scored as that type (>= HEAD_TYPE_THRESHOLD)."""
    views = []
    for kind, grid in result.head_types.items():
        flat = [(layer, head, v) for layer, row in enumerate(grid) for head, v in enumerate(row)
                if _num(v) is not None]
        top = sorted(flat, key=lambda x: -x[2])[:5]
        pruned = [(layer, head, v) for layer, head, v in flat
                  if mask is not None and layer < len(mask) and head < len(mask[layer])
                  and mask[layer][head] and v >= HEAD_TYPE_THRESHOLD]
        views.append({
            "kind": kind,
            # detector scores lie in [0, 1]: one fixed scale, so maps compare by colour
            "heatmap": _figures.importance_heatmap(grid, mask, quantity=f"{kind} score",
                                                   scale=(0.0, 1.0)),
            "top": ", ".join(f"L{layer}H{head} {v:.2f}" for layer, head, v in top),
            "typed": sum(v >= HEAD_TYPE_THRESHOLD for _, _, v in flat),
            "pruned": ", ".join(f"L{layer}H{head} {v:.2f}" for layer, head, v in pruned),
        })
    return views
