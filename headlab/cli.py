"""The `headlab` command: a thin layer over the Python API.

Bad input ends with one line on stderr and exit code 2, never a traceback; Ctrl-C
marks the run interrupted and exits 130, leaving no half-written file.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from headlab import cli_options as opt
from headlab.config import RunConfig

if TYPE_CHECKING:
    from headlab.results import RunResult

app = typer.Typer(
    name="headlab",
    help="See, score and prune the attention heads of transformer models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
log = logging.getLogger("headlab")


def _setup(quiet: bool, json_mode: bool) -> None:
    import os
    import signal

    from headlab import _progress

    # SIGTERM (a scheduler stopping the job) ends a run like Ctrl-C: status interrupted,
    # checkpoint saved, resumable. Both also stop every progress loop (see request_stop).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    other_rank = int(os.environ.get("RANK", "0")) > 0  # torchrun: rank 0 alone prints
    quiet = quiet or other_rank
    level = logging.WARNING if quiet or json_mode else logging.INFO
    level = logging.ERROR if other_rank else level
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"
                                           if level > logging.INFO else "%(message)s"))
    root = logging.getLogger("headlab")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    _progress.set_enabled(not quiet and not json_mode and sys.stderr.isatty())
    for noisy in ("transformers", "datasets", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", message=".*zero-element tensors.*")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass


def _interrupt(signum, frame) -> None:
    from headlab import _progress

    _progress.request_stop()
    raise KeyboardInterrupt


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _guard(fn, *args, **kwargs):
    """Run fn, turning the errors a user can act on into one line and exit code 2."""
    from headlab.errors import UserError

    try:
        return fn(*args, **kwargs)
    except (UserError, FileNotFoundError, FloatingPointError) as exc:
        _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    except ValueError as exc:  # validation deeper in the API (plans, shapes, keys)
        _fail(str(exc).splitlines()[0])
    except KeyboardInterrupt:
        typer.echo("interrupted: the run directory is marked 'interrupted'; continue it "
                   "with --resume RUN_DIR", err=True)
        raise typer.Exit(130) from None



def _summary(result: RunResult, out: Path) -> dict:
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
        "report": str(out / "report.html"), "results": str(out / "results.json"),
        "model_dir": str(out / "model") if (out / "model").exists() else None,
    }


def _print_summary(summary: dict, json_mode: bool, quiet: bool) -> None:
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

    t = Table(title=f"headlab: {summary['model']} ({summary['method']})", show_header=True)
    t.add_column("")
    t.add_column("before", justify="right")
    t.add_column("after", justify="right")
    t.add_row(f"held-out {summary['metric']}", fmt(summary["quality_before"]),
              fmt(summary["quality_after"]))
    if summary["recovery"]:
        t.add_row(f"  pruned, before {summary['recovery']}", "", fmt(summary["quality_pruned"]))
    t.add_row("heads", fmt(summary["heads_total"]), fmt(summary["heads_kept"]))
    t.add_row("parameters", fmt(summary["params_before"]), fmt(summary["params_after"]))
    t.add_row("latency (ms)", fmt(summary["latency_ms_before"]), fmt(summary["latency_ms_after"]))
    console = Console()
    console.print(t)
    console.print(f"report:  {summary['report']}")
    console.print(f"results: {summary['results']}")
    if summary["model_dir"]:
        console.print(f"model:   {summary['model_dir']}")


def _execute(config: dict, quiet: bool, json_mode: bool, resume: Path | None = None) -> None:
    from headlab import distributed
    from headlab.errors import UserError
    from headlab.runs import run

    if resume is None and not config.get("model"):
        raise UserError("give --model (or --resume RUN_DIR to continue a run)")
    cfg = None if resume is not None else RunConfig.from_dict(config)
    out, result = run(cfg, resume=resume)
    if distributed.is_main():
        _print_summary(_summary(result, out), json_mode, quiet)


# ---------------------------------------------------------------- commands
@app.command()
def prune(
    model: opt.RunModelOpt = None,
    keep: Annotated[float | None, typer.Option(help="Fraction of heads to keep, in (0, 1].")]
    = None,
    prune_n: Annotated[int | None, typer.Option("--prune", help="Number of heads to remove.")]
    = None,
    method: opt.MethodOpt = opt.DEFAULT_METHOD,
    schedule: Annotated[opt.Schedule, typer.Option(help="Re-score after each step, or once.")]
    = opt.DEFAULT_SCHEDULE,
    step: Annotated[float, typer.Option(help="Fraction of the heads removed per step.")]
    = opt.D["step"],
    per_layer: Annotated[bool, typer.Option(help="Keep the same number in every layer.")]
    = False,
    min_heads_per_layer: Annotated[int, typer.Option(help="Protect each layer's best heads.")]
    = opt.D["min_heads_per_layer"],
    data: opt.DataOpt = None,
    text_column: opt.TextColumnOpt = None,
    label_column: opt.LabelColumnOpt = None,
    max_tokens: opt.MaxTokensOpt = opt.D["max_tokens"],
    seq_len: opt.SeqLenOpt = None,
    batch_size: opt.BatchSizeOpt = opt.D["batch_size"],
    seed: opt.SeedOpt = opt.D["seed"],
    device: opt.DeviceOpt = opt.DEFAULT_DEVICE,
    dtype: opt.DTypeOpt = opt.DEFAULT_DTYPE,
    out: opt.OutOpt = None,
    overwrite: opt.OverwriteOpt = False,
    export: Annotated[str | None, typer.Option(
        help="'hf': also write a directory plain transformers loads, where expressible.")]
    = None,
    compare: Annotated[list[opt.Method] | None, typer.Option(
        help="More methods to draw a curve for (repeat the option).")] = None,
    normalize: opt.NormalizeOpt = None,
    global_minmax: opt.MinmaxOpt = False,
    per_token: opt.PerTokenOpt = False,
    probes: opt.ProbesOpt = opt.D["probes"],
    recover: Annotated[opt.Recovery, typer.Option(
        help="Repair after pruning, on the scoring split: lsq refits each layer's output "
             "projection, bias folds the removed heads' mean in, rescale scales each kept "
             "head, distill trains briefly toward the unpruned model (after lsq); none "
             "compares with Michel et al.")] = opt.DEFAULT_RECOVERY,
    recover_ridge: Annotated[float | None, typer.Option(
        help="lsq/rescale: ridge toward the current weights, times mean(diag X^T X).")]
    = None,
    recover_tokens: Annotated[int | None, typer.Option(
        help="distill: token budget (default one pass over the scoring split).")] = None,
    recover_params: Annotated[opt.RecoverParams, typer.Option(
        help="distill: what trains (lora needs peft).")] = opt.DEFAULT_RECOVER_PARAMS,
    recover_lr: Annotated[float, typer.Option(help="distill: AdamW learning rate.")]
    = opt.D["recover_lr"],
    recover_temperature: Annotated[float, typer.Option(help="distill: KL temperature.")]
    = opt.D["recover_temperature"],
    recover_every_step: Annotated[bool, typer.Option(
        help="Repair after each step too (bias, lsq, rescale), before re-scoring; the "
             "curve shows the repaired quality.")] = False,
    quiet: opt.QuietOpt = False,
    json_mode: opt.JsonOpt = False,
    resume: opt.ResumeOpt = None,
) -> None:
    """Score every head, remove the least important, repair, measure quality and speed.

    Example: headlab prune --model smollm2-135m --keep 0.6
    """
    _setup(quiet, json_mode)
    config = dict(
        model=model, command="prune", keep=keep, prune=prune_n, method=method.value,
        schedule=schedule.value, step=step, per_layer=per_layer,
        min_heads_per_layer=min_heads_per_layer, data=data, text_column=text_column,
        label_column=label_column, max_tokens=max_tokens, seq_len=seq_len,
        batch_size=batch_size, seed=seed, device=device.value, dtype=dtype.value,
        out=str(out) if out else None, overwrite=overwrite, export=export,
        compare=[m.value for m in compare or []], normalize=normalize,
        global_minmax=global_minmax, per_token=per_token, probes=probes,
        recover=recover.value, recover_ridge=recover_ridge, recover_tokens=recover_tokens,
        recover_params=recover_params.value, recover_lr=recover_lr,
        recover_temperature=recover_temperature, recover_every_step=recover_every_step,
    )
    _guard(_execute, config, quiet, json_mode, resume)


@app.command()
def score(
    model: opt.RunModelOpt = None,
    method: opt.MethodOpt = opt.DEFAULT_METHOD,
    data: opt.DataOpt = None,
    text_column: opt.TextColumnOpt = None,
    label_column: opt.LabelColumnOpt = None,
    max_tokens: opt.MaxTokensOpt = opt.D["max_tokens"],
    seq_len: opt.SeqLenOpt = None,
    batch_size: opt.BatchSizeOpt = opt.D["batch_size"],
    seed: opt.SeedOpt = opt.D["seed"],
    normalize: opt.NormalizeOpt = None,
    global_minmax: opt.MinmaxOpt = False,
    per_token: opt.PerTokenOpt = False,
    probes: opt.ProbesOpt = opt.D["probes"],
    device: opt.DeviceOpt = opt.DEFAULT_DEVICE,
    dtype: opt.DTypeOpt = opt.DEFAULT_DTYPE,
    out: opt.OutOpt = None,
    overwrite: opt.OverwriteOpt = False,
    quiet: opt.QuietOpt = False,
    json_mode: opt.JsonOpt = False,
    resume: opt.ResumeOpt = None,
) -> None:
    """Score head importance only (results.json, importance.csv, report.html).

    Example: headlab score --model minilm-l6 --method michel
    """
    _setup(quiet, json_mode)
    config = dict(model=model, command="score", method=method.value, data=data,
                  text_column=text_column, label_column=label_column, max_tokens=max_tokens,
                  seq_len=seq_len, batch_size=batch_size, seed=seed, normalize=normalize,
                  global_minmax=global_minmax, per_token=per_token, probes=probes,
                  device=device.value, dtype=dtype.value,
                  out=str(out) if out else None, overwrite=overwrite)
    _guard(_execute, config, quiet, json_mode, resume)


@app.command(name="eval")
def eval_(
    model: opt.ModelOpt,
    data: opt.DataOpt = None,
    text_column: opt.TextColumnOpt = None,
    label_column: opt.LabelColumnOpt = None,
    max_tokens: opt.MaxTokensOpt = opt.D["max_tokens"],
    seq_len: opt.SeqLenOpt = None,
    batch_size: opt.BatchSizeOpt = opt.D["batch_size"],
    seed: opt.SeedOpt = opt.D["seed"],
    reference: Annotated[str | None, typer.Option(
        help="Unpruned model that embedding fidelity is measured against.")] = None,
    device: opt.DeviceOpt = opt.DEFAULT_DEVICE,
    dtype: opt.DTypeOpt = opt.DEFAULT_DTYPE,
    json_mode: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Measure a model's (or pruned run directory's) quality on the held-out split.

    Example: headlab eval --model reports/RUN/model
    """
    _setup(quiet, json_mode)

    def body():
        from headlab.errors import UserError
        from headlab.evaluate import evaluate
        from headlab.objectives import objective_for
        from headlab.runs import build_data, load_model

        cfg = RunConfig.from_dict(dict(
            model=model, command="eval", data=data, text_column=text_column,
            label_column=label_column, max_tokens=max_tokens, seq_len=seq_len,
            batch_size=batch_size, seed=seed, device=device.value, dtype=dtype.value))
        m = load_model(cfg)
        ref = m
        if objective_for(m).needs_reference:
            if reference is None:
                raise UserError("embedding fidelity compares with the unpruned model: "
                                 "pass --reference ORIGINAL_MODEL")
            ref = load_model(RunConfig.from_dict({**cfg.to_dict(), "model": reference}))
        _, heldout, _ = build_data(cfg, ref)
        q = evaluate(m, heldout, batch_size=batch_size)
        summary = {"model": model, **q.to_json(), "heads": m.heads_per_layer,
                   "params": m.num_parameters()}
        if json_mode:
            typer.echo(json.dumps(summary, indent=2))
        else:
            typer.echo(f"{q.metric}: {q.value:.6g} (loss {q.loss:.6g}, {q.n_tokens} held-out "
                       f"tokens, {sum(m.heads_per_layer)} heads, {m.num_parameters():,} params)")

    _guard(body)


