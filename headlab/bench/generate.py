"""``headlab bench generate``: batch-1 greedy decoding tokens/s of `headlab.models.generation`
with its decoding kernel, with torch's products (``decode_kernel=False``) and of
transformers' generate on the same weights, all in the same interleaved rounds; and the
fraction of the memory-bandwidth bound (every new token reads every weight once)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headlab._util.timing import rate, ratios, time_interleaved
from headlab.bench._common import BenchResult, Timing
from headlab.bench._models import SMOLLM2, ModelCache, ModelSpec, model_cache, random_ids
from headlab.bench.long_context import LongContextSizes, long_context_section

__all__ = ["KERNEL_TARGET", "GenerateSizes", "bench_generate"]

# the decoding kernel earns its place only at this speed-up over torch's products
KERNEL_TARGET = 1.3


@dataclass(frozen=True, kw_only=True)
class GenerateSizes(Timing):
    """Batch-1 greedy decoding of ``new_tokens`` after a ``prompt``-token prompt; the
    memory bandwidth from copying a ``copy_mib`` MiB tensor in the same rounds."""

    model: ModelSpec = SMOLLM2
    prompt: int = 16
    new_tokens: int = 128
    copy_mib: int = 512
    # the key/value cache after kv-group pruning and demotion (None: skipped)
    long_context: LongContextSizes | None = LongContextSizes()


def _agree(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many tokens two continuations share before their first difference."""
    same = (a[: b.numel()] == b[: a.numel()]).tolist()
    return same.index(False) if False in same else len(same)


def bench_generate(sizes: GenerateSizes, *, device: str = "cpu",
                   models: ModelCache | None = None) -> BenchResult:
    """Batch-1 greedy decoding tokens/s: kernel vs torch's products vs transformers."""
    from headlab.evaluate.cache import step_bytes
    from headlab.models import kernels
    from headlab.models.generation import generate

    N = sizes.new_tokens
    res = BenchResult.of_sizes("generate", sizes, batch=1)
    res.method = {
        "headlab": f"headlab.models.generation.generate(model, prompt, max_new_tokens={N}, "
                   "eos_token_id=()) (greedy, never stops early; decode steps on the C "
                   "kernel, decode_kernel=True)",
        "headlab_torch_products": "the same call with decode_kernel=False: every product "
                                  "torch's F.linear",
        "transformers": f"model.generate(prompt, max_new_tokens={N}, min_new_tokens={N}, "
                        "do_sample=False) on the same weights (sdpa, default dynamic cache)",
        "tokens_per_s": f"{N} new tokens / wall time of the whole call (prefill of a "
                        f"{sizes.prompt}-token prompt included)",
        "kernel_over_torch_products": "torch-products time / kernel time per round "
                                      f"(target >= {KERNEL_TARGET}: below it the kernel goes)",
        "bandwidth": f"copy of a {sizes.copy_mib} MiB tensor, timed in the same rounds; "
                     "bandwidth = bytes read + bytes written / time",
        "bound": "each new token reads every weight once: bound tokens/s = bandwidth / "
                 "weight bytes (parameters counted once, a tied embedding once)",
    }
    with model_cache(models, device) as cache:
        model, hf, source = cache.pair(sizes.model)
        res.checks["weights"] = source
        res.checks["decode_products"] = kernels.status() if device == "cpu" else "torch"
        prompt = random_ids(model.config.vocab_size, 1, sizes.prompt, device, seed=3)
        mask = torch.ones_like(prompt)
        eos = hf.config.eos_token_id
        pad = hf.config.pad_token_id
        if pad is None:
            pad = (eos[0] if isinstance(eos, list) else eos) or 0
        n_copy = sizes.copy_mib * 2**20 // 4
        src = torch.ones(n_copy, device=device)
        dst = torch.empty_like(src)
        weight_bytes = step_bytes(model, 0)  # the weights alone
        outs: dict[str, torch.Tensor] = {}

        def run_headlab(kernel: bool):
            name = "headlab" if kernel else "headlab_torch_products"
            outs[name] = generate(model, prompt, max_new_tokens=N, eos_token_id=(),
                                  decode_kernel=kernel)

        def run_hf():
            outs["transformers"] = hf.generate(
                prompt, attention_mask=mask, max_new_tokens=N, min_new_tokens=N,
                do_sample=False, pad_token_id=pad)

        with torch.inference_mode():
            t = time_interleaved({"headlab": lambda: run_headlab(True),
                                   "torch": lambda: run_headlab(False),
                                   "transformers": run_hf,
                                   "copy": lambda: dst.copy_(src)},
                                  repeats=sizes.repeats, warmup=sizes.warmup, device=device)
        new = {k: v[0, sizes.prompt:] for k, v in outs.items()}
        res.checks["new_tokens"] = {k: int(v.numel()) for k, v in new.items()}
        res.checks["greedy_tokens_agree_before_first_difference"] = _agree(
            new["headlab"], new["transformers"])
        res.checks["kernel_and_torch_products_agree_before_first_difference"] = _agree(
            new["headlab"], new["headlab_torch_products"])
        res.checks["weight_bytes"] = weight_bytes
        bandwidth = [2 * n_copy * 4 / s for s in t["copy"]]
        hl_tps = rate(N, t["headlab"])
        res.add("headlab_tokens_per_s", hl_tps, "tokens/s")
        res.add("headlab_torch_products_tokens_per_s", rate(N, t["torch"]), "tokens/s")
        res.add("transformers_tokens_per_s", rate(N, t["transformers"]), "tokens/s")
        res.add("speed_vs_transformers", ratios(t["transformers"], t["headlab"]), "x")
        res.add("kernel_over_torch_products", ratios(t["torch"], t["headlab"]), "x")
        res.add("copy_bandwidth_gb_per_s", [bw / 1e9 for bw in bandwidth], "GB/s")
        res.add("bandwidth_bound_tokens_per_s", [bw / weight_bytes for bw in bandwidth],
                "tokens/s")
        res.add("fraction_of_bandwidth_bound",
                [tps / (bw / weight_bytes) for tps, bw in zip(hl_tps, bandwidth, strict=True)],
                "fraction")
        res.add_target("speed_vs_transformers", target=1.5, op=">=",
                       what=f"{sizes.model.name} batch-1 greedy tokens/s vs transformers "
                            f"generate ({N} new tokens)")
        res.add_target("kernel_over_torch_products", target=KERNEL_TARGET, op=">=",
                       what=f"{sizes.model.name} batch-1 greedy tokens/s, decoding kernel vs "
                            f"torch's products ({N} new tokens)")
        res.info.append(("fraction_of_bandwidth_bound",
                         "headlab decode tokens/s / memory-bandwidth bound"))
        if sizes.long_context is not None:
            long_context_section(res, model, sizes.long_context, device)
    return res
