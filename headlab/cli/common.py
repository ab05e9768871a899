"""What every `headlab` command shares: the typer app, logging set-up, and the guard
that turns the errors a user can act on into one line and exit code 2."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from headlab._util.timing import busy
from headlab._util.units import human_bytes, human_ms
from headlab.importance import gates
from headlab.runs.config import RunConfig

if TYPE_CHECKING:
    from headlab.results import RunResult

app = typer.Typer(
    name="headlab",
    help="See, score and prune the attention heads of transformer models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class _LineFormatter(logging.Formatter):
    """One format at every verbosity: ``warning: ...`` and ``error: ...`` as the CLI's
    own errors print, progress notes bare."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno >= logging.ERROR:
            return f"error: {message}"
        return f"warning: {message}" if record.levelno >= logging.WARNING else message


def setup(quiet: bool, json_mode: bool) -> None:
    import os
    import signal

    from headlab._util import progress as _progress

    # SIGTERM (a scheduler stopping the job) ends a run like Ctrl-C: status interrupted,
    # checkpoint saved, resumable. Both also stop every progress loop (see request_stop).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    other_rank = int(os.environ.get("RANK", "0")) > 0  # torchrun: rank 0 alone prints
    quiet = quiet or other_rank
    level = logging.WARNING if quiet or json_mode else logging.INFO
    level = logging.ERROR if other_rank else level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LineFormatter())
    root = logging.getLogger("headlab")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    _progress.set_enabled(not quiet and not json_mode and sys.stderr.isatty())
    for noisy in ("transformers", "datasets", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass


def _interrupt(signum, frame) -> None:
    from headlab._util import progress as _progress

    _progress.request_stop()
    raise KeyboardInterrupt


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def guard(fn, *args, **kwargs):
    """Run fn, turning the errors a user can act on into one line and exit code 2:
    headlab's own (`headlab.errors`), non-finite numbers from broken weights, and the
    file system's (full, read-only, missing), named by path. Others are bugs: they
    keep their traceback."""
    from headlab.errors import UserError

    try:
        return fn(*args, **kwargs)
    except (UserError, FloatingPointError) as exc:
        _fail(one_line(exc))
    except OSError as exc:
        if exc.filename is not None and exc.strerror:
            _fail(f"{exc.filename}: {exc.strerror}")
        _fail(one_line(exc))
    except KeyboardInterrupt as exc:
        run_dir = getattr(exc, "run_dir", None)  # set once the run directory exists
        if run_dir is None:
            typer.echo("interrupted before the run directory was made: nothing to resume",
                       err=True)
        else:
            typer.echo(f"interrupted: {run_dir} is marked 'interrupted'; continue it with "
                       f"--resume {run_dir}", err=True)
        raise typer.Exit(130) from None


def one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# ---------------------------------------------------------------- runs
def summary(result: RunResult, out: Path) -> dict:
    q, lat = result.quality, result.latency_ms
    return {
        "run_dir": str(out), "model": result.model, "method": result.method,
        "metric": q.metric, "quality_before": q.before, "quality_after": q.after,
        "quality_pruned": q.pruned,
        "recovery": result.recovery.method if result.recovery else None,
        "heads_total": result.heads_total, "heads_kept": result.heads_kept,
        "params_before": result.params.before, "params_after": result.params.after,
        "latency_ms_before": lat.before if lat else None,
        "latency_ms_after": lat.after if lat else None,
        "latency_by_length": [] if lat is None else [asdict(x) for x in lat.by_length],
        "latency_others_load": lat.others_load if lat else None,
        "report": str(out / "report.html"), "results": str(out / "results.json"),
        "model_dir": str(out / "model") if (out / "model").exists() else None,
        "scores": str(out / "importance.csv") if (out / "importance.csv").exists() else None,
        "top_heads": _top_heads(result.importance, 5),
        "gate_training": gates.ended(result.scoring_details),  # where gates ended, if any
        "heads_per_layer": [result.heads_per_layer.before, result.heads_per_layer.after],
        "kv_heads_per_layer": [result.kv_heads_per_layer.before,
                               result.kv_heads_per_layer.after],
        # the cache where the model keeps one (a model that generates text)
        "kv_cache_bytes_per_token": [result.kv_cache_bytes_per_token.before,
                                     result.kv_cache_bytes_per_token.after]
        if _generates(result.kind) else [None, None],
        # each compared method's held-out quality at the run's last step (--compare)
        "compared": {m: c[-1].quality for m, c in result.curves.items()
                     if m != result.method and c},
    }


def _generates(kind: str | None) -> bool:
    from headlab.objectives import OBJECTIVES

    objective = OBJECTIVES.get(kind or "")
    return objective is None or objective.generates


def _per_layer(counts: list[int] | None) -> str:
    """Counts per layer, short: "9 x 30 layers" when all alike, else each in order."""
    if not counts:
        return "-"
    if len(set(counts)) == 1:
        return f"{counts[0]} x {len(counts)} layers"
    return " ".join(str(n) for n in counts)


def _top_heads(importance: list[list[float]], k: int) -> list[list]:
    """The ``k`` highest-scoring heads as [layer, head, score]."""
    flat = [[layer, head, v] for layer, row in enumerate(importance or [])
            for head, v in enumerate(row) if v is not None and v == v]
    return sorted(flat, key=lambda x: -x[2])[:k]


def print_summary(summary: dict, json_mode: bool, quiet: bool) -> None:
    if json_mode:
        typer.echo(json.dumps(summary, indent=2))
        return
    if quiet:
        typer.echo(summary["report"])
        return
    from rich.console import Console
    from rich.table import Table

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, int) and v > 10_000:
            return f"{v:,}"
        return str(v)

    pruned = summary["heads_kept"] is not None  # a score run removes nothing
    t = Table(title=f"headlab: {summary['model']} ({summary['method']})", show_header=True)
    t.add_column("")
    t.add_column("before" if pruned else "model", justify="right")
    if pruned:
        t.add_column("after", justify="right")
    rows = [(f"held-out {summary['metric']}", fmt(summary["quality_before"]),
             fmt(summary["quality_after"]))]
    if summary["recovery"]:
        rows.append((f"  pruned, before {summary['recovery']}", "",
                     fmt(summary["quality_pruned"])))
    rows += [(f"  {m} choosing instead", "", fmt(q)) for m, q in summary["compared"].items()]
    heads, kv = summary["heads_per_layer"], summary["kv_heads_per_layer"]
    rows += [("heads", fmt(summary["heads_total"]), fmt(summary["heads_kept"])),
             ("  per layer", _per_layer(heads[0]), _per_layer(heads[1]))]
    if kv != heads:  # grouped-query attention: fewer key/value heads than query heads
        rows.append(("key/value heads per layer", _per_layer(kv[0]), _per_layer(kv[1])))
    cache = summary["kv_cache_bytes_per_token"]
    if cache[0] is not None:
        rows.append(("key/value cache per token", human_bytes(cache[0]),
                     human_bytes(cache[1])))
    rows += [("parameters", fmt(summary["params_before"]), fmt(summary["params_after"])),
             ("latency", human_ms(summary["latency_ms_before"]),
              human_ms(summary["latency_ms_after"]))]
    # and where attention's S^2 terms weigh: batch 1 at a longer length
    rows += [(f"  at {x['seq_len']} tokens, batch {x['batch']}", human_ms(x["before"]),
              human_ms(x["after"])) for x in summary.get("latency_by_length", [])[1:]]
    for label, before, after in rows:
        if pruned:
            t.add_row(label, before, after)
        elif before not in ("", "-"):
            t.add_row(label, before)
    console = Console()
    console.print(t)
    if summary.get("latency_others_load") is not None and (
            why := busy(summary["latency_others_load"])) is not None:
        console.print(f"latency: {why}")
    if summary.get("gate_training"):
        console.print(f"gate training: {summary['gate_training']}")
    if not pruned and summary["top_heads"]:
        console.print("top heads: " + ", ".join(f"L{layer}H{head} {v:.4g}"
                                                for layer, head, v in summary["top_heads"]))
    if summary["scores"]:
        console.print(f"scores:  {summary['scores']}")
    console.print(f"report:  {summary['report']}")
    console.print(f"results: {summary['results']}")
    if summary["model_dir"]:
        console.print(f"model:   {summary['model_dir']}")


