"""The `headlab` command: a thin layer over the Python API.

Bad input (the errors of `headlab.errors`, a file system's OSError, a bad option)
ends with one line on stderr and exit code 2, never a traceback; any other exception
is a bug and keeps its traceback (exit 1). Ctrl-C marks the run interrupted and exits
130, leaving no half-written file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from headlab import cli_options as opt
from headlab.cli_common import _guard, _one_line, _setup, app
from headlab.cli_heads import detect, inspect, validate
from headlab.config import RunConfig

if TYPE_CHECKING:
    from headlab.results import RunResult


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


def _protocol_keys(calib_data, eval_data, calib_samples, calib_seq_len, eval_protocol,
                   eval_seq_len) -> dict:
    """The RunConfig keys of the calibration / evaluation options (headlab.protocol)."""
    return dict(calib_data=calib_data, eval_data=eval_data, calib_samples=calib_samples,
                calib_seq_len=calib_seq_len, eval_protocol=eval_protocol.value,
                eval_seq_len=eval_seq_len)


def _task_keys(tasks, include_path, limit, num_fewshot, needle_lengths) -> dict:
    """The RunConfig keys of the task options (headlab.tasks, headlab.needle):
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
    shard: opt.ShardOpt = None,
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
    unit: opt.UnitOpt = opt.DEFAULT_UNIT,
    group_score: opt.GroupScoreOpt = opt.DEFAULT_GROUP_SCORE,
    kv_keep: opt.KvKeepOpt = None,
    demote: opt.DemoteOpt = False,
    sinks: opt.SinksOpt = opt.D["sinks"],
    window: opt.WindowOpt = opt.D["window"],
    demote_by: opt.DemoteByOpt = None,
    calib_data: opt.CalibDataOpt = None,
    eval_data: opt.EvalDataOpt = None,
    calib_samples: opt.CalibSamplesOpt = None,
    calib_seq_len: opt.CalibSeqLenOpt = None,
    eval_protocol: opt.EvalProtocolOpt = opt.DEFAULT_PROTOCOL,
    eval_seq_len: opt.EvalSeqLenOpt = None,
    tasks: opt.TasksOpt = None,
    include_path: opt.IncludePathOpt = None,
    limit: opt.LimitOpt = None,
    num_fewshot: opt.NumFewshotOpt = None,
    needle_lengths: opt.NeedleLengthsOpt = None,
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
        shard=shard and shard.value,
        out=str(out) if out else None, overwrite=overwrite, export=export,
        compare=[m.value for m in compare or []], normalize=normalize,
        global_minmax=global_minmax, per_token=per_token, probes=probes,
        recover=recover.value, recover_ridge=recover_ridge, recover_tokens=recover_tokens,
        recover_params=recover_params.value, recover_lr=recover_lr,
        recover_temperature=recover_temperature, recover_every_step=recover_every_step,
        unit=unit.value, group_score=group_score.value, kv_keep=kv_keep, demote=demote,
        sinks=sinks, window=window, demote_by=demote_by and demote_by.value,
        **_protocol_keys(calib_data, eval_data, calib_samples, calib_seq_len, eval_protocol,
                         eval_seq_len),
        **_task_keys(tasks, include_path, limit, num_fewshot, needle_lengths),
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
    shard: opt.ShardOpt = None,
    out: opt.OutOpt = None,
    overwrite: opt.OverwriteOpt = False,
    calib_data: opt.CalibDataOpt = None,
    eval_data: opt.EvalDataOpt = None,
    calib_samples: opt.CalibSamplesOpt = None,
    calib_seq_len: opt.CalibSeqLenOpt = None,
    eval_protocol: opt.EvalProtocolOpt = opt.DEFAULT_PROTOCOL,
    eval_seq_len: opt.EvalSeqLenOpt = None,
    tasks: opt.TasksOpt = None,
    include_path: opt.IncludePathOpt = None,
    limit: opt.LimitOpt = None,
    num_fewshot: opt.NumFewshotOpt = None,
    needle_lengths: opt.NeedleLengthsOpt = None,
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
                  device=device.value, dtype=dtype.value, shard=shard and shard.value,
                  out=str(out) if out else None, overwrite=overwrite,
                  **_protocol_keys(calib_data, eval_data, calib_samples, calib_seq_len,
                                   eval_protocol, eval_seq_len),
                  **_task_keys(tasks, include_path, limit, num_fewshot, needle_lengths))
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
    calib_data: opt.CalibDataOpt = None,
    eval_data: opt.EvalDataOpt = None,
    eval_protocol: opt.EvalProtocolOpt = opt.DEFAULT_PROTOCOL,
    eval_seq_len: opt.EvalSeqLenOpt = None,
    tasks: opt.TasksOpt = None,
    include_path: opt.IncludePathOpt = None,
    limit: opt.LimitOpt = None,
    num_fewshot: opt.NumFewshotOpt = None,
    needle: Annotated[bool, typer.Option(
        help="Needle in a haystack: retrieval of a planted fact per length and depth.")]
    = False,
    needle_lengths: opt.NeedleLengthsOpt = None,
    list_tasks: Annotated[bool, typer.Option(
        help="List the lm-eval task names (with --include-path's) and exit.")] = False,
    device: opt.DeviceOpt = opt.DEFAULT_DEVICE,
    dtype: opt.DTypeOpt = opt.DEFAULT_DTYPE,
    shard: opt.ShardOpt = None,
    json_mode: opt.JsonOpt = False,
    quiet: opt.QuietOpt = False,
) -> None:
    """Measure a model's (or pruned run directory's) quality on the held-out split,
    and optionally lm-eval tasks (--tasks) and the needle test (--needle).

    Example: headlab eval --model reports/RUN/model
    """
    _setup(quiet, json_mode)
    task_keys = _guard(_task_keys, tasks, include_path, limit, num_fewshot, needle_lengths)
    if needle:
        task_keys["tasks"] = [*task_keys["tasks"], "needle"]
    if list_tasks:
        from headlab.tasks import task_names

        typer.echo("\n".join(_guard(task_names, include_path)))
        return

    def body():
        from headlab.errors import UserError
        from headlab.evaluate import evaluate
        from headlab.objectives import objective_for
        from headlab.preflight import check_data
        from headlab.runs import build_data, load_model

        cfg = RunConfig.from_dict(dict(
            model=model, command="eval", data=data, text_column=text_column,
            label_column=label_column, max_tokens=max_tokens, seq_len=seq_len,
            batch_size=batch_size, seed=seed, device=device.value, dtype=dtype.value,
            shard=shard and shard.value,
            **_protocol_keys(calib_data, eval_data, None, None, eval_protocol, eval_seq_len),
            **task_keys))
        check_data(cfg)  # before the model loads
        m = load_model(cfg)
        ref = m
        if objective_for(m).needs_reference:
            if reference is None:
                raise UserError("embedding fidelity compares with the unpruned model: "
                                 "pass --reference ORIGINAL_MODEL")
            ref = load_model(RunConfig.from_dict({**cfg.to_dict(), "model": reference}))
        _, heldout, _ = build_data(cfg, ref)
        q = evaluate(m, heldout, batch_size=batch_size)
        from headlab import distributed

        if not distributed.is_main():  # under torchrun rank 0 alone prints
            return
        summary = {"model": model, **q.to_json(), "heads": m.heads_per_layer,
                   "params": m.num_parameters(), **_eval_tasks(cfg, m)}
        if json_mode:
            typer.echo(json.dumps(summary, indent=2))
        else:
            typer.echo(f"{q.metric}: {q.value:.6g} (loss {q.loss:.6g}, {q.n_tokens} held-out "
                       f"tokens, {sum(m.heads_per_layer)} heads, {m.num_parameters():,} params)")
            for name, metrics in summary.get("tasks", {}).items():
                shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()
                                  if isinstance(v, float))
                typer.echo(f"{name}: {shown}")
            if "needle" in summary:
                grid = summary["needle"]
                typer.echo(f"needle: mean exact match {_mean(grid['accuracy']):.3g} over "
                           f"lengths {grid['lengths']} x depths {grid['depths']}")

    _guard(body)