@app.command()
def inspect(
    model: Annotated[str, typer.Argument(help="Model name or path.")],
    text: Annotated[str, typer.Argument(help="The text to look at.")],
    html: Annotated[Path | None, typer.Option(help="Write an interactive HTML view here.")]
    = None,
    top: Annotated[int, typer.Option(help="Rows of the table (most confident heads).")] = 20,
    device: opt.DeviceOpt = opt.DEFAULT_DEVICE,
) -> None:
    """Per-head statistics for one text, and an optional HTML attention view.

    Example: headlab inspect smollm2-135m "The cat sat on the mat." --html cat.html
    """
    _setup(False, False)

    def body():
        from headlab.viz import inspect_text

        table, written = inspect_text(model, text, html=html, device=device.value)
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"{model}: heads on {len(text)} characters")
        cols = ["layer", "head", "entropy", "confidence", "first", "prev", "self", "next",
                "punct"]
        for c in cols:
            t.add_column(c, justify="right")
        for rec in sorted(table, key=lambda r: -r["confidence"])[:top]:
            t.add_row(*[str(rec[c]) if c in ("layer", "head") else f"{rec[c]:.2f}"
                        for c in cols])
        Console().print(t)
        if written:
            typer.echo(f"view: {written}")

    _guard(body)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="A run directory.")]) -> None:
    """Rebuild RUN_DIR/report.html from RUN_DIR/results.json alone."""
    _setup(True, False)

    def body():
        from headlab.report import write_report

        if not (run_dir / "results.json").is_file():
            raise FileNotFoundError(f"{run_dir}/results.json does not exist: not a run directory")
        typer.echo(str(write_report(run_dir)))

    _guard(body)


