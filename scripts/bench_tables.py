"""Write docs/benchmarks.md's tables from reports/bench/*.json, between the markers
``<!-- bench:start -->`` and ``<!-- bench:end -->``: one table per benchmark, under a
line that says where and when the JSON was measured; the README's trade-off table
(``bench recovery``'s) between ``<!-- tradeoff:start -->`` and ``<!-- tradeoff:end -->``;
docs/kv-cache.md's long-context tables (``bench generate``'s) between
``<!-- kvcache:start -->`` and ``<!-- kvcache:end -->``; and docs/prune-and-repair.md's
table of importance methods (``bench quality``'s grids) between
``<!-- methods:start -->`` and ``<!-- methods:end -->``, and its table of gate trainings
and of the default's candidates over seeds (scripts/schedule_study.py's committed
``reports/bench/schedule-study/*.json``, written by `study_tables`).
Nothing in them is typed by hand.

    python scripts/bench_tables.py            # rewrite the tables
    python scripts/bench_tables.py --check    # exit 1 if they are stale

tests/test_docs.py fails while the page and the committed JSONs disagree.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from generated_block import update  # noqa: E402
from study_tables import (  # noqa: E402
    DEFAULT_MARKERS,
    GATES_MARKERS,
    render_default_study,
    render_gates_study,
)

from headlab._util.units import human_bytes  # noqa: E402
from headlab.bench._common import against  # noqa: E402
from headlab.runs.config import DEFAULT_METHOD  # noqa: E402

MARKERS = ("<!-- bench:start -->", "<!-- bench:end -->")
TRADEOFF_MARKERS = ("<!-- tradeoff:start -->", "<!-- tradeoff:end -->")
KV_MARKERS = ("<!-- kvcache:start -->", "<!-- kvcache:end -->")
METHOD_MARKERS = ("<!-- methods:start -->", "<!-- methods:end -->")
# bench quality's rows in docs/prune-and-repair.md's table of methods, as its columns name them
METHOD_COLUMNS = {m: name + (" (default)" if m == DEFAULT_METHOD else "") for m, name in {
    "michel_unnormalised": "michel `--no-normalize`", "michel": "michel", "taylor": "taylor",
    "gates": "gates", "flap": "flap", "random": "random, 3 seeds"}.items()}
# the scores that gate heads (the count table's rows), as `--method` names them
GATE_BASED = {"taylor": "`taylor`", "gates": "`gates`",
              "michel_unnormalised": "`michel --no-normalize`", "michel": "`michel`"}


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _setting(d: dict) -> str:
    """Where and when: the machine, threads, device, preset, versions and load."""
    m, v = d.get("machine", {}), d.get("versions", {})
    load = m.get("load_average") or []
    after = m.get("load_average_after") or []
    parts = [
        f"{d.get('date', 'undated')}",
        f"{m.get('cpu', 'unknown CPU')}, {m.get('cores_available', m.get('cores'))} cores, "
        f"{m.get('torch_threads')} torch threads"
        + (f", OMP_WAIT_POLICY={m['omp_wait_policy']}" if m.get("omp_wait_policy") else ""),
        f"device {d.get('device', m.get('device'))}" + (f" ({m['gpu']})" if m.get("gpu") else ""),
        f"`{d.get('preset')}` preset, {d.get('elapsed_s')} s",
        f"headlab {v.get('headlab')}, torch {v.get('torch')}, "
        f"transformers {v.get('transformers')}, Python {v.get('python')}",
    ]
    kept = (d.get("checks") or {}).get("parts") or {}
    if kept:  # a run resumed with --resume: its parts' own dates and seconds
        dates = sorted(p["date"] for p in kept.values())
        parts.append(f"measured in {len(kept)} parts from {dates[0]} to {dates[-1]}, "
                     f"{sum(p['seconds'] for p in kept.values()):.0f} s in all")
    if load:
        parts.append(f"1-minute load average {load[0]} before"
                     + (f", {after[0]} after" if after else ""))
    if m.get("others_load") is not None:  # the load average counts the run's own threads
        parts.append(f"other processes used {m['others_load']:.1f} cores on average")
    return "; ".join(parts)


def table(d: dict) -> str:
    """One benchmark's targets and headline ratios, as `headlab bench` prints them."""
    name = d["benchmark"]
    rows = [f"### {name}", "", _setting(d), "",
            "| measure | median | q1–q3 | target | meets |", "|---|---|---|---|---|"]
    if d.get("error"):
        rows.append(f"| NOT MEASURED: {_cell(d['error'])} | | | | **error** |")
    for t in d.get("targets", []):
        rows.append(f"| {_cell(t['what'])} | {against(t['ratio'], t['target'])} | "
                    f"{_num(t['q1'])}–{_num(t['q3'])} | {t['op']} {t['target']:g} | "
                    f"{'yes' if t['meets'] else '**no**'} |")
    for i in d.get("info", []):
        f = d["figures"][i["figure"]]
        rows.append(f"| {_cell(i['what'])} | {_num(f['median'])} | "
                    f"{_num(f['q1'])}–{_num(f['q3'])} | — | — |")
    grids = [(k.removesuffix(".grid"), g) for k, g in d.get("checks", {}).items()
             if k.endswith(".grid")]
    tradeoff = _tradeoff(d.get("checks", {}).get("tradeoff") or [])
    return "\n\n".join(["\n".join(rows), *(grid(model, g) for model, g in grids),
                        *(["\n".join(tradeoff)] if tradeoff else [])])