def execute(config: dict, quiet: bool, json_mode: bool, resume: Path | None = None,
            recipe: Path | None = None) -> None:
    from headlab.errors import UserError
    from headlab.parallel import distributed
    from headlab.runs.pipeline import run

    if resume is None and not config.get("model"):
        raise UserError("give --model (or --resume RUN_DIR to continue a run)")
    cfg = None if resume is not None else RunConfig.from_dict(config)
    out, result = run(cfg, resume=resume, recipe=recipe)
    if distributed.is_main():
        print_summary(summary(result, out), json_mode, quiet)


def task_keys(tasks, include_path, limit, num_fewshot, needle_lengths) -> dict:
    """The RunConfig keys of the task options (headlab.evaluate.lm_eval, headlab.evaluate.needle):
    --tasks a,b -> [a, b]; --needle-lengths 256,512 -> [256, 512]."""
    from headlab.errors import UserError

    names = [t.strip() for t in (tasks or "").split(",") if t.strip()]
    try:
        lengths = [int(n) for n in (needle_lengths or "").split(",") if n.strip()]
    except ValueError:
        raise UserError(f"--needle-lengths takes token counts like 256,512, got "
                        f"{needle_lengths!r}") from None
    return dict(tasks=names, include_path=str(include_path) if include_path else None,
                limit=limit, num_fewshot=num_fewshot, needle_lengths=lengths)
