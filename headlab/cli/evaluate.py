"""``headlab eval``: a model's (or a pruned run directory's) quality on held-out data,
and optionally lm-eval tasks and the needle test (`headlab.runs.evaluate`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from headlab.cli import options as opt
from headlab.cli.common import app, guard, setup
from headlab.errors import UserError

REFERENCE = opt.Opt("reference", Annotated[str | None, typer.Option(
    help="Unpruned model that embedding fidelity is measured against.")])
NEEDLE = opt.Opt("needle", Annotated[bool, typer.Option(
    help="Needle in a haystack: retrieval of a planted fact per length and depth.")], False)
LIST_TASKS = opt.Opt("list_tasks", Annotated[bool, typer.Option(
    help="List the lm-eval task names (with --include-path's) and exit.")], False)
EvalModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", help=opt.BUNDLED_HELP + ", local directory, .gguf file or hub id "
    "(not needed with --list-tasks).")]
_EVAL_PROTOCOL = tuple(o for o in opt.PROTOCOL if o.name not in ("calib_samples",
                                                                  "calib_seq_len"))


@app.command(name="eval")
@opt.takes(opt.Opt("model", EvalModelOpt), opt.DATA, REFERENCE, _EVAL_PROTOCOL, opt.TASKS,
           NEEDLE, opt.NEEDLE_LENGTHS, LIST_TASKS, opt.DEVICE, opt.PRINT[::-1])
def eval_(**values) -> None:
    """Measure a model's (or pruned run directory's) quality on the held-out split,
    and optionally lm-eval tasks (--tasks) and the needle test (--needle).

    Example: headlab eval --model reports/RUN/model
    """
    json_mode = values["json_mode"]
    setup(values["quiet"], json_mode)
    reference, needle = values.pop("reference"), values.pop("needle")
    if values.pop("list_tasks"):
        from headlab.evaluate.lm_eval import task_names

        guard(opt.run_keys, "eval", values)  # a bad task option fails as before the list
        typer.echo("\n".join(guard(task_names, values["include_path"],
                                   trust_code=values["trust_task_code"])))
        return

    def body():
        from headlab.runs.config import RunConfig
        from headlab.runs.evaluate import evaluate_run

        if values["model"] is None:
            raise UserError("eval needs --model: a bundled name, a local directory, a .gguf "
                            "file or a hub id (a run directory's model/ included)")
        keys = opt.run_keys("eval", values)
        if needle:
            keys["tasks"] = [*keys["tasks"], "needle"]
        summary = evaluate_run(RunConfig.from_dict(keys), reference=reference)
        if summary is not None:  # under torchrun rank 0 alone prints
            _print(summary, json_mode)

    guard(body)


def _print(summary: dict, json_mode: bool) -> None:
    if json_mode:
        typer.echo(json.dumps(summary, indent=2))
        return
    typer.echo(f"{summary['metric']}: {summary['value']:.6g} (loss {summary['loss']:.6g}, "
               f"{summary['n_tokens']} held-out tokens, {sum(summary['heads'])} heads, "
               f"{summary['params']:,} params)")
    for name, metrics in summary.get("tasks", {}).items():
        shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float))
        typer.echo(f"{name}: {shown}")
    if "needle" in summary:
        grid = summary["needle"]
        typer.echo(f"needle: mean exact match {_mean(grid['accuracy']):.3g} over "
                   f"lengths {grid['lengths']} x depths {grid['depths']}")


def _mean(grid: list[list[float]]) -> float:
    return sum(map(sum, grid)) / max(1, sum(map(len, grid)))
