"""What every `headlab` command shares: the typer app, logging set-up, and the guard
that turns the errors a user can act on into one line and exit code 2."""

from __future__ import annotations

import logging
import sys

import typer

app = typer.Typer(
    name="headlab",
    help="See, score and prune the attention heads of transformer models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


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
    """Run fn, turning the errors a user can act on into one line and exit code 2:
    headlab's own (`headlab.errors`), non-finite numbers from broken weights, and the
    file system's (full, read-only, missing), named by path. Others are bugs: they
    keep their traceback."""
    from headlab.errors import UserError

    try:
        return fn(*args, **kwargs)
    except (UserError, FloatingPointError) as exc:
        _fail(_one_line(exc))
    except OSError as exc:
        if exc.filename is not None and exc.strerror:
            _fail(f"{exc.filename}: {exc.strerror}")
        _fail(_one_line(exc))
    except KeyboardInterrupt as exc:
        run_dir = getattr(exc, "run_dir", None)  # set once the run directory exists
        if run_dir is None:
            typer.echo("interrupted before the run directory was made: nothing to resume",
                       err=True)
        else:
            typer.echo(f"interrupted: {run_dir} is marked 'interrupted'; continue it with "
                       f"--resume {run_dir}", err=True)
        raise typer.Exit(130) from None


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
