"""The `headlab` command: a thin layer over the Python API.

Bad input ends with one line on stderr and exit code 2, never a traceback; Ctrl-C
marks the run interrupted and exits 130, leaving no half-written file.
"""

from __future__ import annotations

import json
import logging
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from headlab.config import DEVICES, DTYPES, METHODS, SCHEDULES, RunConfig

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


# choices and defaults come from headlab.config, where a run's keys are defined once
Method = StrEnum("Method", [(m, m) for m in METHODS])
Schedule = StrEnum("Schedule", [(m, m) for m in SCHEDULES])
Device = StrEnum("Device", [(m, m) for m in DEVICES])
DType = StrEnum("DType", [(m, m) for m in DTYPES])
D = RunConfig.defaults()
DEFAULT_METHOD, DEFAULT_SCHEDULE = Method(D["method"]), Schedule(D["schedule"])
DEFAULT_DEVICE, DEFAULT_DTYPE = Device(D["device"]), DType(D["dtype"])


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


# ---------------------------------------------------------------- shared options
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Bundled name (smollm2-135m, "
                                       "minilm-l6), local directory, .gguf file or hub id.")]
RunModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", help="Bundled name (smollm2-135m, minilm-l6), local directory, .gguf "
    "file or hub id (not needed with --resume).")]
ResumeOpt = Annotated[Path | None, typer.Option(
    help="Continue an interrupted run directory with its own configuration.")]
DataOpt = Annotated[str | None, typer.Option(
    help="Dataset (name:config:split), .txt/.jsonl/.csv/.tsv file; default: bundled text.")]
MethodOpt = Annotated[Method, typer.Option(help="Importance method.")]
OutOpt = Annotated[Path | None, typer.Option(
    help="Run directory (default reports/<model>-<method>-keep<k>-<time>/).")]
TextColumnOpt = Annotated[str | None, typer.Option(help="Text column of the data.")]
LabelColumnOpt = Annotated[str | None, typer.Option(help="Label column (classifiers).")]
MaxTokensOpt = Annotated[int, typer.Option(help="Token budget for scoring + held-out.")]
SeqLenOpt = Annotated[int | None, typer.Option(
    help="Block length (default: the objective's, 256 for language models, 128 else, "
         "capped by the model's positions).")]
BatchSizeOpt = Annotated[int, typer.Option(help="Blocks per batch.")]
SeedOpt = Annotated[int, typer.Option(
    help="Seed of the scoring/held-out split, the masking and random scores.")]
DeviceOpt = Annotated[Device, typer.Option(help="auto picks CUDA when present.")]
DTypeOpt = Annotated[DType, typer.Option(help="Model dtype.")]
OverwriteOpt = Annotated[bool, typer.Option(help="Replace an existing run directory.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or logs.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a JSON summary.")]
NormalizeOpt = Annotated[bool | None, typer.Option(
    "--normalize/--no-normalize", show_default=False,
    help="Divide each layer's scores by their l2 norm (Michel et al.); default: on, but off "
         "for taylor, ablation and random.")]
MinmaxOpt = Annotated[bool, typer.Option(
    help="Rescale all scores to [0, 1] (as the bertology script did).")]
PerTokenOpt = Annotated[bool, typer.Option(help="One gate per token (michel/fisher).")]
ProbesOpt = Annotated[int, typer.Option(help="Curvature probes per batch (taylor).")]


