"""Timing that holds up on shared machines: interleaved rounds, paired ratios, pinned
threads, and the facts about the machine a figure only means something with.

How timings are taken: the thread count is pinned; each contender is warmed up; then
``repeats`` rounds run every contender once, in an order rotated each round; a ratio is
computed per round from that round's paired times, so load that comes and goes hits both
sides of a pair alike. On CUDA the device is synchronised before and after each call.

Threads: every core this process may use, unless HEADLAB_BENCH_THREADS (or ``threads=``)
says otherwise. When other processes compete for the cores, each OpenMP parallel region
can wait a scheduler slice for a preempted thread, and OMP_WAIT_POLICY changes how
much; `machine_info` records the load average and the wait policy so that runs are
compared under the same settings.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["cores", "load_average", "machine_info", "ms", "pinned_threads", "rate", "ratios",
           "sync", "time_interleaved"]


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_interleaved(
    fns: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int, device: str
) -> dict[str, list[float]]:
    """Seconds per call of each function: ``warmup`` untimed rounds, then ``repeats``
    rounds that call every function once, the order rotated each round so that none
    always runs right after the same neighbour. Entry i of every list is round i."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    out: dict[str, list[float]] = {n: [] for n in names}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()  # a collection inside one timed call would land on one side only
    try:
        for r in range(repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                sync(device)
                t0 = time.perf_counter()
                fns[name]()
                sync(device)
                out[name].append(time.perf_counter() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return out


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round ratios of paired measurements."""
    return [a / b if b else math.nan for a, b in zip(num, den, strict=True)]


def ms(times: Sequence[float]) -> list[float]:
    return [t * 1000 for t in times]


def rate(count: float, times: Sequence[float]) -> list[float]:
    """``count`` things per second, per measurement."""
    return [count / t for t in times]


def load_average() -> float:
    """The 1-minute load average, NaN where the OS has none."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan


def cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_sample() -> tuple[int, int, float] | None:
    """The busy clock ticks of every core (/proc/stat), this process's own ticks
    (/proc/self/stat, all its threads) and the time; None where /proc is not Linux's."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return sum(fields) - idle, int(own[11]) + int(own[12]), time.perf_counter()
    except (OSError, ValueError, IndexError):
        return None


def others_since(start: tuple[int, int, float] | None,
                 shortest: float = 0.25) -> float | None:
    """Cores' worth of CPU that other processes used since ``start`` (a `cpu_sample`), on
    average: every core's busy time less this process's own; None where /proc cannot say,
    or when less than ``shortest`` seconds passed (/proc counts whole clock ticks, a
    hundredth of a second each: a few of them over an instant read as several cores)."""
    end = cpu_sample() if start is not None else None
    if end is None or end[2] - start[2] < shortest:
        return None
    (busy0, own0, t0), (busy1, own1, t1) = start, end
    ticks = max(0, (busy1 - busy0) - (own1 - own0))
    return ticks / os.sysconf("SC_CLK_TCK") / (t1 - t0)


def others_load(window: float = 0.5) -> float:
    """Cores' worth of CPU that other processes use over the next ``window`` seconds, so
    that a run's own threads do not count (`others_since`); where /proc is not Linux's,
    the 1-minute load average."""
    start = cpu_sample()
    if start is not None:
        time.sleep(window)
    others = others_since(start)
    return load_average() if others is None else others


def busy(load: float | None = None) -> str | None:
    """Why timings taken while other processes use ``load`` cores (None: measure it,
    `others_load`) are noisy, or None: what the benchmarks and a prune run's summary say."""
    load = others_load() if load is None else load
    if not load > 0.5:
        return None
    return (f"the machine is busy (other processes use {load:.1f} of its {cores()} cores): "
            "timings will be noisy, and OpenMP threads that spin while a sibling is "
            "preempted can make multi-threaded forwards several times slower; "
            "OMP_WAIT_POLICY=PASSIVE (set before starting) or HEADLAB_BENCH_THREADS=1 "
            "avoid that")


@contextlib.contextmanager
def pinned_threads(threads: int | None = None) -> Iterator[int]:
    """Fix torch's intra-op threads for a block: ``threads``, else the
    HEADLAB_BENCH_THREADS environment variable, else every core this process may use."""
    n = threads or int(os.environ.get("HEADLAB_BENCH_THREADS", 0)) or cores()
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)


def machine_info(device: str) -> dict[str, Any]:
    """CPU, cores, threads, wait policy, load, memory and GPU: what a timing depends on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_available": cores(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "platform": platform.platform(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg")
        else None,
        "device": device,
    }
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info

