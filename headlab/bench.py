"""Benchmarks behind `headlab bench`: every figure is a ratio to a reference run in the same
process, on the same weights and inputs.

    attention   headlab MultiHeadAttention vs torch.nn.MultiheadAttention and vs bare
                scaled_dot_product_attention between the same projections; KV-cache decode
                step time late in a 512-token decode vs early
    models      forward tokens/s vs transformers (sdpa) on the same weights
    hooks       hook points present but idle vs the same forward with every hook check
                compiled out; capturing every pattern vs a plain forward; capture memory
    importance  Michel scoring tokens/s vs plain forward+backward tokens/s
    pruning     latency drop of a model pruned to keep 0.5 vs the FLOP-predicted drop
    generate    SmolLM2 greedy decoding tokens/s vs transformers' generate, and the
                fraction of the memory-bandwidth bound
    quality     held-out quality lost when pruning with michel vs with random scores
                (3 seeds), on the real bundled SmolLM2 and MiniLM; not a timing

How timings are taken (the machines this runs on are shared, so absolute times drift):
the thread count is pinned; each contender is warmed up; then ``repeats`` rounds run every
contender once, in an order rotated each round; a ratio is computed per round from that
round's paired times, so load that comes and goes hits both sides of a pair alike. Every
figure is reported as median and interquartile range (``spread`` = q3 - q1). On CUDA the
device is synchronised before and after each timed call.

Threads: every core this process may use, unless HEADLAB_BENCH_THREADS (or ``threads=``)
says otherwise. When other processes compete for the cores, each OpenMP parallel region
can wait a scheduler slice for a preempted thread (on a busy 2-core machine a GPT-2
forward ran 8x slower with 2 threads than with 1; OMP_WAIT_POLICY=PASSIVE, set before
Python starts, cut that to 1.6x), so every JSON records the load average before and
after and the wait policy, and runs should be compared under the same settings.

Each benchmark writes ``<out>/<name>.json`` (figures, ratios, targets with ``meets``,
machine, versions, date); `run_benchmarks` prints one Markdown table of all targets.
A target that is missed is reported as missed: nothing here is tuned to pass.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import gc
import inspect
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import textwrap
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from headlab import kernels
from headlab._io import atomic_write_json, atomic_write_text, cache_root

log = logging.getLogger(__name__)

__all__ = [
    "BENCHMARKS",
    "PRESETS",
    "BenchResult",
    "Figure",
    "ModelCache",
    "ModelSpec",
    "Target",
    "compile_without_hooks",
    "count_flops",
    "markdown_table",
    "run_benchmarks",
    "time_interleaved",
    "without_hook_checks",
]


# ---------------------------------------------------------------------- results
@dataclass(frozen=True)
class Figure:
    """Median and quartiles of repeated measurements (or of per-round ratios)."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int
    unit: str

    @property
    def spread(self) -> float:
        """Interquartile range, q3 - q1, in the figure's unit."""
        return self.q3 - self.q1

    @classmethod
    def of(cls, samples: Sequence[float], unit: str) -> Figure:
        xs = sorted(float(x) for x in samples)
        if not xs:
            raise ValueError("a figure needs at least one sample")
        if len(xs) == 1:
            q1 = q3 = xs[0]
        else:
            q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return cls(statistics.median(xs), q1, q3, xs[0], xs[-1], len(xs), unit)

    def to_json(self) -> dict[str, Any]:
        return {"median": _num(self.median), "spread": _num(self.spread), "q1": _num(self.q1),
                "q3": _num(self.q3), "min": _num(self.min), "max": _num(self.max),
                "n": self.n, "unit": self.unit}


@dataclass(frozen=True)
class Target:
    """A ratio figure held against a goal: ``ratio >= target`` or ``ratio <= target``."""

    figure: str
    what: str
    ratio: float
    q1: float
    q3: float
    target: float
    op: str  # ">=" or "<="

    def __post_init__(self) -> None:
        if self.op not in (">=", "<="):
            raise ValueError(f"target op must be '>=' or '<=', got {self.op!r}")

    @classmethod
    def judge(cls, figure: str, fig: Figure, *, target: float, op: str, what: str) -> Target:
        return cls(figure, what, fig.median, fig.q1, fig.q3, target, op)

    @property
    def meets(self) -> bool:
        """Computed from the median ratio; a ratio that is not a number never meets."""
        if not math.isfinite(self.ratio):
            return False
        return self.ratio >= self.target if self.op == ">=" else self.ratio <= self.target

    def to_json(self) -> dict[str, Any]:
        return {"figure": self.figure, "what": self.what, "ratio": _num(self.ratio),
                "spread": _num(self.q3 - self.q1), "q1": _num(self.q1), "q3": _num(self.q3),
                "target": self.target, "op": self.op, "meets": self.meets}


@dataclass
class BenchResult:
    """What one benchmark measured: figures by name, targets on some ratio figures,
    headline ratios without a target (``info``), how each thing was measured
    (``method``), correctness checks against the references (``checks``)."""

    name: str
    config: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Figure] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    info: list[tuple[str, str]] = field(default_factory=list)  # (figure, what)
    method: dict[str, str] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    elapsed_s: float = 0.0

    def add(self, name: str, samples: Sequence[float], unit: str) -> Figure:
        fig = Figure.of(samples, unit)
        self.figures[name] = fig
        return fig

    def add_target(self, figure: str, *, target: float, op: str, what: str) -> Target:
        t = Target.judge(figure, self.figures[figure], target=target, op=op, what=what)
        self.targets.append(t)
        return t

    def to_json(self, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            **dict(context or {}),
            "config": _jsonable(self.config),
            "figures": {k: f.to_json() for k, f in self.figures.items()},
            "targets": [t.to_json() for t in self.targets],
            "info": [{"figure": f, "what": w, "value": _num(self.figures[f].median)}
                     for f, w in self.info],
            "method": self.method,
            "checks": _jsonable(self.checks),
            "error": self.error,
            "elapsed_s": round(self.elapsed_s, 2),
            "definitions": {
                "median": "median over repeats (for ratios: of the per-round paired ratios)",
                "spread": "interquartile range q3 - q1, in the figure's unit",
            },
        }


def _num(x: float) -> float | None:
    """JSON has no NaN: a figure that could not be computed is null."""
    return float(x) if math.isfinite(x) else None


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return _num(x)
    if isinstance(x, ModelSpec):
        return x.name
    if isinstance(x, int | str | bool) or x is None:
        return x
    return str(x)


