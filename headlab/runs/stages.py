"""The stages of a run on a loaded model and its prepared data: score only, or score,
prune (or demote), repair and measure; each ends in a `RunResult` and the files of the
run directory."""

from __future__ import annotations

import datetime as _dt
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headlab import __version__
from headlab._util.checkpoint import Checkpoint
from headlab._util.io import atomic_dir, atomic_write_json
from headlab._util.progress import spinner, track
from headlab._util.timing import others_load
from headlab.analysis.overview import overview
from headlab.data.blocks import Blocks
from headlab.data.texts import BUNDLED_SPEC, BUNDLED_WARNING
from headlab.detectors import detect, kinds_for
from headlab.errors import UserError
from headlab.evaluate.cache import KVCacheReport, measure_decode
from headlab.evaluate.latency import compare_latency
from headlab.evaluate.quality import evaluate
from headlab.importance import PER_TOKEN_METHODS, HeadScores, score
from headlab.models.base import HeadModel
from headlab.models.export import export_hf, hf_expressible
from headlab.models.flops import count_flops
from headlab.objectives import objective_for
from headlab.parallel.sharding import load_sharded, save_sharded
from headlab.pruning import (
    copy_model,
    demote,
    demoted_heads,
    demotion_group_score,
    demotion_scores,
    prune,
)
from headlab.recovery import recover
from headlab.results import (
    BeforeAfter,
    DataSummary,
    Latency,
    LengthLatency,
    QualityFigures,
    RunResult,
)
from headlab.runs.config import RunConfig
from headlab.runs.inputs import data_separation
from headlab.runs.placement import Placement
from headlab.schedule import prune_to_target
from headlab.selection import PrunePlan

if TYPE_CHECKING:
    from headlab.evaluate.needle import NeedleResult

log = logging.getLogger("headlab")


def now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


LONG_LATENCY = 2048  # tokens: the run's second latency length, capped by the positions
# interleaved rounds of each model at the long length: a forward there is seconds on a
# CPU (Gemma-3-270M's, with its 262k-token vocabulary, about ten), so fewer than the 7
# of the short one
LONG_LATENCY_ROUNDS = 3