def grid(model: str, g: dict) -> str:
    """bench quality's held-out quality by method and repair (rows) at each keep
    (columns): the checks' ``<model>.grid``."""
    keeps = " | ".join(f"keep {k:g} ({n} heads)" for k, n in zip(g["keeps"], g["heads_kept"],
                                                                   strict=True))
    rows = [f"{model}: held-out {g['metric']} by the heads each method chose, before "
            f"pruning {_num(g['before'])} ({g['total_heads']} heads)", "",
            f"| method | repair | {keeps} |", "|---|---|" + "---|" * len(g["keeps"])]
    for r in g["rows"]:
        name = (f"{r['method']} (mean of {len(r['samples'][0])} seeds)"
                if len(r.get("samples", [[]])[0]) > 1 else r["method"])
        rows.append(f"| {_cell(name)} | {r['repair']} | "
                    + " | ".join(_num(v) for v in r["quality"]) + " |")
    return "\n".join(rows)


def _kib(n: float | None) -> str:
    return "no cache" if n is None else f"{n / 1024:.1f} KiB"


def _tradeoff(lines: list[dict]) -> list[str]:
    """The recovery benchmark's trade-off table: per model and size, what is kept, what
    it costs in quality (no repair, then the repair) and what it saves."""
    if not lines:
        return []
    rows = ["Quality with no repair and after the default repair (lsq); latency: the "
            "repaired model's median forward, batch 1, against the unpruned model's in the "
            "same interleaved rounds.", "",
            "| model | keep | query heads | parameters | KV cache / token | quality, "
            "no repair | quality, repaired | latency: this / unpruned |", "|---" * 8 + "|"]
    for r in lines:
        latency = ("n/a" if r["latency_ms"] is None
                   else f"{r['latency_ms']:.0f} ms at {r['latency_tokens']} tokens"
                   if r["latency_before_ms"] is None
                   else f"{r['latency_ms']:.0f} / {r['latency_before_ms']:.0f} ms at "
                        f"{r['latency_tokens']} tokens")
        rows.append(f"| {r['model']} | {r['keep']:g} | {r['heads']} | "
                    f"{r['params'] / 1e6:.1f} M | {_kib(r['kv_bytes_per_token'])} | "
                    f"{r['metric']} "
                    f"{_num(r['pruned'])} | {_num(r['repaired'])} | {latency} |")
    return rows


def render(paths: list[Path]) -> str:
    """The block between the markers (markers included) for these JSON files."""
    docs = [json.loads(Path(p).read_text()) for p in sorted(paths, key=lambda p: Path(p).name)]
    body = "\n\n".join(table(d) for d in docs) if docs else "No benchmark JSON committed."
    return f"{MARKERS[0]}\n{body}\n{MARKERS[1]}"