def markdown_table(results: Sequence[BenchResult]) -> str:
    """One row per target (and per headline ratio without one); failed benchmarks say why."""
    rows = ["| benchmark | measure | median | q1–q3 | target | meets |",
            "|---|---|---|---|---|---|"]
    for r in results:
        if r.error is not None:
            rows.append(f"| {r.name} | NOT MEASURED: {_cell(r.error)} | | | | **error** |")
        for t in r.targets:
            rows.append(f"| {r.name} | {_cell(t.what)} | {t.ratio:.3g} | "
                        f"{t.q1:.3g}–{t.q3:.3g} | {t.op} {t.target:g} | "
                        f"{'yes' if t.meets else '**no**'} |")
        for name, what in r.info:
            f = r.figures[name]
            rows.append(f"| {r.name} | {_cell(what)} | {f.median:.3g} | "
                        f"{f.q1:.3g}–{f.q3:.3g} | — | — |")
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class ModelSpec:
    """A model to benchmark: random weights from an HF config (``hf_config``), or a
    bundled real model (``bundled``)."""

    name: str
    family: str  # "gpt2" | "bert" | "llama"
    hf_config: Mapping[str, Any] | None = None
    bundled: str | None = None


GPT2_SMALL = ModelSpec("gpt2-small-random", "gpt2",
                       {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257,
                        "n_positions": 1024})
BERT_BASE = ModelSpec("bert-base-random", "bert",
                      {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768,
                       "intermediate_size": 3072, "vocab_size": 30522})
SMOLLM2 = ModelSpec("smollm2-135m", "llama", bundled="smollm2-135m")
TINY_GPT2 = ModelSpec("gpt2-tiny-random", "gpt2",
                      {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256,
                       "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0})
TINY_BERT = ModelSpec("bert-tiny-random", "bert",
                      {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                       "intermediate_size": 128, "vocab_size": 256,
                       "max_position_embeddings": 128})
TINY_LLAMA = ModelSpec("llama-tiny-random", "llama",
                       {"num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128,
                        "vocab_size": 256, "max_position_embeddings": 256,
                        "tie_word_embeddings": True})


@dataclass(frozen=True)
class AttentionSizes:
    d_model: int = 768
    n_heads: int = 12
    batch: int = 4
    seqs: tuple[int, ...] = (256, 1024)
    decode_tokens: int = 512
    decode_window: int = 64
    decode_runs: int = 7
    repeats: int = 7
    warmup: int = 2


@dataclass(frozen=True)
class ModelsSizes:
    models: tuple[ModelSpec, ...] = (GPT2_SMALL, BERT_BASE, SMOLLM2)
    batch: int = 4
    seq: int = 256
    repeats: int = 3
    warmup: int = 1


@dataclass(frozen=True)
class HooksSizes:
    model: ModelSpec = GPT2_SMALL
    batch: int = 1
    seq: int = 128
    repeats: int = 21  # the effect looked for (< 2%) is smaller than round-to-round noise
    capture_repeats: int = 5
    warmup: int = 1


@dataclass(frozen=True)
class ImportanceSizes:
    model: ModelSpec = GPT2_SMALL
    batch: int = 2
    seq: int = 128
    n_batches: int = 1
    repeats: int = 3
    warmup: int = 1


@dataclass(frozen=True)
class PruningSizes:
    model: ModelSpec = GPT2_SMALL
    shapes: tuple[tuple[int, int], ...] = ((16, 128), (1, 128))  # (B, S); the first is judged
    keep: float = 0.5
    repeats: int = 15  # a ~12% effect under run-to-run noise of about as much
    warmup: int = 1


@dataclass(frozen=True)
class GenerateSizes:
    model: ModelSpec = SMOLLM2
    prompt: int = 16
    new_tokens: int = 128
    repeats: int = 3
    warmup: int = 1
    copy_mib: int = 512


@dataclass(frozen=True)
class QualitySizes:
    # (bundled model, sequence length, token budget): real models only, as random
    # weights have no heads worth keeping
    runs: tuple[tuple[str, int, int], ...] = (("smollm2-135m", 128, 4096),
                                               ("minilm-l6", 128, 8192))
    keep: float = 0.6
    step: float = 0.2
    batch: int = 4
    methods: tuple[str, ...] = ("michel_unnormalised", "michel", "taylor")


# the labels of QualitySizes.methods: (method, scoring options). Michel et al. divide each
# layer's scores by their l2 norm (headlab's default); on both bundled models michel
# loses less without it, so the bar is checked there and the paper's setting shown
QUALITY_VARIANTS = {  # label: (method, scoring options, as the bench's table says it)
    "michel": ("michel", {}, "michel with the layer l2 norm (the paper's)"),
    "michel_unnormalised": ("michel", {"normalize": False}, "michel without the layer norm"),
    "taylor": ("taylor", {}, "taylor"),
}
QUALITY_TARGETED = "michel_unnormalised"


PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "attention": AttentionSizes(),
        "models": ModelsSizes(),
        "hooks": HooksSizes(),
        "importance": ImportanceSizes(),
        "pruning": PruningSizes(),
        "generate": GenerateSizes(),
        "quality": QualitySizes(),
    },
    # about two minutes on two cores once the SmolLM2 weights are cached
    "quick": {
        "attention": AttentionSizes(seqs=(256,), decode_runs=5, repeats=5, warmup=1),
        "models": ModelsSizes(batch=1, seq=64, repeats=3),
        "hooks": HooksSizes(seq=32, repeats=15, capture_repeats=3),
        "importance": ImportanceSizes(batch=1, seq=64, repeats=2),
        "pruning": PruningSizes(shapes=((16, 16), (1, 16)), repeats=5),
        "generate": GenerateSizes(new_tokens=32, repeats=2, copy_mib=256),
        "quality": QualitySizes(runs=(("smollm2-135m", 64, 1024), ("minilm-l6", 128, 2048))),
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
        "pruning": PruningSizes(model=TINY_GPT2, shapes=((4, 16), (1, 16)), repeats=3),
        "generate": GenerateSizes(model=TINY_LLAMA, prompt=4, new_tokens=8, repeats=3,
                                  copy_mib=4),
        "quality": QualitySizes(runs=(("minilm-l6", 32, 256),), step=0.4),
    },
}


