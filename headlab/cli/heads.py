"""The `headlab` commands that look at heads rather than prune them: inspect (per-head
statistics, logit attribution), detect (head types) and validate (importance methods
against real ablation). `headlab.cli` registers them on the app."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from headlab.cli import options as opt
from headlab.cli.common import guard, setup
from headlab.runs.config import RunConfig


def inspect(
    model: Annotated[str, typer.Argument(help="Model name or path.")],
    text: Annotated[str, typer.Argument(help="The text to look at.")],
    html: Annotated[Path | None, typer.Option(help="Write an interactive HTML view here.")]
    = None,
    top: Annotated[int, typer.Option(help="Rows of the table (most confident heads).",
                                     min=1)] = 20,
    device: opt.DeviceOpt = opt.DEFAULT_DEVICE,
    target: Annotated[str | None, typer.Option(
        help="With --foil: each head's direct logit attribution to logit(target) - "
             "logit(foil) at the last position (decoders) or the first [MASK] (masked "
             "LMs), one token each.")] = None,
    foil: Annotated[str | None, typer.Option(help="The token the target is compared with.")]
    = None,
) -> None:
    """Per-head statistics for one text, and an optional HTML attention view.

    Example: headlab inspect smollm2-135m "The cat sat on the mat." --html cat.html
    """
    setup(False, False)

    def body():
        if (target is None) != (foil is None):
            from headlab.errors import UserError

            raise UserError("give --target and --foil together")
        _check_file_out("--html", html)
        from headlab.models import load
        from headlab.runs.config import resolve_device
        from headlab.viz import inspect_text

        loaded = load(model, device=resolve_device(device.value))
        found = None
        if target is not None:
            found = _print_attribution(loaded, text, target, foil, top)
            if html is None:
                return
        table, written = inspect_text(loaded, text, html=html, attribution=found)
        if found is not None:
            typer.echo(f"view: {written}")
            return
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

    guard(body)


def _print_attribution(model, text: str, target: str, foil: str, top: int):
    """Print each head's direct logit attribution on ``text``; return it."""
    from headlab.analysis.attribution import logit_attribution

    found = logit_attribution(model, text, target=target, foil=foil)
    heads = found.total() - sum(found.rest.values())
    typer.echo(f"logit({target!r}) - logit({foil!r}) = {found.logit_diff:.4f} at position "
               f"{found.position}: heads {heads:.4f}, the rest {sum(found.rest.values()):.4f} "
               f"(final norm scale frozen at {found.norm_scale:.4g})")
    for layer, head, v in found.top(top):
        typer.echo(f"  L{layer}H{head} {v:+.4f}")
    return found


