"""``headlab bench attention``: headlab's MultiHeadAttention against
torch.nn.MultiheadAttention and against bare scaled_dot_product_attention between the
same projections; and whether a KV-cache decode step late in a long decode costs little
more than an early one."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from headlab._util.timing import ms, ratios, sync, time_interleaved
from headlab.bench._common import BenchResult, Timing, max_diff

__all__ = ["AttentionSizes", "bench_attention"]


@dataclass(frozen=True, kw_only=True)
class AttentionSizes(Timing):
    """One attention layer (E = ``d_model``, H = ``n_heads``) timed at each of ``seqs``;
    then ``decode_runs`` decodes of ``decode_tokens`` steps, their first and last
    ``decode_window`` steps compared."""

    d_model: int = 768
    n_heads: int = 12
    batch: int = 4
    seqs: tuple[int, ...] = (256, 1024)
    decode_tokens: int = 512
    decode_window: int = 64
    decode_runs: int = 7
    repeats: int = 7
    warmup: int = 2


def bench_attention(sizes: AttentionSizes, *, device: str = "cpu", models=None) -> BenchResult:
    """headlab MHA vs torch MHA and vs bare SDPA between the same projections; decode."""
    from headlab.attention import MultiHeadAttention
    from headlab.attention.kv_cache import KVCache

    E, H = sizes.d_model, sizes.n_heads
    D = E // H
    res = BenchResult.of_sizes("attention", sizes, mask="none (full self-attention)")
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
            res.checks[f"max_abs_diff_vs_torch_mha_S{S}"] = max_diff(
                out, ref(x, x, x, need_weights=False)[0])
            res.checks[f"max_abs_diff_vs_sdpa_S{S}"] = max_diff(out, sdpa_in_projections(x))
            t = time_interleaved(
                {"headlab": lambda x=x: mha(x),
                 "torch_mha": lambda x=x: ref(x, x, x, need_weights=False),
                 "sdpa": lambda x=x: sdpa_in_projections(x)},
                repeats=sizes.repeats, warmup=sizes.warmup, device=device)
            res.add(f"headlab_ms_S{S}", ms(t["headlab"]), "ms")
            res.add(f"torch_mha_ms_S{S}", ms(t["torch_mha"]), "ms")
            res.add(f"sdpa_in_projections_ms_S{S}", ms(t["sdpa"]), "ms")
            res.add(f"speed_vs_sdpa_S{S}", ratios(t["sdpa"], t["headlab"]), "x")
            res.add(f"speed_vs_torch_mha_S{S}", ratios(t["torch_mha"], t["headlab"]), "x")
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
                sync(device)
                t0 = time.perf_counter()
                mha(xs[i], causal=True, cache=cache)  # (1, 1, E) over T = i + 1 keys
                sync(device)
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
    res.add(f"decode_first{w}_steps_ms", ms(first), "ms")
    res.add(f"decode_last{w}_steps_ms", ms(last), "ms")
    res.add("decode_last_over_first", ratio, "x")
    res.add_target("decode_last_over_first", target=1.3, op="<=",
                   what=f"decode: last {w} of {n} steps / first {w} (KV cache)")
    return res
