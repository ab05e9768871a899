"""headlab's C kernel for decoding products, built once per machine with the C compiler.

Decoding multiplies one row (per sequence) by every weight of the model, so its speed is
the rate at which weights stream from memory. Measured on the SmolLM2 shapes on this
project's 2-core machines (shared, so figures move between runs): MKL 6-12 GB/s, a
batched split of the weight across threads (the fallback in ``headlab.linear``) 8-16,
and ``csrc/linear_rows.c``, which reads each 4-row tile of the weight once with AVX2
FMAs on every OpenMP thread, 10-17: 1.1-1.4x the split on the same shape in the same
run, near a two-thread ``sum`` over the same memory (12-19).

The source is compiled on first use with ``$CC`` (default ``cc``) and ``-O3
-march=native -fopenmp`` (well under a second) into ``<cache>/kernels/<key>/``, where
the key covers the source, the compiler, the flags and the CPU; later processes load
the built file. It is called through ctypes, links the OpenMP runtime torch has
already loaded and runs on ``torch.get_num_threads()`` threads, as torch's own ops do.

Without a C compiler, or with ``HEADLAB_KERNELS=0``, ``linear_rows`` returns None and
callers use torch's products: same results within float32 rounding, slower decoding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from headlab._io import cache_root

log = logging.getLogger(__name__)

__all__ = ["linear_rows", "status"]

_SOURCE = Path(__file__).with_name("csrc") / "linear_rows.c"
# tried in order: the CPU's own instructions, then portable code
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-fopenmp", "-shared", "-fPIC"],
)


def linear_rows(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x (..., K) @ w (N, K)^T + bias by the C kernel, or None where it does not apply.

    Applies to float32 CPU tensors with ``w`` row-major (contiguous); no autograd, so
    callers use it only when no gradient is needed. Meant for a few rows (decoding):
    the kernel holds one weight tile in L1 while it visits every row.
    """
    fn = _kernel()[0]
    # anything else falls to torch, which computes it or raises a readable error: the
    # kernel trusts its pointers and sizes
    if fn is None or w.dim() != 2 or x.dim() == 0 or x.shape[-1] != w.shape[1]:
        return None
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (x, w)) or not (
        w.is_contiguous()
    ):
        return None
    if bias is not None and (
        bias.dtype != torch.float32 or bias.device.type != "cpu" or not bias.is_contiguous()
        or bias.shape != (w.shape[0],)
    ):
        return None
    return _run(fn, x.contiguous(), w, bias, torch.get_num_threads())


def _run(fn, x, w, bias, threads: int) -> torch.Tensor:
    """Call the kernel on checked, contiguous float32 CPU tensors; y (..., N)."""
    N, K = w.shape
    y = torch.empty(*x.shape[:-1], N)
    fn(x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
       x.numel() // K, N, K, threads)
    return y


def status() -> str:
    """One line: whether the kernel is in use, and if not, why."""
    fn, why = _kernel()
    return "C kernel (headlab/csrc/linear_rows.c)" if fn is not None else f"torch ({why})"


@functools.cache
def _kernel() -> tuple[Callable | None, str]:
    """The ctypes function, built and checked on first use, or None and why not."""
    if os.environ.get("HEADLAB_KERNELS", "1") == "0":
        return None, "HEADLAB_KERNELS=0"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return _unavailable("no C compiler: set CC or install gcc")
    errors = []
    for flags in _FLAG_SETS:
        try:
            fn = _load(_build(compiler, flags))
        except (OSError, subprocess.CalledProcessError) as exc:
            errors.append(getattr(exc, "stderr", None) or str(exc))
            continue
        if _agrees(fn):
            return fn, "built"
        errors.append(f"built with {' '.join(flags)} but disagreed with float64")
    return _unavailable("the kernel did not build: " + errors[-1].strip().splitlines()[-1])


def _unavailable(why: str) -> tuple[None, str]:
    log.warning("headlab: %s; decoding uses torch's slower products", why)
    return None, why


def _build(compiler: str, flags: list[str]) -> Path:
    """Compile the source into the cache (once per key); return the library's path."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    key = hashlib.sha256(
        "\n".join([_SOURCE.read_text(), version, *flags, platform.machine(), _cpu()]).encode()
    ).hexdigest()[:16]
    lib = cache_root() / "kernels" / key / "linear_rows.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so")
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *flags, str(_SOURCE), "-o", tmp],
                capture_output=True, text=True, check=True,
            )
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("headlab: built %s", lib)
    return lib


def _cpu() -> str:
    """The CPU's model and instruction flags, so a shared cache never serves another CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _load(lib: Path):
    fn = ctypes.CDLL(str(lib)).headlab_linear_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    return fn


def _agrees(fn) -> bool:
    """Check the built kernel against float64 on awkward sizes (tails of 4 rows and 8
    columns, several rows, bias and no bias) before trusting it."""
    g = torch.Generator().manual_seed(0)
    for M, N, K in ((1, 7, 13), (3, 37, 45), (2, 64, 512)):
        x, w, b = (torch.randn(*s, generator=g) for s in ((M, K), (N, K), (N,)))
        for bias in (b, None):
            y = _run(fn, x, w, bias, threads=2)  # 64 x 512 is large enough to split
            ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
            if not torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4):
                return False
    return True
