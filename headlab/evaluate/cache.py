"""What pruning or demotion did to the key/value cache: bytes per token at the
evaluation length and at the model's maximum length, and decoding speed at several
context lengths, measured before and after in the same interleaved steps.

Decoding speed is timed per step: each model prefills ``context`` random tokens once,
then the models take their greedy decoding steps in turn (step i of each, in a rotated
order), so load that comes and goes on a shared machine falls on all of them. Every
product is torch's (the decode kernel of `headlab.models.generation` is not switched on).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from headlab._util.timing import sync

if TYPE_CHECKING:
    from headlab.models.base import HeadModel


@dataclass
class DecodeSpeed:
    """Greedy decoding tokens/s with ``context`` positions in the cache, batch 1."""

    context: int
    before: float | None = None
    after: float | None = None
    steps: int = 0


@dataclass
class KVCacheReport:
    """The key/value cache before and after a prune (or demotion) run."""

    unit: str = "head"
    group_score: str | None = None
    selection: str | None = None  # what chose the groups: a method's name, "<kind> detector"
    demoted: dict[int, list[int]] = field(default_factory=dict)  # layer -> query heads
    sinks: int | None = None
    window: int | None = None
    eval_length: int | None = None
    max_length: int | None = None
    bytes_per_token_eval: tuple[float | None, float | None] = (None, None)  # before, after
    bytes_per_token_max: tuple[float | None, float | None] = (None, None)
    decode: list[DecodeSpeed] = field(default_factory=list)
    quality_removed: float | None = None  # held-out quality with the demoted groups removed
    # selection "gates": each layer's DuoAttention gates, one per key/value head
    alphas: list[list[float]] | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["demoted"] = {str(k): v for k, v in self.demoted.items()}
        d["bytes_per_token_eval"] = dict(zip(("before", "after"), self.bytes_per_token_eval,
                                             strict=True))
        d["bytes_per_token_max"] = dict(zip(("before", "after"), self.bytes_per_token_max,
                                            strict=True))
        return d

    @classmethod
    def from_json(cls, d: Any) -> KVCacheReport | None:
        """From `to_json`; None for anything that is not such a dict."""
        if not isinstance(d, dict):
            return None

        def pair(x) -> tuple[float | None, float | None]:
            x = x if isinstance(x, dict) else {}
            return (_num(x.get("before")), _num(x.get("after")))

        decode = [DecodeSpeed(int(s["context"]), _num(s.get("before")), _num(s.get("after")),
                              int(s.get("steps") or 0))
                  for s in d.get("decode") or [] if isinstance(s, dict) and "context" in s]
        demoted = d.get("demoted") if isinstance(d.get("demoted"), dict) else {}
        return cls(
            unit=str(d.get("unit") or "head"), group_score=d.get("group_score"),
            selection=d.get("selection"),
            demoted={int(k): [int(h) for h in v] for k, v in demoted.items()},
            sinks=d.get("sinks"), window=d.get("window"), eval_length=d.get("eval_length"),
            max_length=d.get("max_length"), bytes_per_token_eval=pair(
                d.get("bytes_per_token_eval")),
            bytes_per_token_max=pair(d.get("bytes_per_token_max")), decode=decode,
            quality_removed=_num(d.get("quality_removed")), alphas=_rows(d.get("alphas")))


def _rows(x: Any) -> list[list[float]] | None:
    """A list of rows of numbers, or None for anything else."""
    if not isinstance(x, list) or not all(
            isinstance(row, list) and all(_num(v) is not None for v in row) for row in x):
        return None
    return [[float(v) for v in row] for row in x]


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


@torch.inference_mode()
def decode_step_times(models: Mapping[str, HeadModel], *, context: int, steps: int,
                      seed: int = 0, caches: dict | None = None,
                      batch: int | Mapping[str, int] = 1) -> dict[str, list[float]]:
    """Seconds per greedy decoding step of each model after a ``context``-token prompt
    (random tokens; ``batch`` rows, or rows per model), the models' steps interleaved;
    one untimed warm-up step. ``caches``, when given, receives each model's cache at
    the end."""
    first = next(iter(models.values()))
    vocab = first.config.vocab_size
    device = first.device
    rows = {name: batch if isinstance(batch, int) else batch[name] for name in models}
    prompt = torch.randint(0, vocab, (max(rows.values()), context),
                           generator=torch.Generator().manual_seed(seed)).to(device)
    state = {}
    for name, model in models.items():
        cache = model.new_cache()
        logits = model(prompt[:rows[name]], cache=cache).logits
        state[name] = (cache, logits[:, -1:].argmax(-1))
    names = list(models)
    out: dict[str, list[float]] = {n: [] for n in names}
    for step in range(steps + 1):
        k = step % len(names)
        for name in names[k:] + names[:k]:
            cache, token = state[name]
            sync(device.type)
            t0 = time.perf_counter()
            logits = models[name](token, cache=cache).logits
            token = logits[:, -1:].argmax(-1)
            sync(device.type)
            if step:  # the first step warms up
                out[name].append(time.perf_counter() - t0)
            state[name] = (cache, token)
    if caches is not None:
        caches.update({name: cache for name, (cache, _) in state.items()})
    return out


@torch.inference_mode()
def attention_share(model: HeadModel, *, context: int, steps: int, seed: int = 0) -> float:
    """The fraction of a decoding step spent in attention proper (from the query after
    rotary to the per-head outputs: the cache, scores, softmax and weighted values; the
    projections excluded), at ``context`` positions, median over ``steps`` steps."""
    marks: list[float] = []
    hooks = []
    for attn in model.attentions:
        hooks.append(attn.q.register_forward_hook(lambda *_: marks.append(time.perf_counter())))
        hooks.append(attn.z.register_forward_hook(lambda *_: marks.append(time.perf_counter())))
    try:
        shares = []
        prompt = torch.randint(0, model.config.vocab_size, (1, context),
                               generator=torch.Generator().manual_seed(seed)).to(model.device)
        cache = model.new_cache()
        token = model(prompt, cache=cache).logits[:, -1:].argmax(-1)
        for step in range(steps + 1):
            marks.clear()
            t0 = time.perf_counter()
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
            total = time.perf_counter() - t0
            inside = sum(b - a for a, b in zip(marks[::2], marks[1::2], strict=True))
            if step:
                shares.append(inside / total)
    finally:
        for h in hooks:
            h.remove()
    return statistics.median(shares)


def predicted_speedup(share: float, *, kv_full: int, kv_demoted: int, slots: int,
                      context: int) -> float:
    """The step speed-up that demotion buys if attention time scales with the keys each
    key/value head reads: the demoted ones read ``slots`` (sinks + window) keys instead
    of ``context``; every other part of the step is unchanged."""
    kv = kv_full + kv_demoted
    after = (kv_full + kv_demoted * min(1.0, slots / context)) / kv
    return 1.0 / ((1 - share) + share * after)


def step_bytes(model: HeadModel, context: int) -> int:
    """The bytes a batch-1 decoding step reads at ``context`` positions: every weight
    once (the output head reads its whole matrix; a tied one is counted once) and the
    whole key/value cache. An untied input embedding, of which a step reads one row, is
    counted whole: a small overestimate."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights + model.kv_cache_bytes(context)