def _eval_tasks(cfg: RunConfig, model) -> dict:
    """lm-eval metrics ("tasks", with "lm_eval", the version) and the needle grid
    ("needle") for `eval`'s summary, where --tasks / --needle ask for them."""
    out: dict[str, Any] = {}
    names = [t for t in cfg.tasks if t != "needle"]
    if names:
        from headlab.tasks import lm_eval_version, run_tasks

        out["tasks"] = run_tasks(model, names, include_path=cfg.include_path, limit=cfg.limit,
                                 num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size,
                                 seed=cfg.seed)
        out["lm_eval"] = lm_eval_version()
    if "needle" in cfg.tasks:
        from headlab.needle import needle_test

        out["needle"] = needle_test(model, lengths=cfg.needle_lengths or None,
                                    filler=cfg.eval_data, seed=cfg.seed,
                                    batch_size=cfg.batch_size).to_json()
    return out


def _mean(grid: list[list[float]]) -> float:
    return sum(map(sum, grid)) / max(1, sum(map(len, grid)))


app.command()(inspect)
app.command()(detect)
app.command()(validate)


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
    """The command; a bad option or value is one line and exit code 2, like bad input."""
    from typer._click.exceptions import ClickException, NoArgsIsHelpError

    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except ClickException as exc:
        hint = f" (see {exc.ctx.command_path} --help)" if getattr(exc, "ctx", None) else ""
        typer.echo(f"error: {_one_line(exc.format_message())}{hint}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
