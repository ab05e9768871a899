"""Benchmarks behind `headlab bench`: every figure is a ratio to a reference run in the
same process, on the same weights and inputs, timed as `headlab._util.timing` describes.

    attention   headlab MultiHeadAttention vs torch.nn.MultiheadAttention and vs bare
                scaled_dot_product_attention between the same projections; KV-cache decode
                step time late in a 512-token decode vs early
    models      forward tokens/s vs transformers (sdpa) on the same weights: parity, as
                both run torch's products
    hooks       hook points present but idle vs the same forward with hooks switched off
                (`headlab.attention.hookpoint.hooks_disabled`); capturing every pattern vs a plain
                forward; capture memory
    importance  Michel scoring tokens/s vs plain forward+backward tokens/s
    pruning     latency drop of a model pruned to keep 0.5 vs the FLOP-predicted drop
    generate    SmolLM2 greedy decoding tokens/s with the decoding kernel vs torch's
                products and vs transformers' generate; the fraction of the
                memory-bandwidth bound; long context: tokens/s, cache bytes and held-out
                perplexity at 512, 2048 and 8192 tokens, and needle accuracy at 1024 and
                2048, before and after kv-group pruning and demotion of half the groups
                (`headlab.bench.long_context`)
    quality     held-out quality lost when pruning with michel, taylor, learned gates
                and FLAP's metric vs with random scores (the seeded methods over 3
                seeds), at keep 0.8, 0.6 and 0.4, before and after lsq repair, on the
                real bundled models; gate
                training and FLAP's calibration seconds against michel's
    recovery    held-out loss kept after the default repair (lsq) / without it, at keep
                0.6 on SmolLM2 and MiniLM; its time / michel scoring's

Every figure is reported as median and interquartile range (``spread`` = q3 - q1), with
its samples. Each benchmark writes ``<out>/<name>.json`` (figures, ratios, targets with
``meets``, machine, versions, date); `run_benchmarks` prints one Markdown table of all
targets. A target that is missed is reported as missed: nothing here is tuned to pass.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from headlab._util.io import atomic_write_json, atomic_write_text
from headlab._util.timing import (
    busy,
    cores,
    cpu_sample,
    load_average,
    machine_info,
    others_since,
    pinned_threads,
)
from headlab.bench._common import (
    BenchResult,
    Figure,
    Target,
    _jsonable,
    markdown_table,
    versions,
)
from headlab.bench._models import TINY_BERT, TINY_GPT2, TINY_LLAMA, ModelCache, ModelSpec
from headlab.bench._parts import Parts
from headlab.bench.attention import AttentionSizes, bench_attention
from headlab.bench.generate import GenerateSizes, bench_generate
from headlab.bench.hooks import HooksSizes, bench_hooks
from headlab.bench.importance import ImportanceSizes, bench_importance
from headlab.bench.long_context import LongContextSizes
from headlab.bench.models import ModelsSizes, bench_models
from headlab.bench.pruning import PruningSizes, bench_pruning, count_flops
from headlab.bench.quality import QualitySizes, bench_quality
from headlab.bench.recovery import RecoverySizes, bench_recovery

log = logging.getLogger(__name__)

__all__ = [
    "BENCHMARKS",
    "PRESETS",
    "BenchResult",
    "Figure",
    "ModelCache",
    "ModelSpec",
    "Target",
    "count_flops",
    "bench_context",
    "markdown_table",
    "run_benchmarks",
    "run_one",
]

BENCHMARKS: dict[str, Callable[..., BenchResult]] = {
    "attention": bench_attention,
    "models": bench_models,
    "hooks": bench_hooks,
    "importance": bench_importance,
    "pruning": bench_pruning,
    "generate": bench_generate,
    "quality": bench_quality,
    "recovery": bench_recovery,
}
# the benchmarks measured in parts, one model each, which --resume continues
RESUMABLE = ("quality", "recovery")


def parts_dir(out: Path, name: str) -> Path:
    """Where benchmark ``name`` keeps its finished parts (`headlab.bench._parts`)."""
    return Path(out) / f"{name}.parts"


def kept_parts(out: Path, which: str) -> list[Path]:
    """The parts folders under ``out`` that hold a checkpoint of the benchmarks ``which``
    runs (a name or ``all``): what ``--resume`` would continue."""
    names = RESUMABLE if which == "all" else [n for n in RESUMABLE if n == which]
    return [parts_dir(out, n) for n in names if any(parts_dir(out, n).glob("checkpoint*.pt"))]

PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "attention": AttentionSizes(),
        "models": ModelsSizes(),
        "hooks": HooksSizes(),
        "importance": ImportanceSizes(),
        "pruning": PruningSizes(),
        "generate": GenerateSizes(),
        "quality": QualitySizes(),
        "recovery": RecoverySizes(),
    },
    # a few minutes on two cores once the SmolLM2 conversion is cached
    "quick": {
        "attention": AttentionSizes(seqs=(256,), decode_runs=5, repeats=5, warmup=1),
        "models": ModelsSizes(batch=1, seq=64, repeats=3),
        "hooks": HooksSizes(seq=32, repeats=15, capture_repeats=3),
        "importance": ImportanceSizes(batch=1, seq=64, repeats=2),
        "pruning": PruningSizes(shapes=((16, 16), (1, 16)), repeats=5, lengths=(128, 512),
                                length_repeats=3),
        "generate": GenerateSizes(new_tokens=32, repeats=3, copy_mib=256,
                                  long_context=LongContextSizes(contexts=(512, 2048),
                                                                steps=8, needle_trials=1,
                                                                headroom_context=512,
                                                                gate_steps=10)),
        "quality": QualitySizes(runs=(("smollm2-135m", 64, 512), ("minilm-l6", 128, 1024)),
                                gate_steps=30, validate=(("minilm-l6", 64, 1024),)),
        "recovery": RecoverySizes(runs=(("smollm2-135m", 64, 1024, ()),
                                        ("minilm-l6", 128, 2048, (("normalize", False),))),
                                  distill_tokens=4096, latency_length=512),
    },
    # for the tests: seconds, random tiny models only
    "tiny": {
        "attention": AttentionSizes(d_model=64, n_heads=4, batch=2, seqs=(16, 32),
                                    decode_tokens=48, decode_window=8, decode_runs=2,
                                    repeats=3, warmup=1),
        "models": ModelsSizes(models=(TINY_GPT2, TINY_BERT, TINY_LLAMA), batch=2, seq=16,
                              repeats=3),
        "hooks": HooksSizes(model=TINY_GPT2, batch=2, seq=16, repeats=3, capture_repeats=3),
        "importance": ImportanceSizes(model=TINY_GPT2, batch=2, seq=16, n_batches=2,
                                      repeats=3),
        "pruning": PruningSizes(model=TINY_GPT2, shapes=((4, 16), (1, 16)), repeats=3,
                                length_model=TINY_LLAMA, lengths=(16, 64, 512),
                                length_repeats=2, judged_length=64),
        "generate": GenerateSizes(model=TINY_LLAMA, prompt=4, new_tokens=8, repeats=3,
                                  copy_mib=4, long_context=LongContextSizes(
                                      contexts=(32, None), steps=3, sinks=2, window=8,
                                      scoring_tokens=64, scoring_seq=32,
                                      needle_lengths=(64, 128), needle_depths=(0.0, 1.0),
                                      needle_trials=1, headroom_context=64)),
        "quality": QualitySizes(runs=(("minilm-l6", 32, 256),), keeps=(0.8, 0.6), step=0.4,
                                gate_steps=10, validate=()),
        "recovery": RecoverySizes(runs=(("minilm-l6", 32, 256, ()),), step=0.4,
                                  latency_length=32, latency_rounds=1),
    },
}


def _device(name: str) -> str:
    """The device to run on: `headlab.runs.config.resolve_device`, and CUDA only where torch
    sees it."""
    from headlab.errors import UserError
    from headlab.runs.config import resolve_device

    device = resolve_device(name)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: torch sees no CUDA device here "
                        f"(torch {torch.__version__}); use --device cpu")
    return device


def _others_said(others: float | None) -> str:
    """What the footer says of the CPU other processes used during the run (`others_since`;
    the load average cannot tell, as it counts the benchmarks' own threads)."""
    if others is None:
        return ""
    if busy(others) is None:
        return "; other processes used no more than half a core"
    return f" (other processes used {others:.1f} of the {cores()} cores on average)"


def bench_context(preset: str, device: str) -> dict[str, Any]:
    """What every benchmark JSON says of its run besides the machine: the preset, the
    device, the versions and the date."""
    return {"preset": preset, "device": device, "versions": versions(),
            "date": datetime.now(UTC).isoformat(timespec="seconds")}


def _identity(name: str, sizes: Any, context: dict[str, Any]) -> dict[str, Any]:
    """What a benchmark's parts must share to be resumed together: its sizes, preset,
    device and library versions."""
    return {"benchmark": name, "sizes": _jsonable(sizes.__dict__),
            "preset": context["preset"], "device": context["device"],
            # plain strings: torch's version is a str subclass the checkpoint cannot read
            "versions": {k: str(v) for k, v in context["versions"].items()}}


def run_one(name: str, bench: Callable[..., BenchResult], sizes: Any, *, device: str,
            cache: ModelCache, context: dict[str, Any], path: Path,
            parts: Parts | None = None) -> BenchResult:
    """Run ``bench`` on ``sizes`` and write its JSON to ``path``: timed, with the machine
    before and after it and the CPU other processes took meanwhile. A failure is
    recorded in the result (its ``error``), not raised; with ``parts`` (a benchmark in
    `RESUMABLE`), the parts it finished stay for ``--resume``, and go once it completes."""
    gc.collect()
    t0 = time.perf_counter()
    machine = machine_info(device)
    bench_start = cpu_sample()
    try:
        result = bench(sizes, device=device, models=cache,
                       **({} if parts is None else {"parts": parts}))
        if parts is not None:
            parts.done()
    except Exception as exc:  # recorded, reported, and raised at the end of a run
        log.exception("benchmark %s failed", name)
        result = BenchResult(name, error=f"{type(exc).__name__}: {exc}")
    result.elapsed_s = time.perf_counter() - t0
    machine["load_average_after"] = machine_info(device)["load_average"]
    machine["others_load"] = others_since(bench_start)  # None: /proc cannot say
    atomic_write_json(path, result.to_json({**context, "machine": machine}))
    log.info("%s done in %.1f s -> %s", name, result.elapsed_s, path)
    return result


def run_benchmarks(which: str, *, quick: bool, device: str, out: Path,
                   preset: str | None = None, threads: int | None = None,
                   resume: bool = False) -> list[BenchResult]:
    """Run one benchmark or ``"all"``; write ``out/<name>.json`` for each and
    ``out/summary.md``; print the Markdown table of targets.

    ``preset`` ("full", "quick", "tiny") overrides ``quick``; ``threads`` overrides the
    thread count (see `headlab._util.timing.pinned_threads`). A benchmark that fails is
    recorded as failed (its JSON holds the error) and the others still run; a UserError
    naming the failures is raised at the end. With ``resume``, the benchmarks in
    `RESUMABLE` keep the parts an interrupted run of the same sizes finished
    (`headlab.bench._parts`).
    """
    from headlab.errors import UserError

    names = list(BENCHMARKS) if which == "all" else [which]
    if which != "all" and which not in BENCHMARKS:
        raise UserError(f"unknown benchmark {which!r}; choose from "
                        f"{', '.join([*BENCHMARKS, 'all'])}")
    preset = preset or ("quick" if quick else "full")
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    device = _device(device)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    context = bench_context(preset, device)
    loads = [load_average()]
    if (why := busy()) is not None:
        log.warning(why)
    run_start = cpu_sample()
    results: list[BenchResult] = []
    cache = ModelCache(device)
    t_all = time.perf_counter()
    try:
        with pinned_threads(threads) as threads:
            log.info("headlab bench %s (%s, %s, %d threads)", which, preset, device, threads)
            machine = machine_info(device)
            for name in names:
                log.info("%s ...", name)
                sizes = PRESETS[preset][name]
                parts = (Parts(parts_dir(out, name), _identity(name, sizes, context),
                               resume=resume) if name in RESUMABLE else None)
                result = run_one(name, BENCHMARKS[name], sizes, device=device, cache=cache,
                                 context=context, path=out / f"{name}.json", parts=parts)
                loads.append(load_average())
                results.append(result)
    finally:
        cache.close()
    table = markdown_table(results)
    footer = (f"\n{preset} preset on {device}, {time.perf_counter() - t_all:.0f} s; "
              f"{machine['cpu']}, {cores()} cores, {machine['torch_threads']} torch threads; "
              f"1-minute load average {min(loads):.1f}–{max(loads):.1f} during the run"
              + _others_said(others_since(run_start)) + "\n")
    atomic_write_text(out / "summary.md",
                      f"# headlab bench {which}\n\n{context['date']}\n\n{table}{footer}")
    sys.stdout.write(table + footer)
    sys.stdout.flush()
    failed = [r.name for r in results if r.error is not None]
    if failed:
        raise UserError(f"benchmarks failed: {', '.join(failed)} (see {out}/<name>.json)")
    return results
