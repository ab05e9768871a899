"""A run: one configuration, one directory, one results.json.

`run` carries a `RunConfig` out through the public API (load, data, score, schedule,
prune, evaluate) and writes the run directory: config.json (to repeat it exactly),
results.json (a `RunResult`), importance.csv, report.html, model/ and status.json
(running / interrupted / failed / complete).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headlab import __version__, distributed
from headlab._io import atomic_write_json
from headlab.checkpoint import Checkpoint
from headlab.config import DTYPES, RunConfig, resolve_device
from headlab.data import BUNDLED_SPEC, BUNDLED_WARNING, Blocks, load_texts, split_blocks
from headlab.errors import UserError
from headlab.evaluate import evaluate
from headlab.importance import PER_TOKEN_METHODS, HeadScores, score
from headlab.models.base import HeadModel
from headlab.models.export import export_hf, hf_expressible
from headlab.models.loading import load
from headlab.objectives import objective_for
from headlab.overview import overview
from headlab.pruning import copy_model, prune
from headlab.recovery import recover
from headlab.results import BeforeAfter, DataSummary, Latency, QualityFigures, RunResult
from headlab.schedule import prune_to_target
from headlab.selection import heads_to_keep

log = logging.getLogger("headlab")


def default_out(cfg: RunConfig) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = Path(cfg.model).name if Path(cfg.model).exists() else cfg.model.replace("/", "_")
    keep = f"keep{cfg.keep:g}" if cfg.keep is not None else (
        f"prune{cfg.prune}" if cfg.prune is not None else cfg.command)
    return Path("reports") / f"{name}-{cfg.method}-{keep}-{stamp}"


def set_status(out: Path, status: str, **extra: Any) -> None:
    atomic_write_json(out / "status.json", {"status": status, "time": _now(), **extra})


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_model(cfg: RunConfig) -> HeadModel:
    return load(cfg.model, device=resolve_device(cfg.device), dtype=DTYPES[cfg.dtype])


def build_data(cfg: RunConfig, model: HeadModel) -> tuple[Blocks, Blocks, int]:
    """Token blocks split into (scoring, held-out), prepared on the unpruned model by
    its objective; and the block length used."""
    if model.tokenizer is None:
        raise UserError(f"{cfg.model} has no tokenizer files; headlab needs one to read text")
    objective = objective_for(model)
    limit = model.max_positions
    seq_len = cfg.seq_len or min(objective.default_seq_len, limit)
    if seq_len > limit:
        log.warning("--seq-len %d exceeds the model's %d positions; truncating to %d",
                    seq_len, limit, limit)
        seq_len = limit
    texts = load_texts(cfg.data, text_column=cfg.text_column, label_column=cfg.label_column)
    if texts.warning:
        log.warning(texts.warning)
    blocks = objective.make_blocks(texts, model.tokenizer, seq_len=seq_len,
                                   max_tokens=cfg.max_tokens)
    scoring, heldout = split_blocks(blocks, heldout=cfg.heldout, seed=cfg.seed)
    scoring = objective.prepare(model, scoring, batch_size=cfg.batch_size, seed=cfg.seed)
    heldout = objective.prepare(model, heldout, batch_size=cfg.batch_size, seed=cfg.seed + 1)
    return scoring, heldout, seq_len


@torch.inference_mode()
def compare_latency(before: HeadModel, after: HeadModel, batch: int, seq_len: int,
                    rounds: int = 7) -> tuple[float, float]:
    """Median forward times (ms) of two models on the same random tokens (batch,
    seq_len), timed in alternating rounds after a warm-up of each, so that a slow spell
    of a shared machine falls on both."""
    from headlab._timing import time_interleaved

    seq_len = min(seq_len, before.max_positions)
    vocab = before.tokenizer.vocab_size if before.tokenizer is not None else 100
    ids = torch.randint(0, max(2, min(vocab, 1000)), (batch, seq_len),
                        generator=torch.Generator().manual_seed(0)).to(before.device)
    t = time_interleaved({"before": lambda: before(ids), "after": lambda: after(ids)},
                         repeats=rounds, warmup=1, device=before.device.type)
    return (1000 * statistics.median(t["before"]), 1000 * statistics.median(t["after"]))


def _versions() -> dict[str, str]:
    import transformers

    return {"headlab": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def run(cfg: RunConfig | None, *, resume: Path | None = None) -> tuple[Path, RunResult]:
    """Carry out a prune or score run; return its directory and result.

    The model and data are loaded and the target checked against the model's heads
    before the run directory is created, so bad input leaves nothing behind; from then
    on status.json says running / interrupted / failed / complete, and checkpoints let
    ``resume=RUN_DIR`` finish an interrupted run with the result an uninterrupted one
    would have had. Under torchrun every rank computes, rank 0 alone writes.
    """
    if resume is not None:
        cfg = resume_config(resume)
    cfg = cfg.validated()
    distributed.init_from_env(resolve_device(cfg.device))
    main = distributed.is_main()
    out = resume or (Path(cfg.out) if cfg.out else default_out(cfg))
    if resume is None and out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise UserError(f"run directory {out} already exists; pass --overwrite or another --out")
    out = Path(distributed.broadcast(str(out)))
    model = load_model(cfg)
    n_keep = None
    if cfg.command == "prune":
        n_keep = heads_to_keep(model.n_layers * model.n_original_heads, keep=cfg.keep,
                               prune=cfg.prune)
    scoring, heldout, seq_len = build_data(cfg, model)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        if resume is None:
            for stale in out.glob("checkpoint*.pt"):  # --overwrite starts over
                stale.unlink()
        atomic_write_json(out / "config.json", cfg.to_dict())
        set_status(out, "running")
    stage = _Stage(cfg, out, model, scoring, heldout, seq_len)
    try:
        distributed.barrier()
        stage.checkpoint = Checkpoint(out, every=cfg.checkpoint_every)
        result = stage.prune(n_keep) if n_keep is not None else stage.score_only()
    except KeyboardInterrupt:
        if main:
            set_status(out, "interrupted", resume=f"headlab {cfg.command} --resume {out}")
        raise
    except BaseException as exc:
        if main:
            set_status(out, "failed", error=f"{type(exc).__name__}: {exc}")
        raise
    stage.checkpoint.clear()
    if main:
        set_status(out, "complete")
    distributed.barrier()  # no rank leaves (and tears down the group) while rank 0 writes
    return out, result


def resume_config(run_dir: Path) -> RunConfig:
    """The configuration an interrupted run was started with."""
    cfg_file = Path(run_dir) / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{run_dir} has no config.json: not a headlab run directory")
    status_file = Path(run_dir) / "status.json"
    if status_file.is_file() and json.loads(status_file.read_text()).get("status") == "complete":
        raise UserError(f"{run_dir} is complete: there is nothing to resume")
    return RunConfig.from_dict(json.loads(cfg_file.read_text()))


@dataclass
class _Shape:
    """The size of a model: what a prune run reports before and after."""

    params: int
    heads: list[int]
    kv_heads: list[int]
    kv_bytes: int

    @classmethod
    def of(cls, model: HeadModel) -> _Shape:
        return cls(model.num_parameters(), model.heads_per_layer, model.kv_heads_per_layer,
                   model.kv_cache_bytes_per_token())


class _Stage:
    """The two kinds of run on a loaded model and its prepared data."""

    checkpoint: Checkpoint

    def __init__(self, cfg: RunConfig, out: Path, model: HeadModel, scoring: Blocks,
                 heldout: Blocks, seq_len: int) -> None:
        self.cfg, self.out, self.model = cfg, out, model
        self.scoring, self.heldout, self.seq_len = scoring, heldout, seq_len
        self.score_kwargs = {"normalize": cfg.normalize, "global_minmax": cfg.global_minmax,
                             "per_token": cfg.per_token, "probes": cfg.probes}

    def _result(self, scores: HeadScores, **measured: Any) -> RunResult:
        """The run's RunResult: what every run records, plus what this one measured."""
        cfg, model, scoring, heldout = self.cfg, self.model, self.scoring, self.heldout
        return RunResult(
            model=cfg.model, method=cfg.method, importance=scores.scores,
            heads_total=model.n_layers * model.n_original_heads, family=model.family,
            kind=model.kind, schedule=cfg.schedule if cfg.command == "prune" else None,
            keep=cfg.keep,
            data=DataSummary(
                spec=scoring.spec, scoring_tokens=scoring.n_tokens,
                heldout_tokens=heldout.n_tokens, scoring_examples=len(scoring),
                heldout_examples=len(heldout), seq_len=self.seq_len,
                warning=BUNDLED_WARNING if scoring.spec == BUNDLED_SPEC else None),
            importance_normalisation=scores.normalisation,
            config=cfg.to_dict(), created=_now(), versions=_versions(), **measured)

    def score_only(self) -> RunResult:
        cfg, model = self.cfg, self.model
        scores = score(model, self.scoring, method=cfg.method, batch_size=cfg.batch_size,
                       seed=cfg.seed, checkpoint=self.checkpoint, **self.score_kwargs)
        q = evaluate(model, self.heldout, batch_size=cfg.batch_size)
        shape = _Shape.of(model)
        result = self._result(
            scores,
            heads_per_layer=BeforeAfter(shape.heads), kv_heads_per_layer=BeforeAfter(
                shape.kv_heads),
            quality=QualityFigures(before=q.value, metric=q.metric,
                                   higher_is_better=q.higher_is_better, loss_before=q.loss),
            params=BeforeAfter(shape.params),
            kv_cache_bytes_per_token=BeforeAfter(shape.kv_bytes))
        if distributed.is_main():
            result.sample, result.statistics, result.clusters = self._overview()
        self._finish(result, scores)
        return result

    def prune(self, n_keep: int) -> RunResult:
        cfg, model, main = self.cfg, self.model, distributed.is_main()
        before = _Shape.of(model)
        curves = {}
        for method in [m for m in cfg.compare if m != cfg.method]:
            log.info("comparison curve: %s", method)
            # the run's options where they apply: per-token gates to michel and fisher only
            curves[method] = self._schedule(method, n_keep, per_token=(
                cfg.per_token and method in PER_TOKEN_METHODS)).curve
        log.info("scoring and pruning with %s (%s)", cfg.method, cfg.schedule)
        res = self._schedule(cfg.method, n_keep, per_token=cfg.per_token, on_step=lambda p:
                             log.info("  %.0f%% pruned: quality %.4g",
                                      100 * p.fraction_pruned, p.quality))
        curves[cfg.method] = res.curve
        # the model stays as it came: the reference for timing, overview and repair
        pruned = prune(copy_model(model), res.plan)
        latency = None
        if main:
            log.info("timing the pruned model against the unpruned one")
            lat_s = min(cfg.latency_seq_len, self.seq_len)
            t_before, t_after = compare_latency(model, pruned, cfg.latency_batch, lat_s)
            latency = Latency(t_before, t_after, batch=cfg.latency_batch, seq_len=lat_s)
        result_overview = self._overview() if main else None
        q_after = q_pruned = evaluate(pruned, self.heldout, batch_size=cfg.batch_size)
        recovery = None
        if cfg.recover != "none":
            log.info("repairing the pruned model with %s", cfg.recover)
            recovery = recover(pruned, model, self.scoring, method=cfg.recover,
                               batch_size=cfg.batch_size, **self._recover_options())
            q_after = evaluate(pruned, self.heldout, batch_size=cfg.batch_size)
            log.info("  %s: %.4g pruned, %.4g repaired", q_after.metric, q_pruned.value,
                     q_after.value)
        after = _Shape.of(pruned)
        if main:
            pruned.save(self.out / "model")
        export_note = None
        if cfg.export == "hf" and main:
            reason = hf_expressible(pruned)
            if reason is None:
                export_hf(pruned, self.out / "model-hf")
                export_note = "model-hf/"
            else:
                export_note = (f"not exported to HF format: {reason}; the headlab format is "
                               "in model/")
                log.warning(export_note)
        q_before = res.curve[0]
        result = self._result(
            res.scores, heads_kept=res.plan.n_kept, kept_heads=res.plan.kept,
            heads_per_layer=BeforeAfter(before.heads, after.heads),
            kv_heads_per_layer=BeforeAfter(before.kv_heads, after.kv_heads),
            quality=QualityFigures(
                q_before.quality, q_after.value, metric=q_after.metric,
                higher_is_better=q_after.higher_is_better, loss_before=q_before.loss,
                loss_after=q_after.loss,
                pruned=q_pruned.value if recovery is not None else None,
                loss_pruned=q_pruned.loss if recovery is not None else None),
            recovery=recovery,
            curve=res.curve, curves=curves, params=BeforeAfter(before.params, after.params),
            latency_ms=latency,
            kv_cache_bytes_per_token=BeforeAfter(before.kv_bytes, after.kv_bytes),
            export=export_note)
        if result_overview is not None:
            result.sample, result.statistics, result.clusters = result_overview
        self._finish(result, res.scores)
        return result

    def _schedule(self, method: str, n_keep: int, *, per_token: bool, on_step=None):
        cfg = self.cfg
        return prune_to_target(
            self.model, self.scoring, self.heldout, method=method, n_keep=n_keep,
            schedule=cfg.schedule, step=cfg.step, per_layer=cfg.per_layer,
            min_heads_per_layer=cfg.min_heads_per_layer, batch_size=cfg.batch_size,
            seed=cfg.seed, score_kwargs={**self.score_kwargs, "per_token": per_token},
            checkpoint=self.checkpoint, on_step=on_step,
            **({"recover": cfg.recover, "recover_kwargs": self._recover_options()}
               if cfg.recover_every_step else {}))

    def _recover_options(self) -> dict[str, Any]:
        """The options the run's recovery method takes: the ridge for the least-squares
        fits (and distill's lsq start), the training settings for distill, which is
        checkpointed with the run."""
        cfg = self.cfg
        options: dict[str, Any] = {}
        if cfg.recover in ("lsq", "rescale", "distill") and cfg.recover_ridge is not None:
            options["ridge"] = cfg.recover_ridge
        if cfg.recover == "distill":
            options.update(tokens=cfg.recover_tokens, params=cfg.recover_params,
                           lr=cfg.recover_lr, temperature=cfg.recover_temperature,
                           seed=cfg.seed, checkpoint=self.checkpoint)
        return options

    def _overview(self):
        """The unpruned model's sample, statistics and clusters, for the report."""
        log.info("analysing heads on a held-out sample")
        return overview(self.model, self.heldout, sample_tokens=self.cfg.sample_tokens,
                        seed=self.cfg.seed)

    def _finish(self, result: RunResult, scores: HeadScores) -> None:
        from headlab.report import build_report

        if not distributed.is_main():
            return
        out = self.out
        scores.save_csv(out / "importance.csv")
        result.files = {"results": "results.json", "importance_csv": "importance.csv",
                        "config": "config.json"}
        if (out / "model").exists():
            result.files["model"] = "model/"
        result.status = "complete"
        atomic_write_json(out / "results.json", result.to_json())
        build_report(result, out / "report.html")
