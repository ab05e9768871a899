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
from headlab.cli.common import app, execute, guard, one_line, setup
from headlab.cli.evaluate import eval_  # noqa: F401  (registers `headlab eval`)
from headlab.cli.heads import detect, inspect, validate


# ---------------------------------------------------------------- commands
@app.command()
@opt.takes(opt.MODEL, opt.TARGET, opt.METHOD, opt.SCHEDULE, opt.DATA, opt.DEVICE, opt.RUN_DIR,
           opt.EXPORT, opt.SCORING, opt.RECOVERY, opt.KV_CACHE, opt.PROTOCOL, opt.TASKS,
           opt.NEEDLE_LENGTHS, opt.RECOVER_EVERY_STEP, opt.PRINT, opt.RESUME)
def prune(**values) -> None:
    """Score every head, remove the least important, repair, measure quality and speed.

    Example: headlab prune --model smollm2-135m --keep 0.6
    """
    _run("prune", values)


@app.command()
@opt.takes(opt.MODEL, opt.TARGET, opt.METHOD, opt.DATA, opt.SCORING, opt.DEVICE, opt.RUN_DIR,
           opt.SCORE_PROTOCOL, opt.TASKS, opt.NEEDLE_LENGTHS, opt.PRINT, opt.RESUME)
def score(**values) -> None:
    """Score head importance only (results.json, importance.csv, report.html).

    Example: headlab score --model minilm-l6 --method michel
    """
    _run("score", values)


def _run(command: str, values: dict) -> None:
    quiet, json_mode = values["quiet"], values["json_mode"]
    setup(quiet, json_mode)
    guard(lambda: execute(opt.run_keys(command, values), quiet, json_mode, values["resume"]))


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
    quick: Annotated[bool, typer.Option(
        help="Small sizes: minutes, where the full sizes take hours on two cores.")] = False,
    device: Annotated[opt.Device, typer.Option()] = opt.Device.cpu,
    out: Annotated[Path, typer.Option(help="Where the JSON files go.")] = Path("reports/bench"),
    resume: Annotated[bool, typer.Option(
        help="quality and recovery: keep the models an interrupted run of the same sizes "
             "finished (OUT/NAME.parts) and measure the rest.")] = False,
) -> None:
    """Speed and memory figures, each as a ratio to its reference measured in the same run."""
    setup(False, False)

    def body():
        from headlab.bench import kept_parts, run_benchmarks

        try:
            run_benchmarks(which, quick=quick, device=device.value, out=out, resume=resume)
        except KeyboardInterrupt:
            kept = kept_parts(out, which)
            if not kept:
                raise
            typer.echo(f"interrupted: the parts measured are kept in "
                       f"{', '.join(map(str, kept))}; continue with headlab bench {which} "
                       f"--resume --out {out}", err=True)
            raise typer.Exit(130) from None

    guard(body)


@app.command(name="run", context_settings={"allow_extra_args": False})
def run_recipe(
    recipe: Annotated[Path, typer.Argument(help="A TOML recipe (see recipes/).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides.")] = None,
    trust_task_code: opt.TrustTaskCodeOpt = False,
    quiet: opt.QuietOpt = False,
    json_mode: opt.JsonOpt = False,
) -> None:
    """Run a recipe: headlab run recipes/smollm2-offline.toml keep=0.5"""
    setup(quiet, json_mode)

    def body():
        from headlab.runs.config import load_recipe

        config = load_recipe(recipe, overrides or [])
        if trust_task_code:
            config["trust_task_code"] = True
        execute(config, quiet, json_mode, recipe=recipe)

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
