"""A run: one configuration, one directory, one results.json.

`run` carries a `RunConfig` out through the public API (load, data, score, schedule,
prune, evaluate) and writes the run directory: config.json (to repeat it exactly),
results.json (a `RunResult`), importance.csv, report.html, model/ and status.json
(running / interrupted / failed / complete).
"""

from __future__ import annotations

import datetime as _dt
import logging
from pathlib import Path
from typing import Any

from headlab._util.checkpoint import Checkpoint, check_identity
from headlab._util.filecheck import read_config
from headlab._util.io import atomic_write_json
from headlab.errors import UserError
from headlab.models.base import HeadModel
from headlab.parallel import distributed
from headlab.results import RunResult
from headlab.runs.config import RunConfig, resolve_device
from headlab.runs.identity import config_identity, token_identity
from headlab.runs.inputs import build_data, load_model
from headlab.runs.lock import RunLock, remove_stale_temps
from headlab.runs.placement import Placement
from headlab.runs.preflight import check_run
from headlab.runs.stages import Stage, now
from headlab.selection import heads_to_keep, kv_groups

log = logging.getLogger("headlab")



def default_out(cfg: RunConfig) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = Path(cfg.model).name if Path(cfg.model).exists() else cfg.model.replace("/", "_")
    keep = f"keep{cfg.keep:g}" if cfg.keep is not None else (
        f"prune{cfg.prune}" if cfg.prune is not None else cfg.command)
    return Path("reports") / f"{name}-{cfg.method}-{keep}-{stamp}"


def set_status(out: Path, status: str, **extra: Any) -> None:
    atomic_write_json(out / "status.json", {"status": status, "time": now(), **extra})


def run(cfg: RunConfig | None, *, resume: Path | None = None,
        recipe: Path | None = None) -> tuple[Path, RunResult]:
    """Carry out a prune or score run; return its directory and result.

    The model and data are loaded and the target checked against the model's heads
    before the run directory is created, so bad input leaves nothing behind; from then
    on status.json says running / interrupted / failed / complete, and checkpoints let
    ``resume=RUN_DIR`` finish an interrupted run with the result an uninterrupted one
    would have had. Under torchrun every rank computes, rank 0 alone writes.
    ``recipe``: the file ``cfg`` was read from, an input the run must not write over.
    """
    if resume is not None:
        cfg = resume_config(resume)
    cfg = cfg.validated()
    distributed.init_from_env(resolve_device(cfg.device))
    writes = Placement.here().writes  # rank 0 alone: the directory, its status and lock
    out = resume or (Path(cfg.out) if cfg.out is not None else default_out(cfg))
    if writes:
        check_run(cfg, out, resume=resume is not None, recipe=recipe)  # before the model loads
    if resume is None and out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise UserError(f"run directory {out} already exists; pass --overwrite or another --out")
    out = Path(distributed.broadcast(str(out)))
    if any(t != "needle" for t in cfg.tasks):  # a bad task fails now, not at the end
        from headlab.evaluate.lm_eval import check_tasks

        check_tasks([t for t in cfg.tasks if t != "needle"], cfg.include_path,
                    trust_code=cfg.trust_task_code)
    if resume is not None:  # the checkpoint is this configuration's, before loading
        check_identity(out, config_identity(cfg))
    model = load_model(cfg)
    # what a prune keeps, or the target a score by learned gates trains toward
    n_keep = None
    if cfg.command == "prune" or cfg.keep is not None or cfg.prune is not None:
        n_keep = _target(cfg, model)
    scoring, heldout, seq_len = build_data(cfg, model)
    identity = {**config_identity(cfg), **token_identity(scoring, heldout)}
    if resume is not None:  # and so are the tokens
        check_identity(out, identity)
    lock = None
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        lock = _claim(out, cfg, resumed=resume is not None)
        if resume is None:
            for stale in out.glob("checkpoint*.pt"):  # --overwrite starts over
                stale.unlink()
        atomic_write_json(out / "config.json", cfg.to_dict())
    stage = Stage(cfg, out, model, scoring, heldout, seq_len, Placement.here(model))
    try:  # from the moment status.json says running, an interrupt marks it interrupted
        if writes:
            set_status(out, "running")
        distributed.barrier()
        stage.checkpoint = Checkpoint(out, every=cfg.checkpoint_every, identity=identity)
        result = stage.prune(n_keep) if cfg.command == "prune" else stage.score_only(n_keep)
    except KeyboardInterrupt as exc:
        if writes:
            set_status(out, "interrupted", resume=f"headlab {cfg.command} --resume {out}")
            lock.release()
        exc.run_dir = out  # the CLI names it: the directory exists from here on
        raise
    except BaseException as exc:
        if writes:
            set_status(out, "failed", error=f"{type(exc).__name__}: {exc}")
            lock.release()
        raise
    stage.checkpoint.clear()
    if writes:
        set_status(out, "complete")
        lock.release()
    distributed.barrier()  # no rank leaves (and tears down the group) while rank 0 writes
    return out, result


def _claim(out: Path, cfg: RunConfig, *, resumed: bool) -> RunLock:
    """Lock the run directory for this process, refusing one a concurrent run has
    meanwhile filled, and clear what a killed run left half-written."""
    lock = RunLock(out)
    leftovers = [p for p in out.iterdir() if p.name != lock.path.name]
    if not resumed and not cfg.overwrite and leftovers:
        lock.release()
        raise UserError(f"run directory {out} was filled by another run meanwhile; pass "
                        "--overwrite or another --out")
    remove_stale_temps(out)
    return lock


def _target(cfg: RunConfig, model: HeadModel) -> int:
    """How many units (query heads, or GQA groups with --unit kv-group) the run keeps."""
    if cfg.unit == "head":
        return heads_to_keep(model.n_layers * model.n_original_heads, keep=cfg.keep,
                             prune=cfg.prune)
    groups = kv_groups(model)
    if all(len(g) == 1 for layer in groups for g in layer):
        log.warning("%s has no GQA (one query head per key/value head): a group is one "
                    "head, so --unit kv-group removes single heads, each with its "
                    "key/value head", cfg.model)
    fraction = cfg.kv_keep if cfg.kv_keep is not None else cfg.keep
    sizes = {len(layer) for layer in groups}
    if cfg.per_layer and len(sizes) == 1:
        # the fraction of each layer's groups, rounded up per layer: every layer keeps
        # the same number, so the model keeps one key/value head count (HF-exportable)
        size = sizes.pop()
        per_layer = heads_to_keep(size, keep=fraction)
        if abs(per_layer / size - fraction) > 0.05:
            log.warning("--per-layer keeps %d of %d key/value heads in each layer: %.0f%% of "
                        "them, not the %.0f%% asked (a layer keeps whole heads)", per_layer,
                        size, 100 * per_layer / size, 100 * fraction)
        return len(groups) * per_layer
    return heads_to_keep(sum(len(layer) for layer in groups), keep=fraction)


def resume_config(run_dir: Path) -> RunConfig:
    """The configuration an interrupted run was started with."""
    cfg_file = Path(run_dir) / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{run_dir} has no config.json: not a headlab run directory")
    status_file = Path(run_dir) / "status.json"
    if (status_file.is_file()
            and read_config(status_file, what="run status").get("status") == "complete"):
        raise UserError(f"{run_dir} is complete: there is nothing to resume")
    return RunConfig.from_dict(read_config(cfg_file, what="run configuration"))