def _block(paths: list[Path], name: str, rows_of: Callable[[dict], list[str]],
           markers: tuple[str, str], missing: str) -> str:
    """A page's block (markers included): the rows ``rows_of`` reads from the JSON called
    ``name`` among ``paths``, under the line that says where and when it was measured;
    ``missing`` where there is no such JSON or it has no rows."""
    found = [json.loads(Path(p).read_text()) for p in paths if Path(p).name == name]
    rows = rows_of(found[0]) if found else []
    body = f"{_setting(found[0])}\n\n" + "\n".join(rows) if rows else missing
    return f"{markers[0]}\n{body}\n{markers[1]}"


def render_tradeoff(paths: list[Path]) -> str:
    """The README's block: recovery.json's trade-off table."""
    return _block(paths, "recovery.json",
                  lambda d: _tradeoff(d.get("checks", {}).get("tradeoff") or []),
                  TRADEOFF_MARKERS, "No trade-off measured (`headlab bench recovery` writes it).")


def _median(d: dict, figure: str) -> float | None:
    f = d["figures"].get(figure)
    return None if f is None else f["median"]


def _x(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _meets(d: dict, figure: str) -> str:
    """", target <= 0.5: yes" for a judged figure, "" for one only reported."""
    for t in d.get("targets", []):
        if t["figure"] == figure:
            return f", target {t['op']} {t['target']:g}: {'yes' if t['meets'] else '**no**'}"
    return ""


_KV_NAMES = {"before": "as it came", "pruned": "michel's groups removed",
             "demoted": "michel's groups demoted"}
_CHOOSERS = {"retrieval": "the retrieval detector's", "gates": "DuoAttention's gates'"}


def _kv_name(d: dict, name: str) -> str:
    """A long-context model in words; a chooser's with the seconds it took to choose."""
    if name in _KV_NAMES:
        return _KV_NAMES[name]
    by = name.removeprefix("demoted_by_")
    seconds = (d["checks"].get("long_choosers") or {}).get(by, {}).get("seconds")
    took = "" if seconds is None else f" (chosen in {seconds:.0f} s)"
    whose = _CHOOSERS.get(by, f"{by}'s")
    return f"{whose} groups demoted{took}"


def _kv_cache(d: dict) -> list[str]:
    """bench generate's long-context figures: per context the cache and the decoding
    speed after kv-group pruning and demotion; the attention share's prediction; the
    serving headroom; and what each choice of demoted groups costs in quality."""
    figures, checks = d["figures"], d["checks"]
    contexts = sorted(int(k.rsplit("_", 1)[1]) for k in figures
                      if k.startswith("long_before_tokens_per_s_at_"))
    if not contexts:
        return []
    rows = ["| context | cache as it came | cache kept: removed | demoted | decode tokens/s "
            "as it came | speed-up: removed | demoted |", "|---" * 7 + "|"]
    for c in contexts:
        ratio = checks[f"long_cache_ratio_at_{c}"]
        rows.append(f"| {c} | {human_bytes(_median(d, f'long_before_cache_bytes_at_{c}'))} | "
                    f"{ratio['pruned']:.2f}x | {ratio['demoted']:.2f}x | "
                    f"{_x(_median(d, f'long_before_tokens_per_s_at_{c}'), 1)} | "
                    f"{_x(_median(d, f'long_pruned_speedup_at_{c}'))}x | "
                    f"{_x(_median(d, f'long_demoted_speedup_at_{c}'))}x |")
    share, predicted = (checks["long_attention_share_at_longest"],
                        checks["long_predicted_demoted_speedup"])
    rows += ["", f"At {contexts[-1]} tokens attention takes {share:.0%} of a decoding step "
             f"of the model as it came, which predicts a {predicted:.2f}x speed-up from "
             f"demotion; measured: {_x(_median(d, 'long_demoted_speedup_over_predicted'))} "
             f"of the prediction{_meets(d, 'long_demoted_speedup_over_predicted')}."]
    rows[-1] += (" Removing the groups shrinks what a step reads (every weight once, the "
                 "whole cache) by a factor that predicts "
                 f"{checks['long_predicted_pruned_speedup']:.2f}x; measured: "
                 f"{_x(_median(d, 'long_pruned_speedup_over_predicted'))} of the "
                 f"prediction{_meets(d, 'long_pruned_speedup_over_predicted')}.")
    headroom = checks.get("long_headroom") or {}
    if headroom:
        budget = next(iter(headroom.values()))["budget"]
        rows += ["", f"Serving headroom in the cache budget of the model as it came at "
                 f"{headroom['before']['rows']} rows ({human_bytes(budget)}):", "",
                 "| model | rows that fit | cache held | tokens/s |", "|---|---|---|---|"]
        rows += [f"| {_kv_name(d, n)} | {h['rows']} | {human_bytes(h['held'])} | "
                 f"{_x(_median(d, f'long_{n}_headroom_tokens_per_s'), 1)} |"
                 for n, h in headroom.items()]
    ppl = checks.get("long_perplexity") or {}
    if ppl:
        rows += ["", "| model | held-out perplexity | lost / removal's | needle accuracy | "
                 "lost / removal's |", "|---|---|---|---|---|"]
        for n, value in ppl.items():
            name = _kv_name(d, n)
            lost = [f"{_x(_median(d, f'long_{what}_lost_{n}_over_removed'), 3)}"
                    f"{_meets(d, f'long_{what}_lost_{n}_over_removed')}"
                    if f"long_{what}_lost_{n}_over_removed" in figures else "-"
                    for what in ("quality", "needle")]
            rows.append(f"| {name} | {_num(value)} | {lost[0]} | "
                        f"{_x(_median(d, f'long_{n}_needle_accuracy'))} | {lost[1]} |")
    return rows


def _quality(x: float, metric: str) -> str:
    """A perplexity to a tenth (whole from 100), a fidelity to a thousandth."""
    if metric != "perplexity":
        return f"{x:.3f}"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _methods(d: dict) -> list[str]:
    """bench quality's grids as one table: per model and keep, each method's held-out
    quality pruned -> after lsq (FLAP's also after its bias), the best after lsq in bold."""
    grids = [(k.removesuffix(".grid"), g) for k, g in d.get("checks", {}).items()
             if k.endswith(".grid")]
    if not grids:
        return []
    rows = ["| model (as it came) | keep (heads) | " + " | ".join(METHOD_COLUMNS.values())
            + " |", "|---|---|" + "---|" * len(METHOD_COLUMNS)]
    for model, g in grids:
        q = {(r["method"], r["repair"]): r["quality"] for r in g["rows"]}
        metric = g["metric"]
        better = max if metric != "perplexity" else min
        for i, (keep, heads) in enumerate(zip(g["keeps"], g["heads_kept"], strict=True)):
            best = better(q[m, "lsq"][i] for m in METHOD_COLUMNS)
            cells = []
            for m in METHOD_COLUMNS:
                after = _quality(q[m, "lsq"][i], metric)
                after = f"**{after}**" if q[m, "lsq"][i] == best else after
                bias = f" (bias {_quality(q[m, 'bias'][i], metric)})" if (m, "bias") in q else ""
                cells.append(f"{_quality(q[m, 'none'][i], metric)} → {after}{bias}")
            rows.append(f"| {model} ({metric} {_quality(g['before'], metric)}) | "
                        f"{keep:g} ({heads}) | " + " | ".join(cells) + " |")
    c = d.get("config", {})
    rows += ["", f"The gates were trained {c['gate_steps']} steps of {c['gate_batch']} "
             f"block{'' if c['gate_batch'] == 1 else 's'} at lr {c['gate_lr']} with the "
             f"`{c['gate_budget']}` budget."]
    return rows + ["", *_counts(grids)]


def _counts(grids: list[tuple[str, dict]]) -> list[str]:
    """What each gate-based score loses after lsq as a multiple of the least any of them
    loses in the same cell (model, keep): in how many cells it is the least, the
    geometric mean and the worst of the multiples, and its scoring seconds over michel's
    on each model (one scoring of the unpruned model)."""
    cells = [(model, keep, {m: next(r["lost"][i] for r in g["rows"]
                                    if (r["method"], r["repair"]) == (m, "lsq"))
                            for m in GATE_BASED})
             for model, g in grids for i, keep in enumerate(g["keeps"])]
    rows = [f"Counting what each gate-based score loses after `lsq` as a multiple of the "
            f"least any of them loses in the same cell ({len(cells)} cells: "
            f"{len(grids)} models, {len(grids[0][1]['keeps'])} keeps):", "",
            "| `--method` | least in | geometric mean | worst | scoring seconds / michel's ("
            + ", ".join(model for model, _ in grids) + ") |", "|---|---|---|---|---|"]
    for m, name in GATE_BASED.items():
        multiples = [(lost[m] / min(lost.values()), model, keep)
                     for model, keep, lost in cells]
        least = sum(x == 1.0 for x, _, _ in multiples)
        geo = math.exp(sum(math.log(x) for x, _, _ in multiples) / len(multiples))
        worst = max(multiples)
        seconds = ("michel's pass, unnormalised" if m not in grids[0][1]["seconds"] else
                   ", ".join(f"{g['seconds'][m] / g['seconds']['michel']:.1f}"
                             for _, g in grids))
        rows.append(f"| {name} | {least} of {len(cells)} | {geo:.2f}x | {worst[0]:.2f}x "
                    f"({worst[1]}, keep {worst[2]:g}) | {seconds} |")
    return rows


def render_methods(paths: list[Path]) -> str:
    """docs/prune-and-repair.md's block: quality.json's grids as one table of methods."""
    return _block(paths, "quality.json", _methods, METHOD_MARKERS,
                  "No methods compared (`headlab bench quality` writes them).")


def render_kv_cache(paths: list[Path]) -> str:
    """docs/kv-cache.md's block: generate.json's long-context tables."""
    return _block(paths, "generate.json", _kv_cache, KV_MARKERS,
                  "No long-context figures measured (`headlab bench generate` writes them).")


def current_block(text: str, markers: tuple[str, str] = MARKERS) -> str:
    """The block between the page's ``markers``, markers included."""
    start, end = (text.index(m) for m in markers)
    return text[start:end + len(markers[1])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", nargs="?", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("jsons", nargs="*", help="default: reports/bench/*.json")
    parser.add_argument("--readme", default=str(ROOT / "README.md"),
                        help="the page holding the trade-off table")
    parser.add_argument("--kv-cache", default=str(ROOT / "docs" / "kv-cache.md"),
                        help="the page holding the long-context tables")
    parser.add_argument("--methods", default=str(ROOT / "docs" / "prune-and-repair.md"),
                        help="the page holding the table of importance methods")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the tables are stale")
    args = parser.parse_intermixed_args(argv)
    page = Path(args.page)
    jsons = [Path(p) for p in args.jsons] or sorted((ROOT / "reports" / "bench").glob("*.json"))
    blocks = [(page, MARKERS, render, "benchmark tables"),
              (Path(args.readme), TRADEOFF_MARKERS, render_tradeoff, "trade-off table"),
              (Path(args.kv_cache), KV_MARKERS, render_kv_cache, "long-context tables"),
              (Path(args.methods), METHOD_MARKERS, render_methods, "table of methods"),
              (Path(args.methods), GATES_MARKERS, render_gates_study, "table of gate trainings"),
              (Path(args.methods), DEFAULT_MARKERS, render_default_study,
               "table of the default's candidates")]
    return max(update(path, lambda t, m=markers: current_block(t, m), rendered(jsons),
                      check=args.check, what=what, markers=" and ".join(markers),
                      script="scripts/bench_tables.py")
               for path, markers, rendered, what in blocks)

if __name__ == "__main__":
    sys.exit(main())
