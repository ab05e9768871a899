"""The long-context section of ``headlab bench generate``: the key/value cache after
kv-group pruning and after demotion, at the contexts where the cache is what costs.

Three models on the same weights: the model as it came, the model with half its GQA
groups removed (`select_groups` on michel scores, ``kv_keep``), and the model with those
same groups demoted to a sink + window cache. At each context: batch-1 greedy decoding
tokens/s (steps interleaved across the three, `headlab.evaluate.cache.decode_step_times`),
cache bytes held against the prediction from the kept groups, cache memory allocated;
at the longest context, the share of a decoding step spent in attention proper and the
speed-up demotion should give by it; serving headroom: the most rows each model's
cache fits in the budget the unpruned model's takes at ``headroom_rows`` rows
(`headlab.evaluate.cache.max_batch`), checked by decoding that batch, and its tokens/s;
held-out perplexity of one long block; and needle-in-a-haystack accuracy
(`headlab.evaluate.needle`, its filler the held-out text) on a grid of lengths, by
default past the demoted heads' sinks + window. The same number of groups demoted as the
retrieval detector and DuoAttention's gates choose them (`headlab.pruning.
demotion_scores`) is judged on the same perplexity and needle, each against removal.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from headlab.bench._common import BenchResult
from headlab.importance.gates import DEFAULT_STEPS as GATE_STEPS

__all__ = ["LongContextSizes", "long_context_section"]

# speed-up after demotion / the speed-up the attention share predicts, and after kv-group
# pruning / the speed-up the bytes a step reads predict, at the longest context
SPEEDUP_TARGET = 0.8
# perplexity (and needle accuracy) lost by demoting the groups / lost by removing them
QUALITY_TARGET = 0.5
# the same for the groups DuoAttention's gates choose (issue 34): (needle, perplexity)
GATES_TARGETS = {"long_needle": 0.25, "long_quality": 0.05}


@dataclass(frozen=True, kw_only=True)
class LongContextSizes:
    """Contexts (capped by the model's positions, ``None`` = the model's limit), decoding
    steps timed per context, the fraction of key/value heads kept, the demoted heads'
    budget, the scoring tokens, the held-out block's length (``None``: the longest
    context) and the needle grid (lengths past the model's limit are left out)."""

    contexts: tuple[int | None, ...] = (512, 2048, None)
    steps: int = 16
    kv_keep: float = 0.5
    sinks: int = 4
    window: int = 256
    scoring_tokens: int = 2048
    scoring_seq: int = 256
    quality_len: int | None = None
    needle_lengths: tuple[int, ...] = (1024, 2048)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    needle_trials: int = 2
    headroom_context: int = 2048  # capped by the model's positions
    headroom_rows: int = 2  # the budget: the unpruned model's cache at this many rows
    # what else chooses groups to demote, beside michel (`headlab.pruning.demotion_scores`)
    # and DuoAttention's gates' training steps
    choosers: tuple[str, ...] = ("retrieval", "gates")
    gate_steps: int = GATE_STEPS


def _tokens(model, n: int, seed: int) -> tuple[torch.Tensor, str]:
    """A (n,) token stream: the bundled text, repeated to length if it is short; random
    tokens for a model without a tokenizer."""
    tok = model.tokenizer
    if tok is None:
        return torch.randint(0, model.config.vocab_size, (n,),
                             generator=torch.Generator().manual_seed(seed)), "random tokens"
    from headlab.data.texts import bundled_text

    ids = torch.tensor(tok(bundled_text())["input_ids"])
    reps = math.ceil(n / ids.numel())
    what = "bundled text" if reps == 1 else f"bundled text repeated {reps}x"
    return ids.repeat(reps)[:n], what


@torch.inference_mode()
def _perplexity(model, ids: torch.Tensor, chunk: int = 1024) -> float:
    """Perplexity of one block (1, T), every position scored; logits in chunks."""
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    h = model.decode(ids, None, positions, 0, None)  # (1, T, E)
    total = 0.0
    for a in range(0, ids.shape[1] - 1, chunk):
        b = min(a + chunk, ids.shape[1] - 1)
        logits = model.lm_head(h[:, a:b]).float()  # (1, chunk, V)
        total += float(F.cross_entropy(logits[0], ids[0, a + 1:b + 1], reduction="sum"))
    return math.exp(total / (ids.shape[1] - 1))


def _cache_bytes(cache) -> tuple[int, int]:
    """Bytes of the entries held and bytes allocated by a model's cache."""
    from headlab.attention.streaming import StreamingCache

    held = alloc = 0
    for layer in cache.layers:
        full = layer.full if isinstance(layer, StreamingCache) else layer
        if full._k is not None:
            k = full._k
            held += 2 * k.shape[0] * k.shape[1] * full.length * k.shape[3] * k.element_size()
            alloc += 2 * k.numel() * k.element_size()
        if isinstance(layer, StreamingCache) and layer.k is not None:
            held += 2 * layer.k[:, :, : layer.filled].numel() * layer.k.element_size()
            alloc += 2 * layer.k.numel() * layer.k.element_size()
    return held, alloc


def long_context_section(res: BenchResult, model, sizes: LongContextSizes,
                         device: str) -> None:
    """Add the long-context figures, checks and targets to ``res`` (see the module)."""
    from headlab.attention.streaming import n_streaming
    from headlab.data.blocks import Blocks
    from headlab.evaluate.cache import (
        attention_share,
        bandwidth_speedup,
        decode_step_times,
        predicted_speedup,
    )
    from headlab.importance import score
    from headlab.pruning import copy_model, demote, prune
    from headlab.selection import heads_to_keep, kv_groups, select_groups

    limit = model.max_positions
    steps = sizes.steps
    # the prompt lengths: each context, or as much of the model's limit as the steps leave
    contexts = sorted({min(c or limit, limit - steps - 1) for c in sizes.contexts})
    quality_len = min(sizes.quality_len or max(contexts), limit)
    held_len = max((quality_len, *sizes.needle_lengths))  # the needle's filler too
    stream, source = _tokens(model, sizes.scoring_tokens + held_len, seed=5)
    stream = stream.to(device)
    n_blocks = sizes.scoring_tokens // sizes.scoring_seq
    scoring = stream[: n_blocks * sizes.scoring_seq].view(n_blocks, sizes.scoring_seq)
    held = stream[sizes.scoring_tokens:]  # (held_len,), after the scoring tokens
    heldout = held[:quality_len][None]  # (1, quality_len)
    scores = score(model, Blocks(scoring, torch.ones_like(scoring)), method="michel",
                   batch_size=4)
    groups = kv_groups(model)
    n_groups = sum(len(g) for g in groups)
    plan = select_groups(scores, groups, heads_to_keep(n_groups, keep=sizes.kv_keep))
    pruned = prune(copy_model(model), plan)
    demoted = demote(copy_model(model), plan.as_demotion(), sinks=sizes.sinks,
                     window=sizes.window)
    models = {"before": model, "pruned": pruned, "demoted": demoted}
    # the same number of groups demoted as other scores choose them: judged on quality
    chosen = _chosen_by(res, model, Blocks(scoring, torch.ones_like(scoring)),
                        heads_to_keep(n_groups, keep=sizes.kv_keep), sizes)
    res.method["long_context"] = (
        f"michel scores on {n_blocks} blocks of {sizes.scoring_seq} tokens ({source}); "
        f"kv-group pruning keeps {sizes.kv_keep} of the {n_groups} groups (group score = "
        f"sum of its query heads'); demotion keeps those same groups' heads with "
        f"{sizes.sinks} sinks + a {sizes.window}-position window. Decoding: batch 1, greedy, "
        f"one prefill of each context, then {steps} timed steps per model interleaved "
        "(torch's products); tokens/s = 1 / step time")
    res.method["long_context_attention_share"] = (
        "time from the query (after rotary) to the per-head outputs, summed over layers, / "
        "the whole decoding step, on the unpruned model at the longest context; predicted "
        "demotion speed-up = 1 / ((1 - share) + share x (kv_full + kv_demoted x min(1, "
        "(sinks + window) / context)) / kv_heads); predicted kv-group pruning speed-up = "
        "the bytes a step reads before / after: every weight once and the whole cache "
        "(headlab.evaluate.cache.step_bytes)")
    res.method["long_context_quality"] = (
        f"perplexity of one held-out block of {quality_len} tokens ({source}, after the "
        "scoring tokens), every position scored; lost = perplexity - the unpruned one")
    res.checks["long_context_groups"] = {"total": n_groups, "kept": n_groups - sum(
        n_streaming(a) for a in demoted.attentions)}
    for context in contexts:
        caches: dict[str, Any] = {}
        times = decode_step_times(models, context=context, steps=steps, caches=caches)
        for name, t in times.items():
            res.add(f"long_{name}_tokens_per_s_at_{context}", [1 / s for s in t], "tokens/s")
        res.add(f"long_demoted_speedup_at_{context}",
                [b / d for b, d in zip(times["before"], times["demoted"], strict=True)], "x")
        res.add(f"long_pruned_speedup_at_{context}",
                [b / p for b, p in zip(times["before"], times["pruned"], strict=True)], "x")
        _cache_figures(res, models, caches, context, steps)
    longest = contexts[-1]
    share = attention_share(model, context=longest, steps=steps)
    kv_dem = sum(n_streaming(a) for a in demoted.attentions)
    kv_full = sum(a.n_kv_heads for a in demoted.attentions) - kv_dem
    predicted = predicted_speedup(share, kv_full=kv_full, kv_demoted=kv_dem,
                                  slots=sizes.sinks + sizes.window, context=longest)
    res.checks["long_attention_share_at_longest"] = share
    _judge_speedup(res, "demoted", predicted, longest,
                   f"demoting {1 - sizes.kv_keep:g} of the groups", f"the attention share "
                   f"({share:.2f})")
    _judge_speedup(res, "pruned", bandwidth_speedup(model, pruned, context=longest), longest,
                   f"removing {1 - sizes.kv_keep:g} of the groups",
                   "the bytes a step reads (weights + cache)")
    _headroom(res, models, sizes)
    judged = {**models, **chosen}
    ppl = {name: _perplexity(m, heldout) for name, m in judged.items()}
    res.checks["long_perplexity"] = ppl
    for name in ["demoted", *chosen]:
        _lost_ratio(res, "long_quality", removed=ppl["pruned"] - ppl["before"],
                    demoted=ppl[name] - ppl["before"], name=name,
                    what=f"held-out perplexity lost at {quality_len} tokens: demoting the "
                         f"groups {_by(name)} / removing michel's")
    _needle_half(res, judged, held, sizes, source)


def _judge_speedup(res: BenchResult, name: str, predicted: float, context: int, done: str,
                   by: str) -> None:
    """Hold model ``name``'s measured decoding speed-up at ``context`` against the one
    ``by`` predicts (check ``long_predicted_<name>_speedup``)."""
    res.checks[f"long_predicted_{name}_speedup"] = predicted
    measured = res.figures[f"long_{name}_speedup_at_{context}"].samples
    res.add(f"long_{name}_speedup_over_predicted", [m / predicted for m in measured], "x")
    res.add_target(f"long_{name}_speedup_over_predicted", target=SPEEDUP_TARGET, op=">=",
                   what=f"decoding speed-up after {done} at {context} tokens / the speed-up "
                        f"{by} predicts ({predicted:.2f}x)")


def _by(name: str) -> str:
    """``demoted`` or ``demoted_by_<chooser>``: what chose the groups, in words."""
    return "michel chose" if name == "demoted" else f"{name.removeprefix('demoted_by_')} chose"


def _chosen_by(res: BenchResult, model, scoring, n_keep: int,
               sizes: LongContextSizes) -> dict[str, Any]:
    """``{"demoted_by_<chooser>": model}``: the model with the ``n_keep`` groups each of
    ``sizes.choosers`` scores highest kept whole and the rest demoted; the groups and,
    for the gates, the training seconds and alphas in ``res.checks``."""
    from headlab.pruning import copy_model, demote, demotion_group_score, demotion_scores
    from headlab.selection import kv_groups, select_groups

    out, checks = {}, {}
    for by in sizes.choosers:
        if model.tokenizer is None:  # the detectors' probes and the passkey prompts
            checks[by] = "not measured: the model has no tokenizer"
            continue
        t0 = time.perf_counter()
        scores = demotion_scores(model, by, scoring, sinks=sizes.sinks, window=sizes.window,
                                 **({"steps": sizes.gate_steps} if by == "gates" else {}))
        seconds = time.perf_counter() - t0
        plan = select_groups(scores, kv_groups(model), n_keep,
                             group_score=demotion_group_score(by, "sum"))
        out[f"demoted_by_{by}"] = demote(copy_model(model), plan.as_demotion(),
                                         sinks=sizes.sinks, window=sizes.window)
        checks[by] = {"demoted": {str(k): v for k, v in plan.pruned.items() if v},
                      "seconds": seconds, **({"alphas": scores.extra["alphas"]}
                                             if by == "gates" else {})}
    res.checks["long_choosers"] = checks
    res.method["long_context_choosers"] = (
        f"the same number of groups demoted as chosen by {', '.join(sizes.choosers)} "
        "(headlab.pruning.demotion_scores: a detector on its own probes, DuoAttention's "
        f"gates trained {sizes.gate_steps} steps on passkey prompts from the scoring "
        "tokens, a group scored by its max gate) and judged on held-out perplexity and the "
        "needle against removing michel's groups")
    return out


def _headroom(res: BenchResult, models: dict[str, Any], sizes: LongContextSizes) -> None:
    """Serving headroom: the budget is the unpruned model's cache at ``headroom_rows``
    rows holding a ``headroom_context``-token prompt and the decoded steps; each model
    decodes the most rows its cache fits in it (`max_batch`), and the cache it then
    holds is checked against the budget."""
    from headlab.evaluate.cache import decode_step_times, max_batch

    steps = sizes.steps
    context = min(sizes.headroom_context, models["before"].max_positions - steps - 1)
    length = context + steps + 1  # positions held after the last step
    budget = sizes.headroom_rows * models["before"].kv_cache_bytes(length)
    rows = {name: max_batch(m, length=length, budget_bytes=budget)
            for name, m in models.items()}
    caches: dict[str, Any] = {}
    times = decode_step_times(models, context=context, steps=steps, caches=caches,
                              batch=rows)
    res.method["long_context_headroom"] = (
        f"budget = the unpruned model's key/value cache at {sizes.headroom_rows} rows x "
        f"{length} positions ({budget} bytes); each model's batch = the most rows whose "
        f"cache fits (HeadModel.kv_cache_bytes), a {context}-token prompt then {steps} "
        "greedy steps interleaved; tokens/s = rows / step time")
    checks = {}
    for name, t in times.items():
        held, _ = _cache_bytes(caches[name])
        checks[name] = {"rows": rows[name], "held": held, "budget": budget,
                        "predicted": rows[name] * models[name].kv_cache_bytes(length)}
        res.add(f"long_{name}_headroom_rows", [rows[name]], "rows")
        res.add(f"long_{name}_headroom_tokens_per_s", [rows[name] / s for s in t], "tokens/s")
        res.add(f"long_{name}_headroom_over_budget_bytes", [max(0, held - budget)], "bytes")
        res.add_target(f"long_{name}_headroom_over_budget_bytes", target=0, op="<=",
                       what=f"cache held by {name} at its headroom batch ({rows[name]} rows, "
                            f"{length} positions) beyond the budget")
    res.checks["long_headroom"] = checks


def _needle_half(res: BenchResult, models: dict[str, Any], held: torch.Tensor,
                 sizes: LongContextSizes, source: str) -> None:
    """Needle accuracy of the three models on the same prompts, their filler the
    held-out tokens ``held`` (T,), and the target on demotion's loss over removal's."""
    from headlab.data.texts import TextData
    from headlab.evaluate.needle import ANSWER_TOKENS, needle_test

    limit, tok = models["before"].max_positions, models["before"].tokenizer
    # a length must leave the needle's answer tokens within the model's positions
    lengths = [n for n in sizes.needle_lengths if n + ANSWER_TOKENS <= limit]
    if tok is None or not lengths:
        res.checks["long_needle"] = "not measured: " + (
            "the model has no tokenizer" if tok is None
            else f"no needle length fits the model's {limit} positions")
        return
    filler = TextData([tok.decode(held.tolist())], spec=f"the held-out tokens ({source})")
    depths = list(sizes.needle_depths)
    # one prompt at a time: a left-padded row's pads would fill the demoted sinks
    grids = {name: needle_test(m, lengths=lengths, depths=depths, trials=sizes.needle_trials,
                               filler=filler, seed=0, batch_size=1)
             for name, m in models.items()}
    res.method["long_context_needle"] = (
        f"headlab.evaluate.needle.needle_test at {lengths} tokens, fact at depths {depths}, "
        f"{sizes.needle_trials} prompt(s) per cell (seed 0, the same prompts for every "
        f"model), filler = {filler.spec}, greedy answers one prompt at a time; accuracy = "
        "exact-match fraction over the grid; lost = the unpruned accuracy - the model's")
    res.checks["long_needle"] = {name: g.to_json() for name, g in grids.items()}
    for name, g in grids.items():
        res.add(f"long_{name}_needle_accuracy", [g.mean], "fraction")
    before = grids["before"].mean
    for name in [n for n in grids if n.startswith("demoted")]:
        _lost_ratio(res, "long_needle", removed=before - grids["pruned"].mean,
                    demoted=before - grids[name].mean, name=name,
                    what=f"needle accuracy lost at {'/'.join(map(str, lengths))} tokens: "
                         f"demoting the groups {_by(name)} / removing michel's")


def _lost_ratio(res: BenchResult, prefix: str, *, removed: float, demoted: float,
                what: str, name: str = "demoted") -> None:
    """The target ``<prefix>_lost_<name>_over_removed``: what demoting the groups (michel's,
    or ``demoted_by_<chooser>``'s) loses over what removing michel's loses, at most
    `QUALITY_TARGET` (michel's), `GATES_TARGETS` (the gates'), or reported only. Where
    removal loses nothing the ratio is undefined: no figure and no target, and the check
    ``<prefix>_target`` says so (it is not a pass)."""
    if not removed > 0:
        res.checks[f"{prefix}_target"] = (
            f"not judged: removing the groups lost nothing ({removed:+.4g}; demoting "
            f"them {demoted:+.4g}), so the ratio is undefined")
        return
    figure = f"{prefix}_lost_{name}_over_removed"
    res.add(figure, [demoted / removed], "x")
    target = {"demoted": QUALITY_TARGET, "demoted_by_gates": GATES_TARGETS.get(prefix)}
    if target.get(name) is not None:
        res.add_target(figure, target=target[name], op="<=", what=what)


def _cache_figures(res: BenchResult, models: dict[str, Any], caches: dict[str, Any],
                   context: int, steps: int) -> None:
    """Cache bytes after the timed decoding (``context`` + ``steps`` + 1 positions): held
    vs predicted from the kept and demoted groups (`HeadModel.kv_cache_bytes`), and
    allocated (the full caches grow by doubling; the ring buffers are allocated whole)."""
    length = context + steps + 1
    held_all: dict[str, Any] = {}
    for name, m in models.items():
        held, alloc = _cache_bytes(caches[name])
        predicted = m.kv_cache_bytes(length)
        held_all[name] = {"held": held, "predicted": predicted, "allocated": alloc,
                          "positions": caches[name].length}
        res.add(f"long_{name}_cache_bytes_at_{context}", [held], "bytes")
        res.add(f"long_{name}_cache_allocated_bytes_at_{context}", [alloc], "bytes")
        res.add(f"long_{name}_cache_error_bytes_at_{context}", [abs(held - predicted)],
                "bytes")
        if name != "before":
            res.add_target(f"long_{name}_cache_error_bytes_at_{context}", target=0, op="<=",
                           what=f"cache bytes held off the prediction from the kept groups, "
                                f"{name}, {length} positions")
    res.checks[f"long_cache_bytes_at_{context}"] = held_all
    res.checks[f"long_cache_ratio_at_{context}"] = {
        name: held_all[name]["held"] / held_all["before"]["held"] for name in held_all}