def bandwidth_speedup(before: HeadModel, after: HeadModel, *, context: int) -> float:
    """The decoding speed-up ``after`` should give if a step is bound by the bytes it
    reads (`step_bytes`), as batch-1 decoding on a CPU is."""
    return step_bytes(before, context) / step_bytes(after, context)


def max_batch(model: HeadModel, *, length: int, budget_bytes: int) -> int:
    """The most rows whose key/value cache holding ``length`` positions fits in
    ``budget_bytes``: each row holds `HeadModel.kv_cache_bytes` (the kept key/value
    heads every position, demoted ones at most sinks + window)."""
    per_row = model.kv_cache_bytes(length)
    if per_row <= 0:
        raise ValueError(f"{model.family} holds no key/value cache: every batch fits")
    return budget_bytes // per_row


def measure_decode(before: HeadModel, after: HeadModel, *, contexts: list[int],
                   steps: int) -> list[DecodeSpeed]:
    """Tokens/s of both models at each context (capped by the model's positions)."""
    out = []
    limit = before.max_positions
    for context in contexts:
        if context + steps + 1 > limit:
            context = limit - steps - 1
        t = decode_step_times({"before": before, "after": after}, context=context,
                              steps=steps)
        out.append(DecodeSpeed(context, 1 / statistics.median(t["before"]),
                               1 / statistics.median(t["after"]), steps))
    return out
