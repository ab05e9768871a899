"""``headlab eval``: a model's (or a pruned run directory's) quality on held-out data,
and optionally lm-eval tasks and the needle test."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from headlab.cli import options as opt
from headlab.cli.common import app, guard, protocol_keys, setup, task_keys
from headlab.runs.config import RunConfig


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
    setup(quiet, json_mode)
    keys = guard(task_keys, tasks, include_path, limit, num_fewshot, needle_lengths)
    if needle:
        keys["tasks"] = [*keys["tasks"], "needle"]
    if list_tasks:
        from headlab.evaluate.lm_eval import task_names

        typer.echo("\n".join(guard(task_names, include_path)))
        return

    def body():
        from headlab.errors import UserError
        from headlab.evaluate.quality import evaluate
        from headlab.objectives import objective_for
        from headlab.runs.inputs import build_data, load_model
        from headlab.runs.preflight import check_data

        cfg = RunConfig.from_dict(dict(
            model=model, command="eval", data=data, text_column=text_column,
            label_column=label_column, max_tokens=max_tokens, seq_len=seq_len,
            batch_size=batch_size, seed=seed, device=device.value, dtype=dtype.value,
            shard=shard and shard.value,
            **protocol_keys(calib_data, eval_data, None, None, eval_protocol, eval_seq_len),
            **keys))
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
        from headlab.parallel import distributed

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

    guard(body)


def _eval_tasks(cfg: RunConfig, model) -> dict:
    """lm-eval metrics ("tasks", with "lm_eval", the version) and the needle grid
    ("needle") for `eval`'s summary, where --tasks / --needle ask for them."""
    out: dict[str, Any] = {}
    names = [t for t in cfg.tasks if t != "needle"]
    if names:
        from headlab.evaluate.lm_eval import lm_eval_version, run_tasks

        out["tasks"] = run_tasks(model, names, include_path=cfg.include_path, limit=cfg.limit,
                                 num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size,
                                 seed=cfg.seed)
        out["lm_eval"] = lm_eval_version()
    if "needle" in cfg.tasks:
        from headlab.evaluate.needle import needle_test

        out["needle"] = needle_test(model, lengths=cfg.needle_lengths or None,
                                    filler=cfg.eval_data, seed=cfg.seed,
                                    batch_size=cfg.batch_size).to_json()
    return out


def _mean(grid: list[list[float]]) -> float:
    return sum(map(sum, grid)) / max(1, sum(map(len, grid)))