def _summary(result: RunResult, out: Path) -> dict:
    q, lat = result.quality, result.latency_ms
    return {
        "run_dir": str(out), "model": result.model, "method": result.method,
        "metric": q.metric, "quality_before": q.before, "quality_after": q.after,
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
    from headlab.config import RunConfig
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
    model: RunModelOpt = None,
    keep: Annotated[float | None, typer.Option(help="Fraction of heads to keep, in (0, 1].")]
    = None,
    prune_n: Annotated[int | None, typer.Option("--prune", help="Number of heads to remove.")]
    = None,
    method: MethodOpt = DEFAULT_METHOD,
    schedule: Annotated[Schedule, typer.Option(help="Re-score after each step, or once.")]
    = DEFAULT_SCHEDULE,
    step: Annotated[float, typer.Option(help="Fraction of the heads removed per step.")]
    = D["step"],
    per_layer: Annotated[bool, typer.Option(help="Keep the same number in every layer.")]
    = False,
    min_heads_per_layer: Annotated[int, typer.Option(help="Protect each layer's best heads.")]
    = D["min_heads_per_layer"],
    data: DataOpt = None,
    text_column: TextColumnOpt = None,
    label_column: LabelColumnOpt = None,
    max_tokens: MaxTokensOpt = D["max_tokens"],
    seq_len: SeqLenOpt = None,
    batch_size: BatchSizeOpt = D["batch_size"],
    seed: SeedOpt = D["seed"],
    device: DeviceOpt = DEFAULT_DEVICE,
    dtype: DTypeOpt = DEFAULT_DTYPE,
    out: OutOpt = None,
    overwrite: OverwriteOpt = False,
    export: Annotated[str | None, typer.Option(
        help="'hf': also write a directory plain transformers loads, where expressible.")]
    = None,
    compare: Annotated[list[Method] | None, typer.Option(
        help="More methods to draw a curve for (repeat the option).")] = None,
    normalize: NormalizeOpt = None,
    global_minmax: MinmaxOpt = False,
    per_token: PerTokenOpt = False,
    probes: ProbesOpt = D["probes"],
    quiet: QuietOpt = False,
    json_mode: JsonOpt = False,
    resume: ResumeOpt = None,
) -> None:
    """Score every head, remove the least important, measure quality and speed.

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
    )
    _guard(_execute, config, quiet, json_mode, resume)


@app.command()
def score(
    model: RunModelOpt = None,
    method: MethodOpt = DEFAULT_METHOD,
    data: DataOpt = None,
    text_column: TextColumnOpt = None,
    label_column: LabelColumnOpt = None,
    max_tokens: MaxTokensOpt = D["max_tokens"],
    seq_len: SeqLenOpt = None,
    batch_size: BatchSizeOpt = D["batch_size"],
    seed: SeedOpt = D["seed"],
    normalize: NormalizeOpt = None,
    global_minmax: MinmaxOpt = False,
    per_token: PerTokenOpt = False,
    probes: ProbesOpt = D["probes"],
    device: DeviceOpt = DEFAULT_DEVICE,
    dtype: DTypeOpt = DEFAULT_DTYPE,
    out: OutOpt = None,
    overwrite: OverwriteOpt = False,
    quiet: QuietOpt = False,
    json_mode: JsonOpt = False,
    resume: ResumeOpt = None,
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
    model: ModelOpt,
    data: DataOpt = None,
    text_column: TextColumnOpt = None,
    label_column: LabelColumnOpt = None,
    max_tokens: MaxTokensOpt = D["max_tokens"],
    seq_len: SeqLenOpt = None,
    batch_size: BatchSizeOpt = D["batch_size"],
    seed: SeedOpt = D["seed"],
    reference: Annotated[str | None, typer.Option(
        help="Unpruned model that embedding fidelity is measured against.")] = None,
    device: DeviceOpt = DEFAULT_DEVICE,
    dtype: DTypeOpt = DEFAULT_DTYPE,
    json_mode: JsonOpt = False,
    quiet: QuietOpt = False,
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
    device: DeviceOpt = DEFAULT_DEVICE,
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
        help="attention|models|hooks|importance|pruning|generate|quality|all")] = "all",
    quick: Annotated[bool, typer.Option(help="Small sizes, about 2 minutes.")] = False,
    device: Annotated[Device, typer.Option()] = Device.cpu,
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
    quiet: QuietOpt = False,
    json_mode: JsonOpt = False,
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