def detect(
    model: opt.ModelOpt,
    kinds: Annotated[list[str] | None, typer.Option(
        "--kinds", help="Detectors to run (repeat the option); default: all that apply.")]
    = None,
    n: Annotated[int, typer.Option(
        "--n", "--examples", help="Examples per detector (--examples under torchrun, whose "
                                   "own options take --n).", min=1)] = 16,
    seq_len: Annotated[int, typer.Option(help="Tokens per text block or needle prompt.")]
    = 128,
    top: Annotated[int, typer.Option(help="Heads listed per detector.", min=1)] = 5,
    seed: Annotated[int, typer.Option(
        help="Seed of the random repeated tokens and of the needles.", min=0,
        max=2**63 - 1)] = opt.D["seed"],
    device: opt.DeviceOpt = opt.DEFAULT_DEVICE,
    shard: opt.ShardOpt = None,
    out: Annotated[Path | None, typer.Option(help="Write every score here (JSON).")] = None,
    json_mode: opt.JsonOpt = False,
) -> None:
    """Head types: previous-token, induction, duplicate-token, sink, retrieval (decoders)
    or [CLS]/[SEP]/punctuation/next-token (encoders), each a score in [0, 1] per head.

    Example: headlab detect --model smollm2-135m --kinds induction --kinds previous-token
    """
    setup(True, json_mode)

    def body():
        from headlab._util.io import atomic_write_json
        from headlab.detectors import KINDS, detect_all, top_heads
        from headlab.errors import UserError
        from headlab.models import load
        from headlab.parallel import distributed
        from headlab.parallel.sharding import load_sharded
        from headlab.runs.config import resolve_device

        unknown = [k for k in kinds or [] if k not in KINDS]
        if unknown:
            raise UserError(f"--kinds: unknown detector(s) {', '.join(unknown)}; choose from "
                            f"{', '.join(KINDS)}")
        _check_file_out("--out", out)
        where = resolve_device(device.value)
        # sharded: every rank runs every probe, in lockstep through each block's gather
        m = load_sharded(model, device=where)[0] if shard else load(model, device=where)
        found = detect_all(m, kinds, n=n, seq_len=seq_len, seed=seed)
        if not distributed.is_main():  # under torchrun rank 0 alone prints
            return
        if out is not None:
            atomic_write_json(out, {k: s.to_json() for k, s in found.items()})
        if json_mode:
            typer.echo(json.dumps({k: s.to_json() for k, s in found.items()}))
            return
        for kind, scores in found.items():
            best = ", ".join(f"L{layer}H{head} {v:.3f}" for layer, head, v in
                             top_heads(scores, top))
            typer.echo(f"{kind:>16}: {best}")

    guard(body)


def validate(
    model: opt.ModelOpt,
    methods: Annotated[list[opt.Method] | None, typer.Option(
        "--methods", metavar="<method>",
        help="An importance method to check (repeat; one of --method's); default: all.")] = None,
    kinds: Annotated[list[str] | None, typer.Option(
        "--kinds", help="Detectors to check (repeat); default: all that apply.")] = None,
    data: opt.DataOpt = None,
    max_tokens: Annotated[int, typer.Option(help="Token budget for scoring + held-out.")]
    = 4096,
    seq_len: Annotated[int, typer.Option(help="Tokens per block.")] = 128,
    batch_size: opt.BatchSizeOpt = opt.D["batch_size"],
    n_boot: Annotated[int, typer.Option(help="Bootstrap draws over held-out examples.",
                                        min=1)] = 1000,
    seed: opt.SeedOpt = opt.D["seed"],
    device: opt.DeviceOpt = opt.DEFAULT_DEVICE,
    out: Annotated[Path | None, typer.Option(help="Write the validation here (JSON).")]
    = None,
    json_mode: opt.JsonOpt = False,
) -> None:
    """Each head's true single-head ablation cost on held-out data, and how well every
    importance method and detector ranks it (Spearman, bootstrap 95% CI, pruning-curve
    area / random's).

    Example: headlab validate --model minilm-l6 --methods michel --methods random
    """
    setup(True, json_mode)

    def body():
        from headlab._util.io import atomic_write_json
        from headlab.analysis.validation import validate as run_validation
        from headlab.importance import METHODS
        from headlab.runs.inputs import build_data, load_model

        _check_file_out("--out", out)
        cfg = RunConfig.from_dict(dict(
            model=model, command="score", data=data, max_tokens=max_tokens, seq_len=seq_len,
            batch_size=batch_size, seed=seed, device=device.value))
        m = load_model(cfg)
        scoring, heldout, _ = build_data(cfg, m)
        found = run_validation(m, scoring, heldout,
                               methods=[x.value for x in methods] if methods else METHODS,
                               detectors=kinds, batch_size=batch_size, n_boot=n_boot,
                               seed=seed, name=model)
        if out is not None:
            atomic_write_json(out, found.to_json())
        typer.echo(json.dumps(found.to_json()) if json_mode else found.table())

    guard(body)


def _check_file_out(flag: str, path: Path | None) -> None:
    """A file the command will write can be: not a folder, not under a regular file."""
    if path is None:
        return
    from headlab.errors import UserError

    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file path")
    base = path.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise UserError(f"{flag} {path}: {base} is a file, not a folder; give another {flag}")