# ---------------------------------------------------------------------- timing
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_interleaved(
    fns: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int, device: str
) -> dict[str, list[float]]:
    """Seconds per call of each function: ``warmup`` untimed rounds, then ``repeats``
    rounds that call every function once, the order rotated each round so that none
    always runs right after the same neighbour."""
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
                _sync(device)
                t0 = time.perf_counter()
                fns[name]()
                _sync(device)
                out[name].append(time.perf_counter() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return out


def _ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round ratios of paired measurements."""
    return [a / b if b else math.nan for a, b in zip(num, den, strict=True)]


def _ms(times: Sequence[float]) -> list[float]:
    return [t * 1000 for t in times]


def _rate(count: float, times: Sequence[float]) -> list[float]:
    return [count / t for t in times]


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def _pinned_threads(threads: int | None = None) -> Iterator[int]:
    """Fix torch's intra-op threads for the whole run: ``threads``, else the
    HEADLAB_BENCH_THREADS environment variable, else every core this process may use."""
    n = threads or int(os.environ.get("HEADLAB_BENCH_THREADS", 0)) or _cores()
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------------- context
def machine_info(device: str) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_available": _cores(),
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


def versions() -> dict[str, str]:
    import transformers

    import headlab

    return {"headlab": headlab.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


# ---------------------------------------------------------------------- models
class ModelCache:
    """Models built once per run and shared by the benchmarks that use them.

    Random models are built by transformers in memory (seeded), written with
    ``save_pretrained`` to a temporary directory and read back with ``headlab.load``, so
    both sides hold the same weights. A bundled GGUF model is dequantised by
    transformers once and kept as safetensors in ``~/.cache/headlab/bench`` (transformers'
    GGUF reader takes about a minute on two cores, longer than the quick run); both
    sides then load that directory.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._pairs: dict[str, tuple[Any, nn.Module, str]] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="headlab-bench-")

    def pair(self, spec: ModelSpec) -> tuple[Any, nn.Module, str]:
        """(headlab model, transformers model, where the weights came from), both in eval."""
        if spec.name not in self._pairs:
            self._pairs[spec.name] = self._build(spec)
        return self._pairs[spec.name]

    def headlab(self, spec: ModelSpec):
        return self.pair(spec)[0]

    def close(self) -> None:
        self._pairs.clear()
        self._tmp.cleanup()

    def _build(self, spec: ModelSpec):
        with _quiet_transformers():
            return self._build_quietly(spec)

    def _build_quietly(self, spec: ModelSpec):
        import transformers

        import headlab

        t0 = time.perf_counter()
        if spec.bundled is not None:
            path, source = _bundled_checkpoint(spec.bundled)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.float32, attn_implementation="sdpa")
        else:
            config_cls, auto_cls = _HF_CLASSES[spec.family]
            torch.manual_seed(0)
            config = getattr(transformers, config_cls)(**spec.hf_config)
            hf = getattr(transformers, auto_cls).from_config(config, attn_implementation="sdpa")
            path = Path(self._tmp.name) / spec.name
            hf.save_pretrained(path)
            source = "random weights (seed 0) saved by transformers' save_pretrained"
        model = headlab.load(path, device=self.device, tokenizer=False)
        hf = hf.to(self.device).eval()
        log.info("  %s ready in %.1f s (%s)", spec.name, time.perf_counter() - t0, source)
        return model, hf, source


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off while models are built, as they were after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


_HF_CLASSES = {  # family -> (config class, auto class): GPT2LMHeadModel, BertModel, ...
    "gpt2": ("GPT2Config", "AutoModelForCausalLM"),
    "bert": ("BertConfig", "AutoModel"),
    "llama": ("LlamaConfig", "AutoModelForCausalLM"),
}


def _bundled_checkpoint(name: str) -> tuple[Path, str]:
    """A safetensors copy of a bundled GGUF as transformers dequantises it, made once."""
    import transformers

    from headlab.models.loading import bundled_path

    gguf = bundled_path(name)
    st = gguf.stat()
    target = cache_root() / "bench" / f"{name}-{st.st_size}-{st.st_mtime_ns}"
    source = f"{gguf.name} dequantised by transformers (float32)"
    if (target / "config.json").is_file():
        return target, f"{source}, cached at {target}"
    log.info("  dequantising %s with transformers (once; cached in %s)", gguf.name, target)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    # save_pretrained refuses a model loaded from GGUF: write the dequantised weights and
    # the config (without its gguf quantization entry) as a plain checkpoint
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the embedding matrix itself
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    try:
        tmp.rename(target)
    except OSError:  # another run cached it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target, source


def _random_ids(vocab: int, batch: int, seq: int, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)


def _vocab(model) -> int:
    return model.config.vocab_size


