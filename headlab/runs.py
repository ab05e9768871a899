"""A run: one configuration, one directory, one results.json.

`RunConfig` is what a user sets (CLI flags or a TOML recipe); `run` carries it out
through the public API (load, data, score, select, prune, evaluate) and writes the run
directory: config.json (to repeat it exactly), results.json, importance.csv,
report.html, model/ and status.json (running / interrupted / complete).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from headlab import __version__, distributed
from headlab._io import atomic_write_json
from headlab.checkpoint import Checkpoint
from headlab.config import DTYPES, RunConfig, resolve_device
from headlab.data import (
    BUNDLED_SPEC,
    BUNDLED_WARNING,
    load_texts,
    make_blocks,
    split_blocks,
)
from headlab.errors import UserError
from headlab.evaluate import evaluate, prepare
from headlab.importance import PER_TOKEN_METHODS, score
from headlab.models.base import HeadModel
from headlab.models.loading import load
from headlab.pruning import (
    export_hf,
    gates_restored,
    hf_expressible,
    prune,
    prune_to_target,
)

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
    from headlab.models.loading import ModelNotFoundError

    try:
        return load(cfg.model, device=resolve_device(cfg.device), dtype=DTYPES[cfg.dtype])
    except ModelNotFoundError as exc:
        raise UserError(str(exc)) from exc


def build_data(cfg: RunConfig, model: HeadModel):
    """Token blocks split into (scoring, held-out), prepared on the unpruned model."""
    from headlab.data import DataError

    if model.tokenizer is None:
        raise UserError(f"{cfg.model} has no tokenizer files; headlab needs one to read text")
    limit = model.max_positions
    default = 256 if model.kind in ("causal-lm", "masked-lm") else 128
    seq_len = cfg.seq_len or min(default, limit)
    if seq_len > limit:
        log.warning("--seq-len %d exceeds the model's %d positions; truncating to %d",
                    seq_len, limit, limit)
        seq_len = limit
    try:
        texts = load_texts(cfg.data, text_column=cfg.text_column, label_column=cfg.label_column)
        if texts.warning:
            log.warning(texts.warning)
        blocks = make_blocks(texts, model.tokenizer, kind=model.kind, seq_len=seq_len,
                             max_tokens=cfg.max_tokens)
        scoring, heldout = split_blocks(blocks, heldout=cfg.heldout, seed=cfg.seed)
    except DataError as exc:
        raise UserError(str(exc)) from exc
    scoring = prepare(model, scoring, batch_size=cfg.batch_size, seed=cfg.seed)
    heldout = prepare(model, heldout, batch_size=cfg.batch_size, seed=cfg.seed + 1)
    return scoring, heldout, seq_len


@torch.inference_mode()
def compare_latency(before: HeadModel, after: HeadModel, batch: int, seq_len: int,
                    rounds: int = 7) -> tuple[float, float]:
    """Median forward times (ms) of two models on the same random tokens (batch,
    seq_len), timed in alternating rounds after a warm-up of each, so that a slow spell
    of a shared machine falls on both."""
    from headlab.bench import time_interleaved

    seq_len = min(seq_len, before.max_positions)
    vocab = before.tokenizer.vocab_size if before.tokenizer is not None else 100
    ids = torch.randint(0, max(2, min(vocab, 1000)), (batch, seq_len),
                        generator=torch.Generator().manual_seed(0)).to(before.device)
    t = time_interleaved({"before": lambda: before(ids), "after": lambda: after(ids)},
                         repeats=rounds, warmup=1, device=before.device.type)
    return (1000 * statistics.median(t["before"]), 1000 * statistics.median(t["after"]))


@torch.no_grad()
def head_analysis(model: HeadModel, heldout, cfg: RunConfig) -> dict[str, Any]:
    """The sample's attention (8-bit), per-head statistics and clusters, on the
    unpruned model, for the report."""
    from headlab.analysis import HeadStatsAccumulator, TokenRoles, cluster_heads
    from headlab.hooks import capture
    from headlab.report import encode_attention

    tok = model.tokenizer
    n = min(cfg.sample_tokens, heldout.input_ids.shape[1])
    ids = heldout.input_ids[:1, :n]
    valid = heldout.attention_mask[:1, :n]
    n = int(valid.sum())
    ids, valid = ids[:, :n], valid[:, :n]
    with capture(model, "pattern") as cap:
        model(ids.to(model.device), attention_mask=valid.to(model.device))
    # (L, H_original, S, S): heads a pruned model no longer has stay all-zero
    full = torch.zeros(model.n_layers, model.n_original_heads, n, n)
    for layer, (pat, ids_l) in enumerate(zip(cap.stack("pattern"), model.head_ids(),
                                            strict=True)):
        full[layer, ids_l] = pat[0].float().cpu()
    tokens = tok.convert_ids_to_tokens(ids[0].tolist())
    sample = {"text": tok.decode(ids[0].tolist()), "tokens": [_pretty(t) for t in tokens],
              "attention": encode_attention(full.numpy())}

    acc = HeadStatsAccumulator(model.n_layers)
    rows = min(len(heldout), 4)
    width = min(heldout.input_ids.shape[1], 128)
    for start in range(rows):
        bids = heldout.input_ids[start : start + 1, :width]
        bmask = heldout.attention_mask[start : start + 1, :width]
        with capture(model, "pattern") as cap:
            model(bids.to(model.device), attention_mask=bmask.to(model.device))
        toks = [tok.convert_ids_to_tokens(bids[0].tolist())]
        roles = TokenRoles.from_tokens(toks, cls_token=tok.cls_token, sep_token=tok.sep_token,
                                       valid=bmask.bool())
        acc.update([p.float().cpu() for p in cap.stack("pattern")], roles,
                   head_ids=model.head_ids())
    stats = acc.result()
    clusters = None
    try:
        clusters = cluster_heads(stats, seed=cfg.seed).to_json()
    except ValueError as exc:
        log.warning("head clustering skipped: %s", exc)
    return {"sample": sample, "statistics": stats.to_records(), "clusters": clusters}


def _pretty(token: str) -> str:
    return token.replace("Ġ", " ").replace("▁", " ").replace("Ċ", "\\n")


def _versions() -> dict[str, str]:
    import transformers

    return {"headlab": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def run(cfg: RunConfig, *, resume: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Carry out a prune or score run; return its directory and results.

    The model and data are loaded before the run directory is created, so bad input
    leaves nothing behind; from then on status.json says running / interrupted /
    failed / complete, and checkpoints let ``resume=RUN_DIR`` finish an interrupted
    run with the result an uninterrupted one would have had. Under torchrun every rank
    computes, rank 0 alone writes.
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
    scoring, heldout, seq_len = build_data(cfg, model)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        if resume is None:
            for stale in out.glob("checkpoint*.pt"):  # --overwrite starts over
                stale.unlink()
        atomic_write_json(out / "config.json", cfg.to_dict())
        set_status(out, "running")
    stage = _prune if cfg.command == "prune" else _score_only
    try:
        distributed.barrier()
        checkpoint = Checkpoint(out, every=cfg.checkpoint_every)
        results = stage(cfg, out, model, scoring, heldout, seq_len, checkpoint)
    except KeyboardInterrupt:
        if main:
            set_status(out, "interrupted", resume=f"headlab {cfg.command} --resume {out}")
        raise
    except BaseException as exc:
        if main:
            set_status(out, "failed", error=f"{type(exc).__name__}: {exc}")
        raise
    checkpoint.clear()
    if main:
        set_status(out, "complete")
    return out, results


def resume_config(run_dir: Path) -> RunConfig:
    """The configuration an interrupted run was started with."""
    cfg_file = Path(run_dir) / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{run_dir} has no config.json: not a headlab run directory")
    status_file = Path(run_dir) / "status.json"
    if status_file.is_file() and json.loads(status_file.read_text()).get("status") == "complete":
        raise UserError(f"{run_dir} is complete: there is nothing to resume")
    return RunConfig.from_dict(json.loads(cfg_file.read_text()))


def _base_results(cfg: RunConfig, model: HeadModel, scoring, heldout, seq_len) -> dict:
    return {
        "model": cfg.model, "family": model.family, "kind": model.kind,
        "method": cfg.method, "schedule": cfg.schedule if cfg.command == "prune" else None,
        "keep": cfg.keep,
        "data": {"spec": scoring.spec, "scoring_tokens": scoring.n_tokens,
                 "heldout_tokens": heldout.n_tokens, "scoring_examples": len(scoring),
                 "heldout_examples": len(heldout), "seq_len": seq_len,
                 "warning": BUNDLED_WARNING if scoring.spec == BUNDLED_SPEC else None},
        "heads_total": model.n_layers * model.n_original_heads,
        "config": cfg.to_dict(), "created": _now(), "versions": _versions(),
    }


def _finish(out: Path, results: dict, scores) -> None:
    from headlab.report import build_report

    if not distributed.is_main():
        return
    scores.save_csv(out / "importance.csv")
    results["files"] = {"results": "results.json", "importance_csv": "importance.csv",
                        "config": "config.json"}
    if (out / "model").exists():
        results["files"]["model"] = "model/"
    results["status"] = "complete"
    atomic_write_json(out / "results.json", _json_safe(results))
    build_report(results, out / "report.html")


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def _score_only(cfg: RunConfig, out: Path, model, scoring, heldout, seq_len,
                checkpoint) -> dict:
    scores = score(model, scoring, method=cfg.method, batch_size=cfg.batch_size,
                   normalize=cfg.normalize, global_minmax=cfg.global_minmax,
                   per_token=cfg.per_token, probes=cfg.probes, seed=cfg.seed,
                   checkpoint=checkpoint)
    q = evaluate(model, heldout, batch_size=cfg.batch_size)
    results = _base_results(cfg, model, scoring, heldout, seq_len)
    results.update({
        "heads_kept": None, "kept_heads": None, "importance": scores.scores,
        "importance_normalisation": scores.normalisation,
        "heads_per_layer": {"before": model.heads_per_layer, "after": None},
        "kv_heads_per_layer": {"before": model.kv_heads_per_layer, "after": None},
        "quality": {"metric": q.metric, "higher_is_better": q.higher_is_better,
                    "before": q.value, "after": None, "loss_before": q.loss, "loss_after": None},
        "curve": [], "params": {"before": model.num_parameters(), "after": None},
        "latency_ms": None, "kv_cache_bytes_per_token": {
            "before": model.kv_cache_bytes_per_token(), "after": None},
    })
    if distributed.is_main():
        results.update(head_analysis(model, heldout, cfg))
    _finish(out, results, scores)
    return results


def _prune(cfg: RunConfig, out: Path, model, scoring, heldout, seq_len, checkpoint) -> dict:
    main = distributed.is_main()
    results = _base_results(cfg, model, scoring, heldout, seq_len)
    lat_b, lat_s = cfg.latency_batch, min(cfg.latency_seq_len, seq_len)
    before = {
        "params": model.num_parameters(), "heads": model.heads_per_layer,
        "kv": model.kv_heads_per_layer, "kv_bytes": model.kv_cache_bytes_per_token(),
        "gates": [g.clone() for g in model.gates()],
    }
    analysis = {}
    if main:
        log.info("analysing heads on a held-out sample")
        analysis = head_analysis(model, heldout, cfg)

    kw = {"normalize": cfg.normalize, "global_minmax": cfg.global_minmax,
          "per_token": cfg.per_token, "probes": cfg.probes}
    curves: dict[str, list[dict]] = {}
    for method in [m for m in cfg.compare if m != cfg.method]:
        # the run's options where they apply: per-token gates to michel and fisher only
        method_kw = {**kw, "per_token": cfg.per_token and method in PER_TOKEN_METHODS}
        log.info("comparison curve: %s", method)
        with gates_restored(model):  # the next method starts from the unpruned gates
            res = prune_to_target(model, scoring, heldout, method=method, keep=cfg.keep,
                                  prune=cfg.prune, schedule=cfg.schedule, step=cfg.step,
                                  per_layer=cfg.per_layer,
                                  min_heads_per_layer=cfg.min_heads_per_layer,
                                  batch_size=cfg.batch_size, seed=cfg.seed, score_kwargs=method_kw,
                                  checkpoint=checkpoint)
        curves[method] = res.curve

    log.info("scoring and pruning with %s (%s)", cfg.method, cfg.schedule)
    res = prune_to_target(model, scoring, heldout, method=cfg.method, keep=cfg.keep,
                          prune=cfg.prune, schedule=cfg.schedule, step=cfg.step,
                          per_layer=cfg.per_layer, min_heads_per_layer=cfg.min_heads_per_layer,
                          batch_size=cfg.batch_size, seed=cfg.seed, score_kwargs=kw,
                          checkpoint=checkpoint, on_step=lambda p: log.info(
                              "  %.0f%% pruned: %s %.4g", 100 * p["fraction_pruned"],
                              "quality", p["quality"]))
    curves[cfg.method] = res.curve
    q_before = res.curve[0]
    latency = (None, None)
    if main:  # the model as it came (its gates as they were) against a pruned copy
        log.info("timing the pruned model against the unpruned one")
        pruned = prune(model, res.plan, inplace=False)
        model.set_gates(before["gates"])  # prune() below follows the plan, not the gates
        latency = compare_latency(model, pruned, lat_b, lat_s)
        del pruned
    prune(model, res.plan)
    q_after = evaluate(model, heldout, batch_size=cfg.batch_size)
    after = {
        "params": model.num_parameters(), "heads": model.heads_per_layer,
        "kv": model.kv_heads_per_layer, "kv_bytes": model.kv_cache_bytes_per_token(),
    }
    if main:
        model.save(out / "model")
    export_note = None
    if cfg.export == "hf" and main:
        reason = hf_expressible(model)
        if reason is None:
            export_hf(model, out / "model-hf")
        else:
            export_note = f"not exported to HF format: {reason}; the headlab format is in model/"
            log.warning(export_note)

    from headlab.evaluate import METRICS

    metric, higher = METRICS[model.kind]
    results.update({
        "heads_kept": res.plan.n_kept,
        "kept_heads": {str(k): v for k, v in res.plan.kept.items()},
        "importance": res.scores.scores,
        "importance_normalisation": res.scores.normalisation,
        "heads_per_layer": {"before": before["heads"], "after": after["heads"]},
        "kv_heads_per_layer": {"before": before["kv"], "after": after["kv"]},
        "quality": {"metric": metric, "higher_is_better": higher,
                    "before": q_before["quality"], "after": q_after.value,
                    "loss_before": q_before["loss"], "loss_after": q_after.loss},
        "curve": res.curve,
        "curves": curves,
        "params": {"before": before["params"], "after": after["params"]},
        "latency_ms": {"before": latency[0], "after": latency[1],
                       "batch": lat_b, "seq_len": lat_s},
        "kv_cache_bytes_per_token": {"before": before["kv_bytes"], "after": after["kv_bytes"]},
        "export": export_note or ("model-hf/" if cfg.export == "hf" else None),
    })
    results.update(analysis)
    _finish(out, results, res.scores)
    return results
