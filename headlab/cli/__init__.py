"""The `headlab` command: a thin layer over the Python API.

Bad input (the errors of `headlab.errors`, a file system's OSError, a bad option)
ends with one line on stderr and exit code 2, never a traceback; any other exception
is a bug and keeps its traceback (exit 1). Ctrl-C marks the run interrupted and exits
130, leaving no half-written file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from headlab.cli import options as opt
from headlab.cli.common import app, execute, guard, one_line, protocol_keys, setup, task_keys
from headlab.cli.evaluate import eval_  # noqa: F401  (registers `headlab eval`)
from headlab.cli.heads import detect, inspect, validate


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
    setup(quiet, json_mode)
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
        **protocol_keys(calib_data, eval_data, calib_samples, calib_seq_len, eval_protocol,
                         eval_seq_len),
        **task_keys(tasks, include_path, limit, num_fewshot, needle_lengths),
    )
    guard(execute, config, quiet, json_mode, resume)


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
    setup(quiet, json_mode)
    config = dict(model=model, command="score", method=method.value, data=data,
                  text_column=text_column, label_column=label_column, max_tokens=max_tokens,
                  seq_len=seq_len, batch_size=batch_size, seed=seed, normalize=normalize,
                  global_minmax=global_minmax, per_token=per_token, probes=probes,
                  device=device.value, dtype=dtype.value, shard=shard and shard.value,
                  out=str(out) if out else None, overwrite=overwrite,
                  **protocol_keys(calib_data, eval_data, calib_samples, calib_seq_len,
                                   eval_protocol, eval_seq_len),
                  **task_keys(tasks, include_path, limit, num_fewshot, needle_lengths))
    guard(execute, config, quiet, json_mode, resume)


app.command()(inspect)
app.command()(detect)
app.command()(validate)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="A run directory.")]) -> None:
    """Rebuild RUN_DIR/report.html from RUN_DIR/results.json alone."""
    setup(True, False)

    def body():
        from headlab.report import write_report

        if not (run_dir / "results.json").is_file():
            raise FileNotFoundError(f"{run_dir}/results.json does not exist: not a run directory")
        typer.echo(str(write_report(run_dir)))

    guard(body)


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
    setup(False, False)

    def body():
        from headlab.bench import run_benchmarks

        run_benchmarks(which, quick=quick, device=device.value, out=out)

    guard(body)


@app.command(name="run", context_settings={"allow_extra_args": False})
def run_recipe(
    recipe: Annotated[Path, typer.Argument(help="A TOML recipe (see recipes/).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides.")] = None,
    quiet: opt.QuietOpt = False,
    json_mode: opt.JsonOpt = False,
) -> None:
    """Run a recipe: headlab run recipes/smollm2-offline.toml keep=0.5"""
    setup(quiet, json_mode)

    def body():
        from headlab.runs.config import load_recipe

        config = load_recipe(recipe, overrides or [])
        execute(config, quiet, json_mode)

    guard(body)


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
        typer.echo(f"error: {one_line(exc.format_message())}{hint}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
