"""headlab's C kernels, built once per machine with the C compiler.

``csrc/linear_rows.c`` (``linear_rows``): products of a few rows, as in decoding, whose
speed is the rate at which weights stream from memory. Measured on the SmolLM2 shapes on
this project's 2-core machines (shared, so figures move between runs): MKL 6-12 GB/s, a
batched split of the weight across threads (the fallback in ``headlab.linear``) 8-16,
and this kernel, which reads each 4-row tile of the weight once with AVX2 FMAs on every
OpenMP thread, 10-17: 1.1-1.4x the split on the same shape in the same run, near a
two-thread ``sum`` over the same memory (12-19).

``csrc/gemm.c`` (``matmul``): large products (prefill, scoring) in the summation order
of torch's own CPU products, with AVX-512, so results are torch's and transformers' bit
for bit. On AMD CPUs MKL keeps to its AVX2 code: measured on 2 Zen 5 cores, 410-430
GFLOP/s against MKL's 180-200 on the SmolLM2 and GPT-2 shapes, 400 against 145 on the
SmolLM2 output embedding. The order is MKL's on such CPUs (see the source), so before
``matmul`` is used it is checked to equal torch bit for bit on this machine, on every
case of that order; where it does not (other CPUs, other BLAS) it is left unused.

The sources are compiled on first use with ``$CC`` (default ``cc``) and ``-O3
-march=native -fopenmp`` (about a second) into ``<cache>/kernels/<key>/``, where the
key covers the sources, the compiler, the flags and the CPU; later processes load the
built file. It is called through ctypes, links the OpenMP runtime torch has already
loaded and runs on ``torch.get_num_threads()`` threads, as torch's own ops do.

Without a C compiler, or with ``HEADLAB_KERNELS=0``, ``linear_rows`` and ``matmul``
return None and callers use torch's products: decoding within float32 rounding of the
kernel, large products bit for bit the same, both slower.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from headlab._io import cache_root

log = logging.getLogger(__name__)

__all__ = ["linear_rows", "matmul", "matmul_available", "matmul_status", "status", "unused"]

_SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("linear_rows.c", "gemm.c"))
# tried in order: the CPU's own instructions, then portable code
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"],
    ["-O3", "-fopenmp", "-shared", "-fPIC"],
)
# matmul's shapes: torch takes other paths for fewer rows or outputs (checked here:
# M <= 16 or N < 16 are not in MKL's blocked order), and few rows are linear_rows' job
MATMUL_MIN_ROWS = 17
MATMUL_MIN_COLS = 16

_unused = False  # see `unused`


@contextlib.contextmanager
def unused() -> Iterator[None]:
    """Inside this block ``linear_rows`` and ``matmul`` return None, so every product is
    torch's: to measure what the kernels bring (``headlab bench models``)."""
    global _unused
    before, _unused = _unused, True
    try:
        yield
    finally:
        _unused = before