def versions() -> dict[str, str]:
    import transformers

    return {"headlab": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def task_metrics(cfg: RunConfig, model: HeadModel) -> dict[str, dict[str, Any]]:
    """The lm-eval metrics of ``model`` on the run's tasks (``--tasks``, less the needle).
    lm-eval is imported only for a run that asks for its tasks."""
    from headlab.evaluate.lm_eval import run_tasks

    return run_tasks(model, [t for t in cfg.tasks if t != "needle"],
                     include_path=cfg.include_path, limit=cfg.limit,
                     num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size, seed=cfg.seed,
                     trust_code=cfg.trust_task_code)


def needle_grid(cfg: RunConfig, model: HeadModel) -> NeedleResult:
    """The needle test of ``model`` at the run's lengths, on its evaluation data."""
    from headlab.evaluate.needle import needle_test

    return needle_test(model, lengths=cfg.needle_lengths or None, filler=cfg.eval_data,
                       seed=cfg.seed, batch_size=cfg.batch_size)


@dataclass
class Shape:
    """The size of a model: what a prune run reports before and after."""

    params: int
    heads: list[int]
    kv_heads: list[int]
    kv_bytes: int

    @classmethod
    def of(cls, model: HeadModel) -> Shape:
        return cls(model.num_parameters(), model.heads_per_layer, model.kv_heads_per_layer,
                   model.kv_cache_bytes_per_token())


class Stage:
    """The two kinds of run on a loaded model and its prepared data."""

    checkpoint: Checkpoint
    alphas: list[list[float]] | None = None  # --demote-by gates: per layer and group

    def __init__(self, cfg: RunConfig, out: Path, model: HeadModel, scoring: Blocks,
                 heldout: Blocks, seq_len: int, placement: Placement | None = None) -> None:
        self.cfg, self.out, self.model = cfg, out, model
        self.place = placement or Placement.here(model)
        self.scoring, self.heldout, self.seq_len = scoring, heldout, seq_len
        self.score_kwargs = {"normalize": cfg.normalize, "global_minmax": cfg.global_minmax,
                             "per_token": cfg.per_token, "probes": cfg.probes,
                             "gate_steps": cfg.gate_steps, "gate_lr": cfg.gate_lr,
                             "gate_lagrange_lr": cfg.gate_lagrange_lr,
                             "gate_budget": cfg.gate_budget, "gate_batch": cfg.gate_batch,
                             "gate_sample": cfg.gate_sample}

    def _result(self, scores: HeadScores, **measured: Any) -> RunResult:
        """The run's RunResult: what every run records, plus what this one measured."""
        cfg, model, scoring, heldout = self.cfg, self.model, self.scoring, self.heldout
        return RunResult(
            model=cfg.model, method=cfg.demote_by or cfg.method, importance=scores.scores,
            heads_total=model.n_layers * model.n_original_heads, family=model.family,
            kind=model.kind, schedule=None if cfg.command != "prune" else "one-shot"
            if cfg.demote_by else cfg.schedule_of(cfg.method),
            keep=cfg.keep,
            data=DataSummary(
                spec=scoring.spec, scoring_tokens=scoring.n_tokens,
                heldout_tokens=heldout.n_tokens, scoring_examples=len(scoring),
                heldout_examples=len(heldout), seq_len=self.seq_len,
                warning=BUNDLED_WARNING if scoring.spec == BUNDLED_SPEC else None,
                eval_spec=heldout.spec, eval_protocol=cfg.eval_protocol,
                eval_seq_len=heldout.input_ids.shape[1] if cfg.eval_protocol == "windows"
                else None, calib_samples=cfg.calib_samples,
                calib_seq_len=scoring.input_ids.shape[1] if cfg.calib_samples else None,
                separation=data_separation(cfg)),
            importance_normalisation=scores.normalisation,
            scoring_details=scores.extra,
            config=cfg.to_dict(), created=now(), versions=versions(), **measured)

    def score_only(self, target: int | None = None) -> RunResult:
        """Score the heads; ``target``: the heads (or groups) gates train toward."""
        cfg, model = self.cfg, self.model
        scores = score(model, self.scoring, method=cfg.method, batch_size=cfg.batch_size,
                       seed=cfg.seed, checkpoint=self.checkpoint, target=target,
                       unit=cfg.unit, **self.score_kwargs)
        q = evaluate(model, self.heldout, batch_size=cfg.batch_size)
        shape = Shape.of(model)
        result = self._result(
            scores,
            heads_per_layer=BeforeAfter(shape.heads), kv_heads_per_layer=BeforeAfter(
                shape.kv_heads),
            quality=QualityFigures(before=q.value, metric=q.metric,
                                   higher_is_better=q.higher_is_better, loss_before=q.loss),
            params=BeforeAfter(shape.params),
            kv_cache_bytes_per_token=BeforeAfter(shape.kv_bytes))
        if self.place.analyses:
            result.sample, result.statistics, result.clusters = self._overview()
        self._tasks(result, model, None)
        self._finish(result, scores)
        return result

    def prune(self, n_keep: int) -> RunResult:
        cfg, model, place = self.cfg, self.model, self.place
        before = Shape.of(model)
        curves = {}
        for method in [m for m in cfg.compare if m != cfg.method]:
            log.info("comparison curve: %s", method)
            # the run's options where they apply: per-token gates to michel and fisher only
            curves[method] = self._schedule(method, n_keep, per_token=(
                cfg.per_token and method in PER_TOKEN_METHODS)).curve
        def on_step(p):
            log.info("  %.0f%% pruned: quality %.4g", 100 * p.fraction_pruned, p.quality)

        if cfg.demote_by is None:
            log.info("scoring and pruning with %s (%s)", cfg.method, cfg.schedule_of(cfg.method))
            res = self._schedule(cfg.method, n_keep, per_token=cfg.per_token,
                                 on_step=on_step)
        else:  # the chooser's scores, once; the curve removes the groups in their order
            res = self._schedule(cfg.demote_by, n_keep, per_token=False, on_step=on_step,
                                 scores=self._demote_scores())
        curves[cfg.demote_by or cfg.method] = res.curve
        # the model stays as it came: the reference for timing, overview and repair
        plan, quality_removed = res.plan, None
        if cfg.demote:  # the groups the plan would remove keep a sink + window cache
            quality_removed = res.curve[-1].quality  # as measured with them removed
            pruned = demote(copy_model(model), plan.as_demotion(), sinks=cfg.sinks,
                            window=cfg.window)
        else:
            pruned = self._pruned(res.plan)
        latency = self._latency(pruned) if place.holds_whole else None
        result_overview = self._overview() if place.analyses else None
        q_after = q_pruned = evaluate(pruned, self.heldout, batch_size=cfg.batch_size)
        recovery = None
        if cfg.demote and cfg.recover != "none":
            log.info("demoted heads are kept, not removed: no repair (--recover %s skipped)",
                     cfg.recover)
        if cfg.recover != "none" and not cfg.demote:
            log.info("repairing the pruned model with %s", cfg.recover)
            recovery = recover(pruned, model, self.scoring, method=cfg.recover,
                               batch_size=cfg.batch_size, **self._recover_options())
            q_after = evaluate(pruned, self.heldout, batch_size=cfg.batch_size)
            log.info("  %s: %.4g pruned, %.4g repaired", q_after.metric, q_pruned.value,
                     q_after.value)
        after = Shape.of(pruned)
        self._save(pruned, repaired=recovery is not None)
        export_note = self._export(pruned) if cfg.export == "hf" and place.writes else None
        q_before = res.curve[0]
        result = self._result(
            res.scores, heads_kept=plan.n_kept, kept_heads=plan.kept,
            removal_scores=res.removal_scores(),
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
        if place.writes:
            result.kv_cache = self._kv_cache(pruned, quality_removed)
        if result_overview is not None:
            result.sample, result.statistics, result.clusters = result_overview
        self._tasks(result, model, pruned)
        self._finish(result, res.scores)
        return result

    def _pruned(self, plan: PrunePlan) -> HeadModel:
        """A pruned copy of the model; the model stays as it came."""
        if not self.place.sharded:
            return prune(copy_model(self.model), plan)
        # sharded: written block by block, read back sharded (no copy of the whole); a
        # model to repair is staged, model/ gets it once repaired
        staged = self.out / ("model" if self.cfg.recover == "none" else "model.pruned")
        return load_sharded(save_sharded(self.model, staged, plan),
                            device=str(self.model.device), dtype=self.model.dtype)[0]

    def _latency(self, pruned: HeadModel) -> Latency:
        """Forward times before and after at the run's short length (``latency_batch``
        rows) and, batch 1, at ``LONG_LATENCY`` tokens (within the model's positions),
        where the S^2 attention terms that head pruning removes weigh; each beside the
        drop the FLOPs predict."""
        cfg = self.cfg
        log.info("timing the pruned model against the unpruned one")
        short = min(cfg.latency_seq_len, self.seq_len, self.model.max_positions)
        long = min(LONG_LATENCY, self.model.max_positions)
        shapes = [(cfg.latency_batch, short, 7)]
        if long > short:
            shapes.append((1, long, LONG_LATENCY_ROUNDS))
        rows = []
        others = others_load()  # the summary says when they make the times noisy
        with spinner("timing the pruned model against the unpruned one"):
            for batch, seq_len, rounds in shapes:
                t_before, t_after = compare_latency(self.model, pruned, batch, seq_len,
                                                    rounds=rounds)
                flops = count_flops(self.model, batch, seq_len)["total"]
                drop = 1 - count_flops(pruned, batch, seq_len)["total"] / flops
                rows.append(LengthLatency(t_before, t_after, batch=batch, seq_len=seq_len,
                                          predicted_drop=drop))
        return Latency(rows[0].before, rows[0].after, batch=cfg.latency_batch,
                       seq_len=short, by_length=rows, others_load=others)

    def _save(self, pruned: HeadModel, *, repaired: bool) -> None:
        """model/: whole on rank 0, or block by block by every shard once repaired (an
        unrepaired sharded model was written there by `_pruned`)."""
        if self.place.holds_whole:
            with atomic_dir(self.out / "model") as staging:  # whole, or not at all
                pruned.save(staging)
        elif self.place.sharded and repaired:
            save_sharded(pruned, self.out / "model")
            if self.place.writes:
                shutil.rmtree(self.out / "model.pruned")

    def _export(self, pruned: HeadModel) -> str:
        """model-hf/, where plain transformers can express the pruned model; the note
        for results.json either way."""
        reason = hf_expressible(pruned)
        if reason is None:
            export_hf(pruned, self.out / "model-hf")
            return "model-hf/"
        note = f"not exported to HF format: {reason}; the headlab format is in model/"
        log.warning(note)
        return note

    def _demote_scores(self) -> HeadScores:
        """--demote-by's scores (`pruning.demotion_scores`); the gates' alphas are kept."""
        cfg = self.cfg
        log.info("choosing the demoted groups by %s", "DuoAttention's gates" if
                 cfg.demote_by == "gates" else f"the {cfg.demote_by} detector")
        scores = demotion_scores(self.model, cfg.demote_by, self.scoring, sinks=cfg.sinks,
                                 window=cfg.window, seed=cfg.seed, checkpoint=self.checkpoint,
                                 **({"steps": cfg.gate_steps, "lr": cfg.gate_lr,
                                     "reg": cfg.gate_reg} if cfg.demote_by == "gates" else {}))
        self.alphas = scores.extra.get("alphas")
        return scores

    def _kv_cache(self, pruned: HeadModel, quality_removed: float | None) -> KVCacheReport:
        """The cache before and after: bytes per token at the evaluation length and the
        model's maximum, and, for kv-group and demotion runs of a language model,
        decoding tokens/s at the evaluation length and four times it."""
        cfg, model = self.cfg, self.model
        limit = model.max_positions
        report = KVCacheReport(
            unit=cfg.unit, group_score=cfg.group_score if cfg.unit == "kv-group" else None,
            selection="gates" if cfg.demote_by == "gates" else f"{cfg.demote_by} detector"
            if cfg.demote_by else cfg.method, alphas=self.alphas,
            demoted=demoted_heads(pruned),
            sinks=cfg.sinks if cfg.demote else None,
            window=cfg.window if cfg.demote else None,
            eval_length=self.seq_len, max_length=limit,
            bytes_per_token_eval=(model.kv_cache_bytes_per_token(self.seq_len),
                                  pruned.kv_cache_bytes_per_token(self.seq_len)),
            bytes_per_token_max=(model.kv_cache_bytes_per_token(limit),
                                 pruned.kv_cache_bytes_per_token(limit)),
            quality_removed=quality_removed)  # the demoted groups removed instead
        if (cfg.unit == "kv-group" or cfg.demote) and objective_for(model).generates:
            log.info("timing decoding steps before and after")
            contexts = sorted({self.seq_len, min(4 * self.seq_len, limit)})
            report.decode = measure_decode(model, pruned, contexts=contexts,
                                           steps=cfg.decode_steps)
        return report

    def _tasks(self, result: RunResult, before: HeadModel, after: HeadModel | None) -> None:
        """lm-eval tasks and the needle test (``--tasks``) on the model as it came and
        on the model you get, into ``result.tasks`` and ``result.needle``."""
        cfg = self.cfg
        names = [t for t in cfg.tasks if t != "needle"]
        tasks, needle = {}, None
        runs = [("before", before)] + ([("after", after)] if after is not None else [])
        if names:
            measured = {}
            for side, m in runs:
                log.info("lm-eval tasks %s on the model %s pruning", ", ".join(names),
                         side)
                measured[side] = task_metrics(cfg, m)
            tasks = {name: BeforeAfter(measured["before"].get(name),
                                       measured.get("after", {}).get(name))
                     for name in measured["before"]}
        if "needle" in cfg.tasks:
            grids = {}
            for side, m in runs:
                log.info("needle test on the model %s pruning", side)
                grids[side] = needle_grid(cfg, m)
            needle = BeforeAfter(grids["before"], grids.get("after"))
        if names:
            from headlab.evaluate.lm_eval import lm_eval_version

            result.versions["lm_eval"] = lm_eval_version()
        result.tasks, result.needle = tasks, needle

    def _schedule(self, method: str, n_keep: int, *, per_token: bool, on_step=None,
                  scores: HeadScores | None = None):
        """The run's schedule with ``method``; given ``scores`` (--demote-by's), one shot
        on them, a gate's group scored by its max (each of its heads carries the gate)."""
        cfg = self.cfg
        return prune_to_target(
            self.model, self.scoring, self.heldout, method=method, n_keep=n_keep,
            schedule="one-shot" if scores is not None else cfg.schedule_of(method),
            scores=scores,
            step=cfg.step, per_layer=cfg.per_layer,
            min_heads_per_layer=cfg.min_heads_per_layer, batch_size=cfg.batch_size,
            seed=cfg.seed, score_kwargs={**self.score_kwargs, "per_token": per_token,
                                         # a comparison with random: the layer norm is moot
                                         **({"normalize": None} if method == "random" else {})},
            checkpoint=self.checkpoint, on_step=on_step, unit=cfg.unit,
            group_score=cfg.group_score if scores is None
            else demotion_group_score(method, cfg.group_score),
            **({"recover": cfg.recover, "recover_kwargs": self._recover_options()}
               if cfg.recover_every_step else {}))

    def _recover_options(self) -> dict[str, Any]:
        """The options the run's recovery method takes: the ridge for the least-squares
        fits (and distill's lsq start), the training settings for distill, which is
        checkpointed with the run."""
        cfg = self.cfg
        options: dict[str, Any] = {}
        if cfg.recover in ("lsq", "distill") and cfg.recover_ridge is not None:
            options["ridge"] = cfg.recover_ridge
        if cfg.recover == "distill":
            options.update(tokens=cfg.recover_tokens, params=cfg.recover_params,
                           lr=cfg.recover_lr, temperature=cfg.recover_temperature,
                           seed=cfg.seed, checkpoint=self.checkpoint)
        return options

    def _overview(self):
        """The unpruned model's sample, statistics and clusters, for the report."""
        log.info("analysing heads on a held-out sample")
        with spinner("analysing heads on a held-out sample"):
            return overview(self.model, self.heldout, sample_tokens=self.cfg.sample_tokens,
                            seed=self.cfg.seed)

    def _head_types(self) -> dict[str, list[list[float]]]:
        """The unpruned model's detector scores by kind, for the report's head types."""
        log.info("detecting head types")
        found = {}
        kinds = kinds_for(self.model)
        for kind in track(kinds, total=len(kinds), description="detecting head types"):
            try:
                found[kind] = detect(self.model, kind, n=8, seq_len=min(64, self.seq_len),
                                     seed=self.cfg.seed).scores
            except (UserError, ValueError) as exc:  # e.g. prompts longer than the positions
                log.warning("head type %s not detected: %s", kind, exc)
        return found

    def _finish(self, result: RunResult, scores: HeadScores) -> None:
        from headlab.report import build_report

        if self.place.analyses:
            result.head_types = self._head_types()
        if not self.place.writes:
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
