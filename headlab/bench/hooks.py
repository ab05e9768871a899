"""``headlab bench hooks``: what hook points cost when idle (against the same forward
with hooks switched off by `headlab.attention.hookpoint.hooks_disabled`), what capturing every
attention pattern costs in time, and in memory."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from headlab._util.timing import ms, ratios, time_interleaved
from headlab.bench._common import BenchResult, Timing, max_diff
from headlab.bench._models import GPT2_SMALL, ModelCache, ModelSpec, model_cache, random_ids

__all__ = ["HooksSizes", "bench_hooks", "peak_bytes"]


@dataclass(frozen=True, kw_only=True)
class HooksSizes(Timing):
    """Forwards of ``batch`` x ``seq`` tokens: ``repeats`` rounds for idle hooks against
    hooks switched off, ``capture_repeats`` for capturing every pattern."""

    model: ModelSpec = GPT2_SMALL
    batch: int = 1
    seq: int = 128
    repeats: int = 21  # the effect looked for (< 2%) is smaller than round-to-round noise
    capture_repeats: int = 5


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak bytes allocated during ``fn()`` above what was allocated before it.

    CPU: torch.profiler with profile_memory=True records every tensor allocation and
    free of the CPU allocator while it runs; the peak of their running sum is returned
    (tensors only: Python objects are not counted). CUDA: torch.cuda.max_memory_allocated.
    """
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        keep = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del keep
        return int(peak)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        keep = fn()
    del keep
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return int(peak)


def _hook_check_ns(points: int = 10_000) -> float:
    """Nanoseconds one idle ``run_hook`` costs (the switch, a dict truth test, a call)."""
    from headlab.attention.hookpoint import HookPoint, run_hook

    p = HookPoint()
    x = torch.zeros(1)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(points):
            run_hook(p, x)
        best = min(best, time.perf_counter() - t0)
    return best / points * 1e9


def bench_hooks(sizes: HooksSizes, *, device: str = "cpu",
                models: ModelCache | None = None) -> BenchResult:
    """Idle hook points vs hooks switched off; capturing every pattern; memory."""
    from headlab.attention.hookpoint import HookPoint, hooks_disabled
    from headlab.attention.hooks import capture

    B, S = sizes.batch, sizes.seq
    res = BenchResult.of_sizes("hooks", sizes)
    with model_cache(models, device) as cache:
        model = cache.headlab(sizes.model)
        n_points = sum(isinstance(m, HookPoint) for m in model.modules())
        res.method = {
            "idle": "headlab forward with hook points and none active",
            "switched_off": "the same model and input inside headlab.attention.hookpoint."
                            "hooks_disabled(): every run_hook returns its input after one "
                            "read of a module flag; its output is checked bit-identical",
            "idle_over_switched_off": "idle time / switched-off time per round "
                                      "(target <= 1.02)",
            "predicted_idle_overhead_pct": f"100 x {n_points} hook points x the measured cost "
                                           "of one idle run_hook / the switched-off forward "
                                           "time: the overhead expected without noise",
            "capture": "`with capture(model, 'pattern'): model(ids)` (every layer's attention "
                       "weights; switches attention to its eager path) vs model(ids)",
            "memory": "peak bytes allocated during the call above the bytes before it: "
                      "torch.profiler(profile_memory=True) running sum of CPU-allocator "
                      "allocations and frees (tensors only) on CPU, "
                      "torch.cuda.max_memory_allocated on CUDA; captured_mib = what the "
                      "Capture holds afterwards (Capture.nbytes)",
        }
        ids = random_ids(model.config.vocab_size, B, S, device)

        def switched_off():
            with hooks_disabled():
                return model(ids)

        def with_capture():
            with capture(model, "pattern") as cap:
                out = model(ids)
            return out, cap

        with torch.inference_mode():
            a, b = model(ids).logits, switched_off().logits
            res.checks["switched_off_output_identical"] = bool(torch.equal(a, b))
            res.checks["switched_off_max_abs_diff"] = max_diff(a, b)
            res.checks["hook_points"] = n_points
            with capture(model, "pattern") as cap, hooks_disabled():
                model(ids)
            res.checks["switched_off_captures_nothing"] = len(cap) == 0
            t = time_interleaved({"idle": lambda: model(ids), "off": switched_off},
                                  repeats=sizes.repeats, warmup=sizes.warmup, device=device)
            res.add("idle_hooks_ms", ms(t["idle"]), "ms")
            res.add("hooks_switched_off_ms", ms(t["off"]), "ms")
            res.add("idle_over_switched_off", ratios(t["idle"], t["off"]), "x")
            check_ns = _hook_check_ns()
            res.add("idle_hook_check_ns", [check_ns], "ns")
            res.add("predicted_idle_overhead_pct",
                    [100 * n_points * check_ns * 1e-9 / s for s in t["off"]], "%")
            res.add_target("idle_over_switched_off", target=1.02, op="<=",
                           what=f"forward time, idle hook points / hooks switched off "
                                f"(B={B}, S={S})")
            res.info.append(("predicted_idle_overhead_pct",
                             "idle hook overhead in %, predicted from the cost of one check"))

            t = time_interleaved({"capture": with_capture, "plain": lambda: model(ids)},
                                  repeats=sizes.capture_repeats, warmup=sizes.warmup,
                                  device=device)
            res.add("capture_patterns_ms", ms(t["capture"]), "ms")
            res.add("plain_forward_ms", ms(t["plain"]), "ms")
            res.add("capture_over_plain", ratios(t["capture"], t["plain"]), "x")
            res.info.append(("capture_over_plain",
                             f"time, capturing all patterns / plain forward (B={B}, S={S})"))

            plain_peak = [peak_bytes(lambda: model(ids), device) for _ in range(2)]
            capture_peak = [peak_bytes(with_capture, device) for _ in range(2)]
            stored = with_capture()[1].nbytes()
        mib = 2**20
        res.add("plain_forward_peak_mib", [p / mib for p in plain_peak], "MiB")
        res.add("capture_peak_mib", [p / mib for p in capture_peak], "MiB")
        res.add("captured_mib", [stored / mib], "MiB")
        res.add("capture_peak_over_plain", ratios(capture_peak, plain_peak), "x")
        res.info.append(("capture_peak_over_plain",
                         "peak memory, capturing all patterns / plain forward"))
    return res
