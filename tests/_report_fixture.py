"""Synthetic results dicts in the results.json schema, for the report tests.

The attention sample is made of recognisable head types (previous token, first token,
self, broad) so the rendered report looks like a real run and the statistics and
clusters agree with the maps.
"""

from __future__ import annotations

import numpy as np

from headlab.report import encode_attention

_STORY = ("The old lighthouse keeper climbed the stairs at dusk , lit the lamp , and "
          "watched the ships pass . Every night the beam swept across the dark water , "
          "and every morning he wrote the names of the boats in a small blue book . "
          "Nobody read it , but he kept writing , because the sea deserved a witness")
_WORDS = _STORY.split()
_HEAD_TYPES = ["previous-token heads", "first-token heads", "self heads", "broad heads"]


def sample_tokens(n: int) -> list[str]:
    """n GPT-2-style tokens (leading space on words), cycling through a short story."""
    return [w if i == 0 else " " + w for i, w in enumerate(_WORDS[k % len(_WORDS)]
                                                          for k in range(n))]


def _head_pattern(kind: int, s: int, rng: np.random.Generator) -> np.ndarray:
    """One causal attention map (S, S), rows summing to 1."""
    causal = np.tril(np.ones((s, s)))
    logits = rng.normal(0.0, 0.5, (s, s))
    idx = np.arange(s)
    if kind == 0:
        logits[idx[1:], idx[:-1]] += 5.0
    elif kind == 1:
        logits[:, 0] += 4.0
    elif kind == 2:
        logits[idx, idx] += 4.0
    weights = np.exp(logits) * causal
    return weights / weights.sum(axis=1, keepdims=True)


def _statistics(att: np.ndarray, tokens: list[str]) -> list[dict]:
    """Per-head records as headlab.analysis would write them, from (L, H, S, S)."""
    n_layers, n_heads, s, _ = att.shape
    punct = np.array([t.strip() in {",", "."} for t in tokens])
    records = []
    for layer in range(n_layers):
        for head in range(n_heads):
            a = att[layer, head]
            records.append({
                "layer": layer, "head": head,
                "entropy": float(-(a * np.log(a + 1e-12)).sum(axis=1).mean()),
                "first": float(a[:, 0].mean()), "cls": 0.0, "sep": 0.0,
                "punct": float(a[:, punct].sum(axis=1).mean()),
                "self": float(np.diag(a).mean()),
                "prev": float(np.diag(a, -1).mean()),
                "next": float(np.diag(a, 1).mean()),
                "confidence": float(a.max(axis=1).mean()),
            })
    return records


def _curve(total: int, before: float, steepness: float) -> list[dict]:
    return [{"fraction_pruned": f, "quality": before * float(np.exp(steepness * f ** 2)),
             "heads_kept": round(total * (1 - f))} for f in np.linspace(0.0, 0.9, 10)]


def make_results(layers: int = 12, heads: int = 12, seq: int = 64, *, seed: int = 0,
                 keep: float = 0.6, tokens: list[str] | None = None) -> dict:
    """A complete pruned-run results dict; see score_only() for the other kind."""
    rng = np.random.default_rng(seed)
    tokens = tokens if tokens is not None else sample_tokens(seq)
    seq = len(tokens)
    kinds = rng.integers(0, len(_HEAD_TYPES), size=(layers, heads))
    att = np.stack([np.stack([_head_pattern(int(k), seq, rng) for k in row]) for row in kinds])

    importance = rng.gamma(2.0, 1.0, size=(layers, heads))
    importance /= np.linalg.norm(importance, axis=1, keepdims=True)  # layer-l2
    order = np.argsort(-importance, axis=None)[: round(keep * layers * heads)]
    kept = {str(layer): sorted(int(i) % heads for i in order if i // heads == layer)
            for layer in range(layers)}
    total = layers * heads
    kept_total = sum(len(v) for v in kept.values())
    stats = _statistics(att, tokens)
    coords = [[r["prev"] - r["first"] + rng.normal(0, 0.03), r["self"] - r["entropy"] / 5
               + rng.normal(0, 0.03)] for r in stats]
    return {
        "model": "tiny-gpt2", "family": "gpt2", "kind": "causal-lm",
        "method": "michel", "schedule": "iterative", "keep": keep,
        "data": {"spec": "bundled:english", "scoring_tokens": 4096, "heldout_tokens": 4096,
                 "seq_len": 256, "warning": None},
        "heads_total": total, "heads_kept": kept_total,
        "heads_per_layer": {"before": [heads] * layers,
                            "after": [len(kept[str(i)]) for i in range(layers)]},
        "kv_heads_per_layer": {"before": [heads] * layers,
                               "after": [len(kept[str(i)]) for i in range(layers)]},
        "kept_heads": kept,
        "importance": importance.tolist(),
        "importance_normalisation": "layer-l2",
        "quality": {"metric": "perplexity", "higher_is_better": False, "before": 12.3,
                    "after": 15.1, "loss_before": 2.51, "loss_after": 2.71},
        "curve": _curve(total, 12.3, 2.5),
        "curves": {"michel": _curve(total, 12.3, 2.5), "ablation": _curve(total, 12.3, 3.0),
                   "random": _curve(total, 12.3, 5.5)},
        "params": {"before": 124_439_808, "after": 110_000_000},
        "latency_ms": {"before": 40.1, "after": 31.2, "batch": 16, "seq_len": 128},
        "kv_cache_bytes_per_token": {"before": 36864, "after": 22118},
        "sample": {"text": "".join(tokens), "tokens": tokens,
                   "attention": encode_attention(att)},
        "statistics": stats,
        "clusters": {"labels": [int(k) for k in kinds.ravel()], "coords": coords,
                     "names": {str(i): n for i, n in enumerate(_HEAD_TYPES)},
                     "method": "kmeans+pca"},
        "config": {"model": "tiny-gpt2", "method": "michel", "keep": keep,
                   "data": {"spec": "bundled:english", "seq_len": 256}, "seed": seed},
        "files": {"results": "results.json", "importance_csv": "importance.csv",
                  "model": "model/"},
        "status": "complete", "created": "2026-12-02T10:00:00Z",
        "versions": {"headlab": "0.1.0", "torch": "2.13.0", "transformers": "5.0.0"},
    }


def score_only(results: dict) -> dict:
    """The same run as a score-only one: nothing pruned, every "after" figure null."""
    r = dict(results, kept_heads=None, keep=None, schedule=None,
             heads_kept=results["heads_total"], curve=None)
    r.pop("curves")
    r["quality"] = dict(results["quality"], after=None, loss_after=None)
    for key in ("params", "latency_ms", "kv_cache_bytes_per_token", "heads_per_layer",
                "kv_heads_per_layer"):
        r[key] = dict(results[key], after=None)
    r["files"] = {"results": "results.json", "importance_csv": "importance.csv"}
    return r
