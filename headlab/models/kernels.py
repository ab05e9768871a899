"""headlab's decoding kernel (``csrc/linear_rows.c``), built once per machine with the C
compiler.

``linear_rows`` multiplies a few rows (a decode step) by a row-major weight. Such a
product is as fast as the weight streams from memory; torch runs it on one thread,
this kernel reads each 4-row tile of the weight once, on every OpenMP thread. Only
`headlab.models.generation` uses it, for its decode steps (see ``generate(decode_kernel=...)``);
every other product is torch's.

The source is compiled on first use with ``$CC`` (default ``cc``) and ``-O3
-march=native -fopenmp`` (about a second) into ``<cache>/kernels/<key>/``, where the key
covers the source, the compiler, the flags and the CPU; later processes load the built
file. It is called through ctypes, links the OpenMP runtime torch has already loaded and
runs on ``torch.get_num_threads()`` threads, as torch's own ops do. Before it is used
it is checked against float64 on awkward sizes.

Without a C compiler, or with ``HEADLAB_KERNELS=0``, ``linear_rows`` returns None and
generation uses torch's products, which agree within float32 rounding.
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
from pathlib import Path

import torch

from headlab._util.io import cache_root

log = logging.getLogger(__name__)

__all__ = ["available", "fits", "linear_rows", "status"]

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
    # anything else falls to torch, which computes it or raises a readable error: the
    # kernel trusts its pointers and sizes
    if x.dim() == 0 or not _cpu_float32(x) or not fits(w, bias) or x.shape[-1] != w.shape[1]:
        return None
    lib = _library()[0]
    if lib is None:
        return None
    return _rows(lib, x.contiguous(), w, bias, torch.get_num_threads())


def fits(w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a weight (N, K) and bias (N,) are what the kernel multiplies: float32,
    on the CPU, contiguous (the bias may be None)."""
    return w.dim() == 2 and _cpu_float32(w) and w.is_contiguous() and _bias_fits(bias, w.shape[0])


def available() -> bool:
    """Whether the kernel is built and checked here; `status` says why not."""
    return _library()[0] is not None


def status() -> str:
    """One line: whether the decoding kernel is in use, and if not, why."""
    lib, why = _library()
    return "C kernel (headlab/models/csrc/linear_rows.c)" if lib is not None else f"torch ({why})"


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


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The library, built and checked on first use, or None and why."""
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
    log.warning("headlab: %s; decoding uses torch's products", why)
    return None, why


def _build(compiler: str, flags: list[str]) -> Path:
    """Compile the source into the cache (once per key); return the library's path."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    key = hashlib.sha256(
        "\n".join([_SOURCE.read_text(), version, *flags, platform.machine(), _cpu()]).encode()
    ).hexdigest()[:16]
    lib = cache_root() / "kernels" / key / "headlab_kernels.so"
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


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.headlab_linear_rows.restype = None
    lib.headlab_linear_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    return lib


def _rows_agree(lib) -> bool:
    """Check the kernel against float64 on awkward sizes (tails of 4 rows and 8 columns,
    several rows, bias and no bias) before trusting it."""
    g = torch.Generator().manual_seed(0)
    for M, N, K in ((1, 7, 13), (3, 37, 45), (2, 64, 512)):
        x, w, b = (torch.randn(*s, generator=g) for s in ((M, K), (N, K), (N,)))
        for bias in (b, None):
            y = _rows(lib, x, w, bias, threads=2)  # 64 x 512 is large enough to split
            ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
            if not torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4):
                return False
    return True
