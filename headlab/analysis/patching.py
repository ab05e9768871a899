"""Activation patching per head, with bootstrap confidence intervals over prompt pairs.

For each pair (clean, corrupted) of equally long prompts and each head h:

    denoising   run the corrupted prompt with h's activation taken from the clean run:
                effect = (m(patched) - m(corrupted)) / (m(clean) - m(corrupted)),
                1 = the head alone restores the clean behaviour
    noising     run the clean prompt with h's activation taken from the corrupted run:
                effect = (m(clean) - m(patched)) / (m(clean) - m(corrupted)),
                1 = corrupting the head alone breaks it
with m the metric's mean over pairs (a ratio of means: a pair whose clean and
corrupted metrics nearly agree cannot blow it up). The 95% interval resamples the pairs
with replacement (percentile bootstrap). Sites are per query head: ``z`` (each head's
output before W_O), ``q`` or ``pattern``, so under GQA each query head is patched alone
while its group's keys and values stay as they are. Only each layer's activation at the
site is cached (never a (B, H, S, T) pattern unless the site is ``pattern``).
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from headlab._util.html import head_map, signed_colour
from headlab._util.progress import track
from headlab.attention.hooks import capture, hooks
from headlab.data.tokens import prompt_ids, token_ids
from headlab.errors import UserError
from headlab.models.base import HeadModel

__all__ = ["LogitDiff", "PatchingResult", "logit_diff", "patch", "patched_metric"]

SITES = {"z": 2, "q": 2, "pattern": 1}  # the dim that holds heads

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


Tokens = torch.Tensor | int | str | Sequence[int | str]


@dataclass(frozen=True)
class LogitDiff:
    """A metric: logit(target[i]) - logit(foil[i]) at ``position`` of example i, with
    ``metric(logits (B, S, V), index (B,)) -> (B,)``. Tokens given as text are read by
    the tokenizer `for_tokenizer` binds (`patch` binds the model's); one token stands
    for every example."""

    target: Tokens
    foil: Tokens
    position: int = -1
    tokenizer: object = None

    def for_tokenizer(self, tokenizer) -> LogitDiff:
        return self if self.tokenizer is not None else replace(self, tokenizer=tokenizer)

    def __call__(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        last = logits[:, self.position].double()  # (B, V)
        rows = torch.arange(len(index), device=last.device)
        t, f = (self._pick(x, index).to(last.device) for x in (self.target, self.foil))
        return last[rows, t] - last[rows, f]

    def _pick(self, tokens: Tokens, index: torch.Tensor) -> torch.Tensor:
        ids = token_ids(self.tokenizer, tokens)  # (N,) or (1,)
        return ids.expand(len(index)) if len(ids) == 1 else ids[index.to(ids.device)]


def logit_diff(target: Tokens, foil: Tokens, position: int = -1, *,
               tokenizer=None) -> LogitDiff:
    """The `LogitDiff` metric: targets and foils as ids (N,), one-token strings
    (``" Mary"``), or one token for every example."""
    return LogitDiff(target, foil, position, tokenizer)


@dataclass
class PatchingResult:
    """Per-head effects (layers x original heads, NaN for pruned heads) and their 95%
    bootstrap intervals, for denoising and noising; the clean and corrupted metrics."""

    site: str
    denoise: list[list[float]]
    denoise_ci: list[list[tuple[float, float]]]
    noise: list[list[float]]
    noise_ci: list[list[tuple[float, float]]]
    clean: float
    corrupted: float
    n_pairs: int
    n_boot: int

    def top(self, k: int = 10, *, which: str = "denoise") -> list[tuple[int, int, float]]:
        grid = self.denoise if which == "denoise" else self.noise
        flat = [(layer, head, v) for layer, row in enumerate(grid) for head, v in enumerate(row)
                if not math.isnan(v)]
        return sorted(flat, key=lambda x: -abs(x[2]))[:k]

    def to_json(self) -> dict:
        def clean_nan(x):
            if isinstance(x, float):
                return None if math.isnan(x) else x
            return [clean_nan(v) for v in x]
        return {"site": self.site, "denoise": clean_nan(self.denoise),
                "denoise_ci": clean_nan(self.denoise_ci), "noise": clean_nan(self.noise),
                "noise_ci": clean_nan(self.noise_ci), "clean": self.clean,
                "corrupted": self.corrupted, "n_pairs": self.n_pairs, "n_boot": self.n_boot}

    def _repr_html_(self) -> str:
        def cell(layer: int, head: int, v: float) -> tuple[str, str, str]:
            lo, hi = self.denoise_ci[layer][head]
            return (signed_colour(v, 1.0), f"L{layer} H{head}: {v:+.3f} [{lo:+.3f}, "
                    f"{hi:+.3f}], noising {self.noise[layer][head]:+.3f}", f"{v:+.2f}")

        return head_map(self.denoise, cell, caption=(
            f"<b>activation patching</b> at {html.escape(self.site)}, {self.n_pairs} pairs: "
            f"metric clean {self.clean:.4g}, corrupted {self.corrupted:.4g}; denoising effect "
            "per head (hover: 95% interval, noising)"))


@torch.no_grad()
def patch(model: HeadModel, clean: torch.Tensor | Sequence[str],
          corrupted: torch.Tensor | Sequence[str], *, metric: Metric,
          site: str = "z", heads: dict[int, list[int]] | None = None, batch_size: int = 8,
          n_boot: int = 1000, seed: int = 0) -> PatchingResult:
    """Patch each head (or only ``heads``: {layer: original ids}) between ``clean`` and
    ``corrupted`` prompts, input ids (N, S) or texts of equal token counts, measured
    by ``metric`` (see `logit_diff`). The heads of a layer are patched in one batch, a
    row per (head, pair): ``batch_size`` pairs make batch_size x heads rows."""
    clean, corrupted = (prompt_ids(model.tokenizer, p) for p in (clean, corrupted))
    if isinstance(metric, LogitDiff):
        metric = metric.for_tokenizer(model.tokenizer)
    if site not in SITES:
        raise UserError(f"patching site {site!r}: choose from {', '.join(SITES)}")
    if clean.shape != corrupted.shape or clean.dim() != 2:
        raise UserError(f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} "
                        "must be input ids of the same shape (N, S): pairs of prompts with "
                        "the same number of tokens")
    was_training = model.training
    model.eval()
    try:
        cache_clean, m_clean = _run(model, clean, metric, site, batch_size)
        cache_corr, m_corr = _run(model, corrupted, metric, site, batch_size)
        jobs = {i: [(p, h) for p, h in enumerate(a.head_ids.tolist())
                    if heads is None or h in heads.get(i, ())]
                for i, a in enumerate(model.attentions)}
        jobs = {i: job for i, job in jobs.items() if job}
        shape = (model.n_layers, model.n_original_heads)
        per_pair = {"denoise": {}, "noise": {}}
        n_heads = sum(len(job) for job in jobs.values())
        for layer in track(jobs, total=n_heads, size=lambda layer: len(jobs[layer]),
                           unit="heads", description=f"patching {n_heads} heads, both ways"):
            positions = [p for p, _ in jobs[layer]]
            for which, receiver, source in (("denoise", corrupted, cache_clean),
                                            ("noise", clean, cache_corr)):
                each = _patched_each(model, receiver, source, metric, site, layer, positions,
                                     batch_size)
                for (_, head), m in zip(jobs[layer], each, strict=True):
                    per_pair[which][layer, head] = m
    finally:
        model.train(was_training)
    gen = torch.Generator().manual_seed(seed)
    n = len(clean)
    resample = torch.randint(n, (n_boot, n), generator=gen)  # (n_boot, N)
    out = {}
    for which, values in per_pair.items():
        effect = torch.full(shape, math.nan, dtype=torch.float64)
        lo, hi = effect.clone(), effect.clone()
        for (layer, head), m in values.items():
            e = _effect(which, m[None], m_clean[None], m_corr[None])[0]
            boot = _effect(which, m[resample], m_clean[resample], m_corr[resample])
            effect[layer, head] = e
            lo[layer, head], hi[layer, head] = torch.quantile(boot, torch.tensor(
                [0.025, 0.975], dtype=torch.float64)).tolist()
        ci = [[(lo[i, j].item(), hi[i, j].item()) for j in range(shape[1])]
              for i in range(shape[0])]
        out[which] = (effect.tolist(), ci)
    return PatchingResult(site, *out["denoise"], *out["noise"], float(m_clean.mean()),
                          float(m_corr.mean()), n, n_boot)


def _effect(which: str, patched, clean, corrupted) -> torch.Tensor:
    """Ratio of means over the last dim: (B, N) each -> (B,)."""
    span = clean.mean(-1) - corrupted.mean(-1)
    if which == "denoise":
        return (patched.mean(-1) - corrupted.mean(-1)) / span
    return (clean.mean(-1) - patched.mean(-1)) / span


def _run(model, ids, metric, site, batch_size):
    """Each layer's activation at ``site`` on ``ids`` (CPU, by layer) and the metric (N,)."""
    cache: dict[int, list[torch.Tensor]] = {}
    values = []
    for start in range(0, len(ids), batch_size):
        batch = ids[start:start + batch_size].to(model.device)
        with capture(model, site) as cap:
            logits = model(batch).logits
        for name, t in cap.items():
            cache.setdefault(int(name.split(".")[1]), []).append(t)
        values.append(metric(logits, torch.arange(start, start + len(batch))).cpu())
    return {k: torch.cat(v) for k, v in cache.items()}, torch.cat(values).double()


@torch.no_grad()
def patched_metric(model: HeadModel, receiver: torch.Tensor, donor: torch.Tensor, *,
                   metric: Metric, heads: dict[int, list[int]], site: str = "z",
                   batch_size: int = 8) -> torch.Tensor:
    """The metric (N,) on ``receiver`` ids with the ``heads`` ({layer: original ids}) at
    ``site`` all taken at once from the run on ``donor`` ids."""
    if isinstance(metric, LogitDiff):
        metric = metric.for_tokenizer(model.tokenizer)
    source, _ = _run(model, donor, metric, site, batch_size)
    where = {}
    for layer, ids in heads.items():
        pos = [p for p, h in enumerate(model.attentions[layer].head_ids.tolist()) if h in ids]
        if pos:
            where[layer] = pos
    return _patched(model, receiver, source, metric, site, where, batch_size)


def _patched_each(model, ids, source, metric, site, layer: int, positions: list[int],
                  batch_size) -> torch.Tensor:
    """The metric (K, N) on ``ids`` with each of the K head ``positions`` of ``layer``
    alone replaced by ``source``'s activation at the site: one batch holds the K heads'
    copies of up to ``batch_size`` pairs, row k * n + j patching head k of pair j."""
    dim = SITES[site]
    k = len(positions)
    values = []
    for start in range(0, len(ids), batch_size):
        batch = ids[start:start + batch_size].to(model.device)
        n = len(batch)
        donor = source[layer][start:start + n].to(model.device)

        def fn(t: torch.Tensor, _name: str, _donor=donor, _n=n) -> torch.Tensor:
            t = t.clone()  # (K * n, ...), the heads along ``dim``
            for row, pos in enumerate(positions):
                rows = t[row * _n:(row + 1) * _n]
                rows.select(dim, pos).copy_(_donor.select(dim, pos).to(t.dtype))
            return t

        with hooks(model, {f"blocks.{layer}.attn.{site}": fn}):
            logits = model(batch.repeat(k, 1)).logits  # (K * n, S, V)
        index = torch.arange(start, start + n).repeat(k)
        values.append(metric(logits, index).cpu().view(k, n))
    return torch.cat(values, dim=1).double()  # (K, N)


def _patched(model, ids, source, metric, site, where: dict[int, list[int]],
             batch_size) -> torch.Tensor:
    """The metric (N,) on ``ids`` with the heads at positions ``where`` ({layer: head
    positions}) replaced by ``source``'s activation at the site."""
    dim = SITES[site]
    values = []
    for start in range(0, len(ids), batch_size):
        batch = ids[start:start + batch_size].to(model.device)
        fns = {}
        for layer, positions in where.items():
            index = torch.tensor(positions, device=model.device)
            donor = source[layer][start:start + len(batch)].to(model.device)

            def fn(t: torch.Tensor, _name: str, _donor=donor, _index=index) -> torch.Tensor:
                t = t.clone()
                t.index_copy_(dim, _index, _donor.index_select(dim, _index).to(t.dtype))
                return t

            fns[f"blocks.{layer}.attn.{site}"] = fn
        with hooks(model, fns):
            logits = model(batch).logits
        values.append(metric(logits, torch.arange(start, start + len(batch))).cpu())
    return torch.cat(values).double()