# ---------------------------------------------------------------------- FLOPs
def count_flops(model, batch: int, seq: int) -> dict[str, int]:
    """FLOPs (2 per multiply-add) of one forward of ``batch`` x ``seq`` tokens, no cache.

    Counted analytically from the model's current (possibly pruned) shapes:
    ``projections`` (W_Q, W_K, W_V, W_O), ``attention`` (Q K^T and weights @ V, over
    S(S+1)/2 query-key pairs per head when causal, S^2 otherwise), ``mlp``, ``lm_head``
    and ``other`` linear layers (a pooler or classifier runs on one token per row).
    Norms, softmax, activations and embeddings lookups are left out: they are O(E) per
    token against the O(E^2) matmuls.
    """
    tokens = batch * seq
    causal = getattr(model, "kind", "") == "causal-lm"
    pairs = seq * (seq + 1) // 2 if causal else seq * seq
    out = {"projections": 0, "attention": 0, "mlp": 0, "lm_head": 0, "other": 0}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        rows = batch if name.split(".")[0] in ("pooler", "classifier") else tokens
        flops = 2 * mod.in_features * mod.out_features * rows
        if ".attn." in name:
            out["projections"] += flops
        elif ".mlp." in name:
            out["mlp"] += flops
        elif name == "lm_head":
            out["lm_head"] += flops
        else:
            out["other"] += flops
    if getattr(model, "head", None) == "mlm":  # BERT's decoder is the embedding matrix
        vocab, width = model.wte.weight.shape
        out["lm_head"] += 2 * width * vocab * tokens
    for attn in model.attentions:
        out["attention"] += 2 * 2 * batch * attn.n_heads * attn.head_dim * pairs
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------- attention
def bench_attention(sizes: AttentionSizes, *, device: str = "cpu",
                    models: ModelCache | None = None) -> BenchResult:
    """headlab MHA vs torch MHA and vs bare SDPA between the same projections; decode."""
    from headlab.attention import KVCache, MultiHeadAttention

    E, H = sizes.d_model, sizes.n_heads
    D = E // H
    res = BenchResult("attention", config={**sizes.__dict__, "dtype": "float32",
                                           "mask": "none (full self-attention)"})
    res.method = {
        "headlab": "headlab.attention.MultiHeadAttention(x), built from the torch module "
                   "with from_torch (same weights)",
        "torch_mha": "torch.nn.MultiheadAttention(batch_first=True)(x, x, x, "
                     "need_weights=False) in eval + inference_mode (its fused fast path)",
        "sdpa_in_projections": "the headlab module's q/k/v/o nn.Linear layers around a bare "
                               "F.scaled_dot_product_attention: the floor for headlab's own "
                               "overhead",
        "speed_vs_*": "reference time / headlab time, per round (> 1: headlab faster)",
        "decode": f"one MultiHeadAttention (B=1) decoding {sizes.decode_tokens} tokens with a "
                  "KVCache; each step timed; ratio = time of the last "
                  f"{sizes.decode_window} steps / time of the first {sizes.decode_window}, "
                  "per decode run",
    }
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True).to(device).eval()
    mha = MultiHeadAttention.from_torch(ref).eval()

    def sdpa_in_projections(x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = mha.q_proj(x).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
        k = mha.k_proj(x).view(B, S, H, D).transpose(1, 2)
        v = mha.v_proj(x).view(B, S, H, D).transpose(1, 2)
        z = F.scaled_dot_product_attention(q, k, v)  # (B, H, S, D)
        return mha.o_proj(z.transpose(1, 2).reshape(B, S, E))  # (B, S, E)

    with torch.inference_mode():
        for S in sizes.seqs:
            x = torch.randn(sizes.batch, S, E, generator=torch.Generator().manual_seed(S))
            x = x.to(device)
            out = mha(x)
            res.checks[f"max_abs_diff_vs_torch_mha_S{S}"] = _max_diff(
                out, ref(x, x, x, need_weights=False)[0])
            res.checks[f"max_abs_diff_vs_sdpa_S{S}"] = _max_diff(out, sdpa_in_projections(x))
            t = time_interleaved(
                {"headlab": lambda x=x: mha(x),
                 "torch_mha": lambda x=x: ref(x, x, x, need_weights=False),
                 "sdpa": lambda x=x: sdpa_in_projections(x)},
                repeats=sizes.repeats, warmup=sizes.warmup, device=device)
            res.add(f"headlab_ms_S{S}", _ms(t["headlab"]), "ms")
            res.add(f"torch_mha_ms_S{S}", _ms(t["torch_mha"]), "ms")
            res.add(f"sdpa_in_projections_ms_S{S}", _ms(t["sdpa"]), "ms")
            res.add(f"speed_vs_sdpa_S{S}", _ratios(t["sdpa"], t["headlab"]), "x")
            res.add(f"speed_vs_torch_mha_S{S}", _ratios(t["torch_mha"], t["headlab"]), "x")
        for S in sizes.seqs:
            res.add_target(f"speed_vs_sdpa_S{S}", target=0.95, op=">=",
                           what=f"MHA speed vs SDPA in the same projections (B={sizes.batch}, "
                                f"S={S})")
            res.add_target(f"speed_vs_torch_mha_S{S}", target=1.0, op=">=",
                           what=f"MHA speed vs torch.nn.MultiheadAttention (B={sizes.batch}, "
                                f"S={S})")

        # decode: do the last steps (T = n-w+1 .. n keys) cost little more than the first
        # (T = 1 .. w)? With a cache a step projects one token; only attention grows with T.
        n, w = sizes.decode_tokens, sizes.decode_window
        xs = torch.randn(n, 1, 1, E, generator=torch.Generator().manual_seed(1)).to(device)

        def decode() -> list[float]:
            cache = KVCache()
            steps = []
            for i in range(n):
                _sync(device)
                t0 = time.perf_counter()
                mha(xs[i], causal=True, cache=cache)  # (1, 1, E) over T = i + 1 keys
                _sync(device)
                steps.append(time.perf_counter() - t0)
            return steps

        for _ in range(sizes.warmup):
            decode()
        first, last, ratio = [], [], []
        for _ in range(sizes.decode_runs):
            steps = decode()
            first.append(sum(steps[:w]))
            last.append(sum(steps[-w:]))
            ratio.append(last[-1] / first[-1])
    res.add(f"decode_first{w}_steps_ms", _ms(first), "ms")
    res.add(f"decode_last{w}_steps_ms", _ms(last), "ms")
    res.add("decode_last_over_first", ratio, "x")
    res.add_target("decode_last_over_first", target=1.3, op="<=",
                   what=f"decode: last {w} of {n} steps / first {w} (KV cache)")
    return res


# ---------------------------------------------------------------------- models
def _hf_output(hf: nn.Module, ids: torch.Tensor, family: str) -> torch.Tensor:
    if family == "bert":
        return hf(input_ids=ids).last_hidden_state
    return hf(input_ids=ids, use_cache=False).logits


def _headlab_output(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out.logits if out.logits is not None else out.last_hidden_state


def bench_models(sizes: ModelsSizes, *, device: str = "cpu",
                 models: ModelCache | None = None) -> BenchResult:
    """Forward tokens/s of headlab vs transformers (sdpa) on the same weights."""
    cache = models or ModelCache(device)
    B, S = sizes.batch, sizes.seq
    res = BenchResult("models", config={**sizes.__dict__, "dtype": "float32"})
    res.method = {
        "headlab": "model(input_ids) in eval + inference_mode",
        "transformers": "the transformers model (attn_implementation='sdpa') that wrote the "
                        "weights, called with use_cache=False (headlab's forward keeps no "
                        "cache either) in eval + inference_mode; BERT is BertModel",
        "speed_vs_transformers": "transformers time / headlab time per round (> 1: headlab "
                                 "faster); tokens/s = B*S / time",
    }
    res.checks["large_products"] = kernels.matmul_status()  # see headlab.kernels
    own_products = device == "cpu" and kernels.matmul_available()
    try:
        for spec in sizes.models:
            model, hf, source = cache.pair(spec)
            ids = _random_ids(_vocab(model), B, S, device)

            def race(m=model, h=hf, i=ids, f=spec.family) -> tuple[float, dict]:
                """Output difference, then seconds per call of each side, interleaved."""
                with torch.inference_mode():
                    diff = _max_diff(_headlab_output(m, i), _hf_output(h, i, f))
                    return diff, time_interleaved(
                        {"headlab": lambda: m(i), "transformers": lambda: _hf_output(h, i, f)},
                        repeats=sizes.repeats, warmup=sizes.warmup, device=device)

            res.checks[f"{spec.name}.max_abs_diff"], t = race()
            res.checks[f"{spec.name}.weights"] = source
            res.checks[f"{spec.name}.transformers"] = (
                f"{type(hf).__name__}, attention {hf.config._attn_implementation}")
            res.add(f"{spec.name}.headlab_tokens_per_s", _rate(B * S, t["headlab"]), "tokens/s")
            res.add(f"{spec.name}.transformers_tokens_per_s", _rate(B * S, t["transformers"]),
                    "tokens/s")
            res.add(f"{spec.name}.speed_vs_transformers",
                    _ratios(t["transformers"], t["headlab"]), "x")
            res.add_target(f"{spec.name}.speed_vs_transformers", target=1.0, op=">=",
                           what=f"{spec.name} forward tokens/s vs transformers sdpa "
                                f"(B={B}, S={S})")
            if own_products:  # where the speed comes from: the same race on torch's products
                with kernels.unused():
                    res.checks[f"{spec.name}.torch_products_max_abs_diff"], t = race()
                res.add(f"{spec.name}.torch_products_speed_vs_transformers",
                        _ratios(t["transformers"], t["headlab"]), "x")
                res.info.append((f"{spec.name}.torch_products_speed_vs_transformers",
                                 f"{spec.name} forward, headlab on torch's products "
                                 f"(kernels.unused()) vs transformers sdpa"))
    finally:
        if models is None:
            cache.close()
    return res


# ---------------------------------------------------------------------- hooks
class _DropHookChecks(ast.NodeTransformer):
    """Rewrite a forward as if the module had no hook points: ``if p._forward_hooks:``
    statements go, ``a or p._forward_hooks`` keeps ``a``, ``run_hook(p, x)`` becomes
    ``x``, and the ``x = x`` that leaves behind goes too."""

    def visit_If(self, node: ast.If):
        self.generic_visit(node)
        if _is_hook_test(node.test) and not node.orelse:
            return None
        return node

    def visit_BoolOp(self, node: ast.BoolOp):
        self.generic_visit(node)
        if isinstance(node.op, ast.Or):
            kept = [v for v in node.values if not _is_hook_test(v)]
            if not kept:
                return ast.Constant(False)
            if len(kept) == 1:
                return kept[0]
            node.values = kept
        return node

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "run_hook":
            return node.args[1]
        return node

    def visit_Assign(self, node: ast.Assign):
        self.generic_visit(node)
        target = node.targets[0] if len(node.targets) == 1 else None
        if (isinstance(target, ast.Name) and isinstance(node.value, ast.Name)
                and target.id == node.value.id):
            return None
        return node


def _is_hook_test(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "_forward_hooks"


def compile_without_hooks(func: Callable) -> tuple[Callable, str]:
    """``func`` (a forward method) recompiled with its hook checks removed, and its source.

    Raises RuntimeError when a hook check survives the rewrite: the reference would
    then not be "the same forward without hook points".
    """
    src = textwrap.dedent(inspect.getsource(func))
    tree = ast.parse(src)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise RuntimeError(f"{func.__qualname__}: expected a plain function definition")
    fdef.decorator_list = []
    for arg in [*fdef.args.posonlyargs, *fdef.args.args, *fdef.args.kwonlyargs]:
        arg.annotation = None
    fdef.returns = None
    tree = ast.fix_missing_locations(_DropHookChecks().visit(tree))
    text = ast.unparse(tree)
    if "_forward_hooks" in text or "run_hook" in text or "super(" in text:
        raise RuntimeError(f"could not compile the hook checks out of {func.__qualname__}:\n"
                           f"{text}")
    namespace: dict[str, Any] = {}
    code = compile(tree, f"<{func.__qualname__} without hook checks>", "exec")
    exec(code, func.__globals__, namespace)  # noqa: S102 - headlab's own source, rewritten
    return namespace[fdef.name], text


def without_hook_checks(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """A copy of ``model`` whose headlab forwards have every hook check compiled out, and
    the qualified names of the forwards rewritten. The copy shares the model's tensors."""
    from headlab.hookpoint import HookPoint

    # the copy shares the very parameter and buffer tensors: both sides read the same
    # memory, so weight placement (alignment, pages) cannot favour either
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    tok = getattr(model, "tokenizer", None)
    model.tokenizer = None
    try:
        ref = copy.deepcopy(model, memo=shared)
    finally:
        model.tokenizer = tok
    compiled: dict[type, Callable] = {}
    for mod in ref.modules():
        cls = type(mod)
        if isinstance(mod, HookPoint) or not cls.__module__.startswith("headlab."):
            continue
        if cls not in compiled:
            src = inspect.getsource(cls.forward)
            if "run_hook" not in src and "_forward_hooks" not in src:
                continue
            compiled[cls] = compile_without_hooks(cls.forward)[0]
        mod.forward = types.MethodType(compiled[cls], mod)
    return ref, sorted(c.__qualname__ + ".forward" for c in compiled)


def _peak_bytes(fn: Callable[[], object], device: str) -> int:
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
    """Nanoseconds one inactive ``run_hook`` costs (a dict truth test and a call)."""
    from headlab.hookpoint import HookPoint, run_hook

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
    """Idle hook points vs none; capturing every pattern vs a plain forward; memory."""
    from headlab.hookpoint import HookPoint
    from headlab.hooks import capture

    cache = models or ModelCache(device)
    B, S = sizes.batch, sizes.seq
    res = BenchResult("hooks", config={**sizes.__dict__, "dtype": "float32"})
    try:
        model = cache.headlab(sizes.model)
        bare, rewritten = without_hook_checks(model)
        n_points = sum(isinstance(m, HookPoint) for m in model.modules())
        res.method = {
            "idle": "headlab forward with hook points and none active",
            "reference": "a copy of the model sharing its weight tensors, whose forwards "
                         f"({', '.join(rewritten)}) were recompiled from their own source with "
                         "every hook check removed (`if p._forward_hooks:` branches dropped, "
                         "`run_hook(p, x)` replaced by `x`): the same operations as a model "
                         "built without hook points; its output is checked bit-identical",
            "idle_over_compiled_out": "idle time / reference time per round (target <= 1.02)",
            "predicted_idle_overhead_pct": f"100 x {n_points} hook points x the measured cost "
                                           "of one inactive run_hook / the reference forward "
                                           "time: the overhead expected without noise",
            "capture": "`with capture(model, 'pattern'): model(ids)` (every layer's attention "
                       "weights; switches attention to its eager path) vs model(ids)",
            "memory": "peak bytes allocated during the call above the bytes before it: "
                      "torch.profiler(profile_memory=True) running sum of CPU-allocator "
                      "allocations and frees (tensors only) on CPU, "
                      "torch.cuda.max_memory_allocated on CUDA; captured_mib = what the "
                      "Capture holds afterwards (Capture.nbytes)",
        }
        ids = _random_ids(_vocab(model), B, S, device)

        def with_capture():
            with capture(model, "pattern") as cap:
                out = model(ids)
            return out, cap

        with torch.inference_mode():
            a, b = model(ids).logits, bare(ids).logits
            res.checks["reference_output_identical"] = bool(torch.equal(a, b))
            res.checks["reference_max_abs_diff"] = _max_diff(a, b)
            res.checks["hook_points"] = n_points
            res.checks["forwards_rewritten"] = rewritten
            t = time_interleaved({"idle": lambda: model(ids), "bare": lambda: bare(ids)},
                                  repeats=sizes.repeats, warmup=sizes.warmup, device=device)
            res.add("idle_hooks_ms", _ms(t["idle"]), "ms")
            res.add("hooks_compiled_out_ms", _ms(t["bare"]), "ms")
            res.add("idle_over_compiled_out", _ratios(t["idle"], t["bare"]), "x")
            check_ns = _hook_check_ns()
            res.add("inactive_hook_check_ns", [check_ns], "ns")
            res.add("predicted_idle_overhead_pct",
                    [100 * n_points * check_ns * 1e-9 / s for s in t["bare"]], "%")
            res.add_target("idle_over_compiled_out", target=1.02, op="<=",
                           what=f"forward time, idle hook points / hook checks compiled out "
                                f"(B={B}, S={S})")
            res.info.append(("predicted_idle_overhead_pct",
                             "idle hook overhead in %, predicted from the cost of one check"))

            t = time_interleaved({"capture": with_capture, "plain": lambda: model(ids)},
                                  repeats=sizes.capture_repeats, warmup=sizes.warmup,
                                  device=device)
            res.add("capture_patterns_ms", _ms(t["capture"]), "ms")
            res.add("plain_forward_ms", _ms(t["plain"]), "ms")
            res.add("capture_over_plain", _ratios(t["capture"], t["plain"]), "x")
            res.info.append(("capture_over_plain",
                             f"time, capturing all patterns / plain forward (B={B}, S={S})"))

            plain_peak = [_peak_bytes(lambda: model(ids), device) for _ in range(2)]
            capture_peak = [_peak_bytes(with_capture, device) for _ in range(2)]
            stored = with_capture()[1].nbytes()
        mib = 2**20
        res.add("plain_forward_peak_mib", [p / mib for p in plain_peak], "MiB")
        res.add("capture_peak_mib", [p / mib for p in capture_peak], "MiB")
        res.add("captured_mib", [stored / mib], "MiB")
        res.add("capture_peak_over_plain", _ratios(capture_peak, plain_peak), "x")
        res.info.append(("capture_peak_over_plain",
                         "peak memory, capturing all patterns / plain forward"))
    finally:
        if models is None:
            cache.close()
    return res


# ---------------------------------------------------------------------- importance
def bench_importance(sizes: ImportanceSizes, *, device: str = "cpu",
                     models: ModelCache | None = None) -> BenchResult:
    """Michel scoring tokens/s vs forward + backward with parameter gradients."""
    from headlab.data import Blocks
    from headlab.evaluate import example_losses
    from headlab.importance import score

    cache = models or ModelCache(device)
    B, S = sizes.batch, sizes.seq
    res = BenchResult("importance", config={**sizes.__dict__, "dtype": "float32"})
    res.method = {
        "michel": "headlab.score(model, blocks, method='michel', batch_size=B): gates "
                  "(B, H) per layer with grad, parameters frozen, loss.sum().backward()",
        "forward_backward": "the same batches: example_losses (the same loss) then "
                            "loss.sum().backward() with every parameter requiring grad, "
                            "grads set to None after each batch",
        "scoring_over_forward_backward": "Michel tokens/s / forward+backward tokens/s per "
                                         "round (target >= 0.9)",
        "torch_products": "the same scoring inside kernels.unused(): every product on "
                          "torch's, as the forward+backward's are (parameters needing "
                          "gradients keep to torch), to show what the kernel brings",
    }
    try:
        model = cache.headlab(sizes.model)
        rows = B * sizes.n_batches
        ids = _random_ids(_vocab(model), rows, S, "cpu", seed=2)
        blocks = Blocks(ids, torch.ones_like(ids), spec="random tokens")
        tokens = rows * S
        requires = [p.requires_grad for p in model.parameters()]

        def forward_backward():
            for batch in blocks.batches(B):
                loss, _, _ = example_losses(model, batch)
                loss.sum().backward()
                model.zero_grad(set_to_none=True)

        def michel_on_torch_products():
            with kernels.unused():
                score(model, blocks, method="michel", batch_size=B)

        try:
            for p in model.parameters():
                p.requires_grad_(True)
            t = time_interleaved(
                {"michel": lambda: score(model, blocks, method="michel", batch_size=B),
                 "fb": forward_backward, "michel_torch": michel_on_torch_products},
                repeats=sizes.repeats, warmup=sizes.warmup, device=device)
        finally:
            for p, r in zip(model.parameters(), requires, strict=True):
                p.requires_grad_(r)
            model.zero_grad(set_to_none=True)
        res.add("michel_tokens_per_s", _rate(tokens, t["michel"]), "tokens/s")
        res.add("forward_backward_tokens_per_s", _rate(tokens, t["fb"]), "tokens/s")
        res.add("scoring_over_forward_backward", _ratios(t["fb"], t["michel"]), "x")
        res.add_target("scoring_over_forward_backward", target=0.9, op=">=",
                       what=f"Michel scoring tokens/s vs forward+backward (B={B}, S={S})")
        res.add("torch_products_scoring_over_forward_backward",
                _ratios(t["fb"], t["michel_torch"]), "x")
        res.info.append(("torch_products_scoring_over_forward_backward",
                         "the same, scoring on torch's products (kernels.unused())"))
    finally:
        if models is None:
            cache.close()
    return res


# ---------------------------------------------------------------------- pruning
def bench_pruning(sizes: PruningSizes, *, device: str = "cpu",
                  models: ModelCache | None = None) -> BenchResult:
    """Latency drop of a model pruned to ``keep`` heads vs the FLOP-predicted drop."""
    from headlab.importance import HeadScores
    from headlab.pruning import prune, select

    cache = models or ModelCache(device)
    res = BenchResult("pruning", config={**sizes.__dict__, "dtype": "float32"})
    res.method = {
        "plan": f"keep {sizes.keep} of all heads, ranked globally by seeded random scores "
                "(layers keep uneven numbers of heads), physically pruned with "
                "headlab.prune(..., inplace=False)",
        "latency": "forward time of the unpruned and the pruned model, interleaved, eval + "
                   "inference_mode",
        "drop": "1 - latency_after / latency_before per round",
        "predicted_drop": "1 - flops_after / flops_before from count_flops (projections, "
                          "attention, MLP, LM head matmuls)",
        "drop_over_predicted": "measured drop / predicted drop per round (target >= 0.8 at "
                               "the first shape)",
    }
    try:
        model = cache.headlab(sizes.model)
        gen = torch.Generator().manual_seed(0)
        scores = torch.rand(model.n_layers, model.n_original_heads, generator=gen)
        plan = select(HeadScores(scores.tolist(), "random"), keep=sizes.keep)
        pruned = prune(model, plan, inplace=False)
        res.checks["heads_per_layer_after"] = pruned.heads_per_layer
        res.checks["params_before"] = model.num_parameters()
        res.checks["params_after"] = pruned.num_parameters()
        flops: dict[str, Any] = {}
        for i, (B, S) in enumerate(sizes.shapes):
            key = f"B{B}_S{S}"
            before, after = count_flops(model, B, S), count_flops(pruned, B, S)
            predicted = 1 - after["total"] / before["total"]
            flops[key] = {"before": before, "after": after, "predicted_drop": predicted}
            ids = _random_ids(_vocab(model), B, S, device)
            with torch.inference_mode():
                t = time_interleaved({"before": lambda i=ids: model(i),
                                       "after": lambda i=ids: pruned(i)},
                                      repeats=sizes.repeats, warmup=sizes.warmup,
                                      device=device)
            drops = [1 - a / b for a, b in zip(t["after"], t["before"], strict=True)]
            res.add(f"{key}.before_ms", _ms(t["before"]), "ms")
            res.add(f"{key}.after_ms", _ms(t["after"]), "ms")
            res.add(f"{key}.drop", drops, "fraction")
            res.add(f"{key}.predicted_drop", [predicted], "fraction")
            res.add(f"{key}.drop_over_predicted",
                    [d / predicted if predicted else math.nan for d in drops], "x")
            what = (f"latency drop at keep {sizes.keep} / FLOP-predicted drop "
                    f"({predicted:.1%}) (B={B}, S={S})")
            if i == 0:
                res.add_target(f"{key}.drop_over_predicted", target=0.8, op=">=", what=what)
            else:
                res.info.append((f"{key}.drop_over_predicted", what))
        res.checks["flops"] = flops
    finally:
        if models is None:
            cache.close()
    return res


# ---------------------------------------------------------------------- generate
def bench_generate(sizes: GenerateSizes, *, device: str = "cpu",
                   models: ModelCache | None = None) -> BenchResult:
    """Batch-1 greedy decoding tokens/s vs transformers' generate; bandwidth bound."""
    from headlab.generation import generate

    cache = models or ModelCache(device)
    N = sizes.new_tokens
    res = BenchResult("generate", config={**sizes.__dict__, "dtype": "float32", "batch": 1})
    res.method = {
        "headlab": f"headlab.generation.generate(model, prompt, max_new_tokens={N}, "
                   "eos_token_id=()) (greedy, never stops early)",
        "transformers": f"model.generate(prompt, max_new_tokens={N}, min_new_tokens={N}, "
                        "do_sample=False) on the same weights (sdpa, default dynamic cache)",
        "tokens_per_s": f"{N} new tokens / wall time of the whole call (prefill of a "
                        f"{sizes.prompt}-token prompt included)",
        "bandwidth": f"copy of a {sizes.copy_mib} MiB tensor, timed in the same rounds; "
                     "bandwidth = bytes read + bytes written / time",
        "bound": "each new token reads every weight once: bound tokens/s = bandwidth / "
                 "weight bytes (parameters counted once, a tied embedding once)",
    }
    try:
        model, hf, source = cache.pair(sizes.model)
        res.checks["weights"] = source
        res.checks["decode_products"] = kernels.status()  # see headlab.kernels
        prompt = _random_ids(_vocab(model), 1, sizes.prompt, device, seed=3)
        mask = torch.ones_like(prompt)
        eos = hf.config.eos_token_id
        pad = hf.config.pad_token_id
        if pad is None:
            pad = (eos[0] if isinstance(eos, list) else eos) or 0
        n_copy = sizes.copy_mib * 2**20 // 4
        src = torch.ones(n_copy, device=device)
        dst = torch.empty_like(src)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        outs: dict[str, torch.Tensor] = {}

        def run_headlab():
            outs["headlab"] = generate(model, prompt, max_new_tokens=N, eos_token_id=())

        def run_hf():
            outs["transformers"] = hf.generate(
                prompt, attention_mask=mask, max_new_tokens=N, min_new_tokens=N,
                do_sample=False, pad_token_id=pad)

        with torch.inference_mode():
            t = time_interleaved({"headlab": run_headlab, "transformers": run_hf,
                                   "copy": lambda: dst.copy_(src)},
                                  repeats=sizes.repeats, warmup=sizes.warmup, device=device)
        a, b = outs["headlab"][0, sizes.prompt:], outs["transformers"][0, sizes.prompt:]
        res.checks["new_tokens"] = {"headlab": int(a.numel()), "transformers": int(b.numel())}
        same = (a[: b.numel()] == b[: a.numel()]).tolist()
        res.checks["greedy_tokens_agree_before_first_difference"] = (
            same.index(False) if False in same else len(same))
        res.checks["weight_bytes"] = weight_bytes
        bandwidth = [2 * n_copy * 4 / s for s in t["copy"]]
        hl_tps = _rate(N, t["headlab"])
        res.add("headlab_tokens_per_s", hl_tps, "tokens/s")
        res.add("transformers_tokens_per_s", _rate(N, t["transformers"]), "tokens/s")
        res.add("speed_vs_transformers", _ratios(t["transformers"], t["headlab"]), "x")
        res.add("copy_bandwidth_gb_per_s", [bw / 1e9 for bw in bandwidth], "GB/s")
        res.add("bandwidth_bound_tokens_per_s", [bw / weight_bytes for bw in bandwidth],
                "tokens/s")
        res.add("fraction_of_bandwidth_bound",
                [tps / (bw / weight_bytes) for tps, bw in zip(hl_tps, bandwidth, strict=True)],
                "fraction")
        res.add_target("speed_vs_transformers", target=1.5, op=">=",
                       what=f"{sizes.model.name} batch-1 greedy tokens/s vs transformers "
                            f"generate ({N} new tokens)")
        res.info.append(("fraction_of_bandwidth_bound",
                         "headlab decode tokens/s / memory-bandwidth bound"))
    finally:
        if models is None:
            cache.close()
    return res


# ---------------------------------------------------------------------- quality
def bench_quality(sizes: QualitySizes, *, device: str = "cpu",
                  models: ModelCache | None = None) -> BenchResult:
    """Held-out quality lost with michel (with and without the layer norm) and taylor vs
    random scores (3 seeds), real models."""
    import headlab
    from headlab.pruning import versus_random

    res = BenchResult("quality", config={**sizes.__dict__, "dtype": "float32"})
    res.method = {
        "data": "the bundled English text in blocks of the given length under the token "
                "budget, split in half (seed 0): scoring blocks choose the heads, held-out "
                "blocks measure",
        "pruning": f"headlab.prune_to_target(method, keep={sizes.keep}, schedule="
                   f"'iterative', step={sizes.step}) from the unpruned model, for "
                   f"{', '.join(sizes.methods)} and for random with seeds 0, 1, 2 "
                   "(headlab.pruning.versus_random)",
        "lost": "held-out perplexity increase (causal LM) or fidelity decrease (sentence "
                "embeddings) after pruning",
        "ratio": "lost with the method / mean lost with random (target <= 0.5, the "
                 "issue's bar, for michel without the layer l2 norm; michel with it, the "
                 "paper's default, and taylor are reported beside it)",
    }
    for name, seq_len, max_tokens in sizes.runs:
        model = headlab.load(name, device=device)
        blocks = headlab.make_blocks(headlab.load_texts(), model.tokenizer, kind=model.kind,
                                     seq_len=seq_len, max_tokens=max_tokens)
        scoring, heldout = headlab.split_blocks(blocks, seed=0)
        result = versus_random(model, headlab.prepare(model, scoring, seed=0),
                               headlab.prepare(model, heldout, seed=1),
                               method={m: QUALITY_VARIANTS[m][:2] for m in sizes.methods},
                               keep=sizes.keep, step=sizes.step, batch_size=sizes.batch)
        res.checks[f"{name}.result"] = result
        res.checks[f"{name}.tokens"] = {"scoring": int(scoring.attention_mask.sum()),
                                        "heldout": int(heldout.attention_mask.sum())}
        res.add(f"{name}.{result['metric']}_before", [result["before"]], result["metric"])
        res.add(f"{name}.random_lost", [v for k, v in result["lost"].items()
                                        if k.startswith("random:")], result["metric"])
        for method in sizes.methods:
            res.add(f"{name}.{method}_lost", [result["lost"][method]], result["metric"])
            res.add(f"{name}.{method}_over_random", [result["ratios"][method]], "x")
            what = (f"{name} {result['metric']} lost at keep {sizes.keep}, "
                    f"{QUALITY_VARIANTS[method][2]} / mean of 3 random seeds (S={seq_len}, "
                    f"{max_tokens} tokens)")
            if method == QUALITY_TARGETED:
                res.add_target(f"{name}.{method}_over_random", target=0.5, op="<=", what=what)
            else:
                res.info.append((f"{name}.{method}_over_random", what))
    return res


# ---------------------------------------------------------------------- driver
BENCHMARKS: dict[str, Callable[..., BenchResult]] = {
    "attention": bench_attention,
    "models": bench_models,
    "hooks": bench_hooks,
    "importance": bench_importance,
    "pruning": bench_pruning,
    "generate": bench_generate,
    "quality": bench_quality,
}


def _resolve_device(device: str) -> str:
    from headlab.errors import UserError

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: torch sees no CUDA device here "
                        f"(torch {torch.__version__}); use --device cpu")
    return device


def run_benchmarks(which: str, *, quick: bool, device: str, out: Path,
                   preset: str | None = None, threads: int | None = None) -> list[BenchResult]:
    """Run one benchmark or ``"all"``; write ``out/<name>.json`` for each and
    ``out/summary.md``; print the Markdown table of targets.

    ``preset`` ("full", "quick", "tiny") overrides ``quick``; ``threads`` overrides the
    thread count (see `_pinned_threads`). A benchmark that fails is
    recorded as failed (its JSON holds the error) and the others still run; a UserError
    naming the failures is raised at the end.
    """
    from headlab.errors import UserError

    names = list(BENCHMARKS) if which == "all" else [which]
    if which != "all" and which not in BENCHMARKS:
        raise UserError(f"unknown benchmark {which!r}; choose from "
                        f"{', '.join([*BENCHMARKS, 'all'])}")
    preset = preset or ("quick" if quick else "full")
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    device = _resolve_device(device)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    context = {"preset": preset, "device": device, "versions": versions(),
               "date": datetime.now(UTC).isoformat(timespec="seconds")}
    loads = [_load()]
    if loads[0] > _cores() - 0.5:
        log.warning("the machine is busy (load average %.1f on %d cores): timings will be "
                    "noisy, and OpenMP threads that spin while a sibling is preempted can make "
                    "multi-threaded forwards several times slower; OMP_WAIT_POLICY=PASSIVE "
                    "(set before starting) or HEADLAB_BENCH_THREADS=1 avoid that",
                    loads[0], _cores())
    results: list[BenchResult] = []
    cache = ModelCache(device)
    t_all = time.perf_counter()
    try:
        with _pinned_threads(threads) as threads:
            log.info("headlab bench %s (%s, %s, %d threads)", which, preset, device, threads)
            machine = machine_info(device)
            for name in names:
                log.info("%s ...", name)
                gc.collect()
                t0 = time.perf_counter()
                machine = machine_info(device)
                try:
                    result = BENCHMARKS[name](PRESETS[preset][name], device=device,
                                              models=cache)
                except Exception as exc:  # recorded, reported, and raised at the end
                    log.exception("benchmark %s failed", name)
                    result = BenchResult(name, error=f"{type(exc).__name__}: {exc}")
                result.elapsed_s = time.perf_counter() - t0
                machine["load_average_after"] = machine_info(device)["load_average"]
                loads.append(_load())
                results.append(result)
                atomic_write_json(out / f"{name}.json",
                                  result.to_json({**context, "machine": machine}))
                log.info("%s done in %.1f s -> %s", name, result.elapsed_s,
                         out / f"{name}.json")
    finally:
        cache.close()
    table = markdown_table(results)
    footer = (f"\n{preset} preset on {device}, {time.perf_counter() - t_all:.0f} s; "
              f"{machine['cpu']}, {_cores()} cores, {machine['torch_threads']} torch threads; "
              f"1-minute load average {min(loads):.1f}–{max(loads):.1f} during the run "
              f"(above the core count, other processes shared the cores)\n")
    atomic_write_text(out / "summary.md",
                      f"# headlab bench {which}\n\n{context['date']}\n\n{table}{footer}")
    sys.stdout.write(table + footer)
    sys.stdout.flush()
    failed = [r.name for r in results if r.error is not None]
    if failed:
        raise UserError(f"benchmarks failed: {', '.join(failed)} (see {out}/<name>.json)")
    return results