@app.command()
def bench(
    which: Annotated[str, typer.Argument(
        help="attention|models|hooks|importance|pruning|generate|quality|recovery|all")]
    = "all",
    quick: Annotated[bool, typer.Option(help="Small sizes, about 2 minutes.")] = False,
    device: Annotated[opt.Device, typer.Option()] = opt.Device.cpu,
    out: Annotated[Path, typer.Option(help="Where the JSON files go.")] = Path("reports/bench"),
) -> None:
    """Speed and memory figures, each as a ratio to its reference measured in the same run."""
    _setup(False, False)

    def body():
        from headlab.bench import run_benchmarks

        run_benchmarks(which, quick=quick, device=device.value, out=out)

    _guard(body)


@app.command(name="run", context_settings={"allow_extra_args": False})
def run_recipe(
    recipe: Annotated[Path, typer.Argument(help="A TOML recipe (see recipes/).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides.")] = None,
    quiet: opt.QuietOpt = False,
    json_mode: opt.JsonOpt = False,
) -> None:
    """Run a recipe: headlab run recipes/smollm2-offline.toml keep=0.5"""
    _setup(quiet, json_mode)

    def body():
        from headlab.config import load_recipe

        config = load_recipe(recipe, overrides or [])
        _execute(config, quiet, json_mode)

    _guard(body)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