def linear_rows(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """x (..., K) @ w (N, K)^T + bias by the C kernel, or None where it does not apply.

    Applies to float32 CPU tensors with ``w`` row-major (contiguous); no autograd, so
    callers use it only when no gradient is needed. Meant for a few rows (decoding):
    the kernel holds one weight tile in L1 while it visits every row.
    """
    lib = None if _unused else _library()[0]
    # anything else falls to torch, which computes it or raises a readable error: the
    # kernel trusts its pointers and sizes
    if lib is None or w.dim() != 2 or x.dim() == 0 or x.shape[-1] != w.shape[1]:
        return None
    if not (_cpu_float32(x, w) and w.is_contiguous() and _bias_fits(bias, w.shape[0])):
        return None
    return _rows(lib, x.contiguous(), w, bias, torch.get_num_threads())


def matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """a (..., K) @ b (K, N) + bias, bit for bit what torch computes, or None where the
    kernel does not apply: it needs float32 CPU tensors, at least 17 rows and 16
    outputs, K not odd between 192 and 384 (see csrc/gemm.c), ``b`` row-major or the
    transpose of a row-major tensor (an nn.Linear weight ``w`` gives ``b = w.t()``), and
    a library that passed its check on this machine (`matmul_status`). No autograd: the
    caller differentiates (see ``headlab.linear``)."""
    # the cheap checks first: a product on another device or dtype never builds the library
    if _unused or b.dim() != 2 or a.dim() == 0 or a.shape[-1] != b.shape[0]:
        return None
    K, N = b.shape
    M = a.numel() // K if K else 0
    if M < MATMUL_MIN_ROWS or N < MATMUL_MIN_COLS or not _cpu_float32(a, b):
        return None
    if 192 < K < 384 and K % 2:  # MKL's split of an odd K into two blocks is unknown
        return None
    if not (b.is_contiguous() or b.t().is_contiguous()) or not _bias_fits(bias, N):
        return None
    if not matmul_available():
        return None
    return _gemm(_library()[0], a.contiguous(), b, bias, torch.get_num_threads())


def _cpu_float32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _bias_fits(bias: torch.Tensor | None, n: int) -> bool:
    return bias is None or (
        _cpu_float32(bias) and bias.is_contiguous() and bias.shape == (n,)
    )


def _rows(lib, x, w, bias, threads: int) -> torch.Tensor:
    """linear_rows on checked, contiguous float32 CPU tensors; y (..., N)."""
    N, K = w.shape
    y = torch.empty(*x.shape[:-1], N)
    lib.headlab_linear_rows(x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(),
                            y.data_ptr(), x.numel() // K, N, K, threads)
    return y


def _gemm(lib, a, b, bias, threads: int) -> torch.Tensor:
    """matmul on checked tensors: ``a`` contiguous, ``b`` (K, N) row-major or the
    transpose of an (N, K) row-major tensor; c (..., N)."""
    K, N = b.shape
    b_kn = b.is_contiguous()
    c = torch.empty(*a.shape[:-1], N)
    failed = lib.headlab_gemm(
        a.data_ptr(), (b if b_kn else b.t()).data_ptr(), int(b_kn),
        None if bias is None else bias.data_ptr(), c.data_ptr(), a.numel() // K, N, K, threads,
    )
    if failed:
        raise MemoryError("headlab's matmul could not allocate its packing buffer")
    return c


def status() -> str:
    """One line: whether the decoding kernel is in use, and if not, why."""
    lib, why = _library()
    return "C kernel (headlab/csrc/linear_rows.c)" if lib is not None else f"torch ({why})"


def matmul_available() -> bool:
    """Whether large products run on headlab's kernel here (built, and bit for bit
    torch's on this machine); `matmul_status` says why not."""
    return _matmul_checked()[0]


def matmul_status() -> str:
    """One line: whether large products run on headlab's kernel, and if not, why."""
    ok, why = _matmul_checked()
    return "C kernel (headlab/csrc/gemm.c), equal to torch bit for bit" if ok else f"torch ({why})"


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The library, built and its decoding kernel checked on first use, or None and why."""
    if os.environ.get("HEADLAB_KERNELS", "1") == "0":
        return None, "HEADLAB_KERNELS=0"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return _unavailable("no C compiler: set CC or install gcc")
    errors = []
    for flags in _FLAG_SETS:
        try:
            lib = _load(_build(compiler, flags))
        except (OSError, subprocess.CalledProcessError) as exc:
            errors.append(getattr(exc, "stderr", None) or str(exc))
            continue
        if _rows_agree(lib):
            return lib, "built"
        errors.append(f"built with {' '.join(flags)} but disagreed with float64")
    return _unavailable("the kernel did not build: " + errors[-1].strip().splitlines()[-1])


def _unavailable(why: str) -> tuple[None, str]:
    log.warning("headlab: %s; decoding uses torch's slower products", why)
    return None, why


def _build(compiler: str, flags: list[str]) -> Path:
    """Compile the sources into the cache (once per key); return the library's path."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    key = hashlib.sha256(
        "\n".join([*(src.read_text() for src in _SOURCES), version, *flags,
                   platform.machine(), _cpu()]).encode()
    ).hexdigest()[:16]
    lib = cache_root() / "kernels" / key / "headlab_kernels.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=lib.parent, suffix=".so")
        os.close(fd)
        try:
            subprocess.run(
                [compiler, *flags, *map(str, _SOURCES), "-o", tmp],
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


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.headlab_linear_rows.restype = None
    lib.headlab_linear_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.headlab_gemm.restype = ctypes.c_int
    lib.headlab_gemm.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2
                                 + [ctypes.c_long] * 3 + [ctypes.c_int])
    lib.headlab_gemm_available.restype = ctypes.c_int
    return lib


def _rows_agree(lib) -> bool:
    """Check the decoding kernel against float64 on awkward sizes (tails of 4 rows and
    8 columns, several rows, bias and no bias) before trusting it."""
    g = torch.Generator().manual_seed(0)
    for M, N, K in ((1, 7, 13), (3, 37, 45), (2, 64, 512)):
        x, w, b = (torch.randn(*s, generator=g) for s in ((M, K), (N, K), (N,)))
        for bias in (b, None):
            y = _rows(lib, x, w, bias, threads=2)  # 64 x 512 is large enough to split
            ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
            if not torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4):
                return False
    return True


# (rows, K, N): each case of the blocking of K (one block; two halves; blocks of 192
# with and without a remainder), tails of the 6-row and 64-column tiles, and enough
# rows and columns for both threads and several column blocks
_MATMUL_CHECKS = ((17, 64, 16), (40, 200, 70), (37, 385, 100), (50, 576, 130),
                  (130, 1536, 200), (64, 768, 1100))


@functools.cache
def _matmul_checked() -> tuple[bool, str]:
    """Whether ``matmul`` runs here: the library has it (built for AVX-512) and it equals
    torch bit for bit on every `_MATMUL_CHECKS` shape, both layouts of b, with and
    without bias, on 1 and 2 threads."""
    lib, why = _library()
    if lib is None:
        return False, why
    if not lib.headlab_gemm_available():
        return False, "the CPU has no AVX-512, where torch's products are as fast"
    g = torch.Generator().manual_seed(0)
    for M, K, N in _MATMUL_CHECKS:
        a, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
        for b in (torch.randn(K, N, generator=g), torch.randn(N, K, generator=g).t()):
            for threads in (1, 2):
                if not (torch.equal(_gemm(lib, a, b, None, threads), a @ b)
                        and torch.equal(_gemm(lib, a, b, bias, threads),
                                        torch.addmm(bias, a, b))):
                    why = f"not bit-identical to torch's products on this CPU ({M}x{K}x{N})"
                    log.info("headlab: matmul kernel unused: %s", why)
                    return False, why
    return True, "checked"
