"""Head importance scorers. Higher score = more important head.

    michel      E_x |dL(x)/d xi_h|, gates xi at 1 or at the current mask (Michel, Levy &
                Neubig 2019). The absolute value is taken per example, as the paper's
                expectation says: the gates are broadcast per example, (B, H), so one
                backward pass yields every example's gradient.
    fisher      E_x (dL(x)/d xi_h)^2 (Kwon et al. 2022).
    taylor      the second-order Taylor estimate of the loss increase when the head's
                gate goes to 0: E_x [-dL(x)/d xi_h + 1/2 H_hh(x)], H the Gauss-Newton
                curvature, estimated from random probes (the objective's
                `curvature_probes`). Signed (a negative score: removing the head should
                help). Michel's first-order term vanishes where the loss sits at its
                minimum, as embedding fidelity does at the unpruned model; the
                curvature does not.
    ablation    held-in loss increase when that head alone is gated off.
    entropy     minus the mean attention entropy (focused heads rank higher).
    confidence  mean max attention weight (Voita et al. 2019).
    random      seeded uniform scores: the floor every method must beat.
    gates       learned hard-concrete gates toward a target count of heads (Voita et
                al. 2019, with CoFi's Lagrangian): the log_alphas (`importance.gates`).
    flap        FLAP's fluctuation metric (An et al. 2024): each W_O input channel's
                variance over the tokens times its column's squared norm, squared,
                standardised within each layer, averaged over the head's channels
                (`importance.flap`).
Scores are returned per original head index; heads already removed or masked are NaN.
DuoAttention's gates, which choose the key/value groups to demote (`--demote-by gates`)
rather than the heads to remove, are `importance.duo`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from headlab._util.checkpoint import Checkpoint
from headlab._util.checks import check_int, check_seed
from headlab._util.progress import tokens_in, track
from headlab.data.blocks import Blocks
from headlab.errors import UserError
from headlab.importance import gates
from headlab.importance.flap import flap_scores
from headlab.importance.scores import HeadScores, active_heads, to_original
from headlab.models.base import HeadModel
from headlab.objectives import DEFAULT_BATCH_SIZE, objective_for
from headlab.parallel import distributed

METHODS = ("michel", "fisher", "taylor", "ablation", "entropy", "confidence", "random",
           "gates", "flap")
# Methods whose scores are estimates of the loss increase, in the loss's own units, so
# comparable across layers as they are: layer-l2 normalisation, which would distort
# that, is off by default.
LOSS_ESTIMATES = ("taylor", "ablation")
# Methods that choose across layers jointly: their scores compare across layers as they
# are, so layer-l2 normalisation is off by default for them too.
JOINT = ("gates", "flap")
TARGETED = ("gates",)  # the methods that need the number of heads (or groups) to keep
# what scores when no method is named, chosen by measurement (docs/prune-and-repair.md,
# "The default method"): the gates, trained toward the number of heads to keep; where no
# such number is given, taylor, the best of the scores of one head at a time
DEFAULT_METHOD = "gates"
UNTARGETED_METHOD = "taylor"
PER_TOKEN_METHODS = ("michel", "fisher")  # the gradient methods a gate per token serves


def default_method(targeted: bool) -> str:
    """The method a run that names none scores with: `DEFAULT_METHOD` where it gives the
    number of heads to keep, else `UNTARGETED_METHOD`."""
    return DEFAULT_METHOD if targeted else UNTARGETED_METHOD


def check_normalize(method: str, normalize: bool | None) -> None:
    """A UserError where ``normalize`` is asked of a method it does not apply to."""
    if normalize and method == "random":
        raise UserError("--normalize does not apply to --method random (seeded uniform "
                        "scores, with no per-layer scale to divide out); leave it out")


def score(
    model: HeadModel,
    blocks: Blocks,
    *,
    method: str | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    normalize: bool | None = None,
    global_minmax: bool = False,
    per_token: bool = False,
    probes: int = 4,
    seed: int = 0,
    checkpoint: Checkpoint | None = None,
    checkpoint_key: str = "score",
    target: int | None = None,
    unit: str = "head",
    gate_steps: int = gates.DEFAULT_STEPS,
    gate_lr: float = gates.DEFAULT_LR,
    gate_lagrange_lr: float | None = None,
    gate_budget: str = gates.DEFAULT_BUDGET,
    gate_batch: int = gates.DEFAULT_BATCH,
    gate_sample: str = gates.DEFAULT_SAMPLE,
) -> HeadScores:
    """Score every present, unmasked head of ``model`` on ``blocks``.

    Under torchrun each rank scores a disjoint shard of ``blocks`` and the sums are
    all-reduced, so every rank returns the scores of the whole data. With a
    ``checkpoint``, gradient scoring saves its sums every ``checkpoint.every`` batches
    (and when interrupted) and resumes from them.

    ``method`` None is `DEFAULT_METHOD` where a ``target`` is given, else
    `UNTARGETED_METHOD`. ``blocks`` must be prepared for the model (`headlab.prepare`);
    the loss is the model's objective's (`headlab.objectives`).
    ``normalize`` divides each layer by its l2 norm (Michel et al.); by default it does
    for every method but the loss estimates (taylor, ablation), the joint ones (gates,
    flap) and random, to which it does not apply (UserError).
    ``global_minmax`` then rescales all scores to [0, 1] (as the bertology script did).
    ``per_token`` (michel, fisher): one gate per example and position, as in the
    authors' code, instead of one per example. ``probes`` (taylor): backward passes per
    batch that estimate the curvature; ``seed`` seeds them (and ``random``).
    ``target`` (gates): how many units to keep, query heads or, with ``unit="kv-group"``,
    GQA groups (one gate each); ``gate_steps`` steps at ``gate_lr``, each on
    ``gate_batch`` blocks (not ``batch_size``), train them, the gates drawn once per
    block or, with ``gate_sample="token"``, once per token; ``gate_budget="projection"``
    holds them on the target by a shift after each step, ``"lagrangian"`` by CoFi's
    multipliers, trained at ``gate_lagrange_lr`` (None: ``gate_lr``)
    (`headlab.importance.gates`).
    """
    if method is None:
        method = default_method(target is not None)
    if method not in METHODS:
        raise UserError(f"unknown importance method {method!r}; choose from {', '.join(METHODS)}")
    objective = objective_for(model)
    objective.check_blocks(blocks, what="score")
    if method not in ("random", "entropy", "confidence"):  # the loss-based methods
        objective.check_prepared(blocks, what="score")
    batch_size = check_int(batch_size, "batch_size", low=1)
    seed = check_seed(seed)
    n_examples = len(blocks)
    blocks = blocks.subset(distributed.shard_rows(len(blocks), batch_size))
    if per_token and method not in PER_TOKEN_METHODS:
        raise UserError(f"per-token gates apply to {' and '.join(PER_TOKEN_METHODS)}, "
                         f"not {method}")
    check_normalize(method, normalize)
    if method == "taylor" and probes < 1:
        raise UserError(f"taylor needs at least one curvature probe per batch, got {probes}")
    if method in TARGETED and target is None:
        raise UserError(f"{method} trains toward a number of heads to keep: give a target "
                        "(--keep or --prune)")
    if method == "gates":
        gates.check_options(gate_steps, gate_lr, gate_lagrange_lr, gate_budget, gate_batch,
                            gate_sample)
    extra: dict = {}
    if method in ("michel", "fisher", "taylor"):
        raw, n_tokens = _gradient_scores(model, blocks, batch_size, method=method,
                                         per_token=per_token, probes=probes, seed=seed,
                                         n_examples=n_examples, checkpoint=checkpoint,
                                         key=checkpoint_key)
    elif method == "gates":
        raw, n_tokens, extra = gates.train_gates(
            model, blocks, target=target, by_group=unit == "kv-group", steps=gate_steps,
            lr=gate_lr, lagrange_lr=gate_lagrange_lr, budget=gate_budget, batch=gate_batch,
            per=gate_sample, seed=seed, checkpoint=checkpoint, key=checkpoint_key)
    elif method == "flap":
        raw, n_tokens = flap_scores(model, blocks, batch_size)
    elif method == "ablation":
        raw, n_tokens = _ablation_scores(model, blocks, batch_size)
    elif method in ("entropy", "confidence"):
        raw, n_tokens = _pattern_scores(model, blocks, batch_size, method)
    else:
        gen = torch.Generator().manual_seed(seed)
        raw = [torch.rand(a.n_heads, generator=gen, dtype=torch.float64) for a in model.attentions]
        n_tokens = 0
    scores = to_original(model, raw)
    if normalize is None:
        normalize = method not in (*LOSS_ESTIMATES, *JOINT, "random")
    if normalize:
        scores = _layer_l2(scores)
    if global_minmax:
        scores = _minmax(scores)
    norm = "layer-l2" if normalize else None
    if global_minmax:
        norm = f"{norm}+minmax" if norm else "minmax"
    return HeadScores(scores.tolist(), method, blocks.spec, n_tokens, norm,
                      {"per_token": per_token, "seed": seed,
                       **({"probes": probes} if method == "taylor" else {}), **extra})


def _gradient_scores(model, blocks, batch_size, *, method: str, per_token: bool,
                     probes: int, seed: int, n_examples: int,
                     checkpoint: Checkpoint | None, key: str):
    """Accumulate, per example, michel's |dL_x/d xi|, fisher's square of it, or taylor's
    -dL_x/d xi + 1/2 (d probe_x/d xi)^2 averaged over probes; gradients zeroed per batch.

    ``blocks`` is this rank's shard; ``n_examples`` counts all ranks' examples.
    """
    objective = objective_for(model)
    attns = model.attentions
    acc = [torch.zeros(a.n_heads, dtype=torch.float64) for a in attns]
    n_tokens = 0
    start = 0
    saved = checkpoint.get(key) if checkpoint is not None else None
    if saved is not None:
        start, n_tokens, acc = saved["batch"], saved["n_tokens"], saved["acc"]
    done = start

    def save() -> None:
        if checkpoint is not None and done > start:
            checkpoint.put(key, {"batch": done, "n_tokens": n_tokens, "acc": acc})

    try:
        with gates.frozen(model):  # only the gates need gradients
            for index, batch in enumerate(track(blocks.batches(batch_size),
                                                total=blocks.n_tokens, size=tokens_in,
                                                unit="tokens", description="scoring heads")):
                if index < start:  # done before the interruption
                    continue
                # per batch, rank and seed its own draws, so a resumed run repeats them
                gen = distributed.step_generator(seed, index)
                contrib, count = _batch_contributions(model, objective, batch, method=method,
                                                      per_token=per_token, probes=probes,
                                                      generator=gen)
                for i, c in enumerate(contrib):
                    if c is None:  # a layer with every head pruned: nothing to score
                        continue
                    acc[i] += (c.sum(1) if per_token else c).sum(0).cpu()
                n_tokens += count
                done = index + 1
                if checkpoint is not None and done % checkpoint.every == 0:
                    save()
    except KeyboardInterrupt:
        save()
        raise
    acc = [distributed.all_reduce_sum(a) for a in acc]
    (n_tokens,) = distributed.sum_floats(n_tokens)
    n = max(n_examples, 1)
    return [torch.where(m.cpu(), s / n, torch.nan) for s, m in zip(acc, active_heads(model),
                                                                     strict=True)], int(n_tokens)


def _batch_contributions(model, objective, batch, *, method: str, per_token: bool,
                         probes: int, generator: torch.Generator):
    """One batch's per-example contributions to the sums `_gradient_scores` keeps, one
    float64 tensor per layer ((B, H), per-token (B, S, H); None for a layer with no
    head), and the tokens its loss scored."""
    B, S = batch["input_ids"].shape
    leaves = []  # the gates that take the gradients, one per layer
    for a in model.attentions:
        base = a.head_gate.detach().to(torch.float32)
        shape = (B, S, a.n_heads) if per_token else (B, a.n_heads)
        a.gate_override = base.expand(shape).clone().requires_grad_(True)
        leaves.append(a.gate_override)
    out = objective.forward(model, batch)
    # michel and fisher read the scoring loss (embedding: see Embedding.losses)
    loss, count, _ = objective.losses(model, out, batch, scoring=method != "taylor")
    if not torch.isfinite(loss).all():
        raise FloatingPointError("non-finite loss while scoring; see --dtype float32")
    # sum of per-example mean losses: d/d gate_x is example x's own gradient
    grads = _float64(torch.autograd.grad(loss.sum(), leaves, allow_unused=True,
                                         retain_graph=method == "taylor"))
    if method == "fisher":
        return [None if g is None else g.pow(2) for g in grads], int(count.sum())
    if method != "taylor":
        return [None if g is None else g.abs() for g in grads], int(count.sum())
    curvature = [None if g is None else torch.zeros_like(g) for g in grads]
    pairs = objective.curvature_probes(model, out, batch, probes, generator)
    for j, (output, cotangent) in enumerate(pairs):
        pg = _float64(torch.autograd.grad(output, leaves, cotangent, allow_unused=True,
                                          retain_graph=j < probes - 1))
        for c, g in zip(curvature, pg, strict=True):
            if c is not None and g is not None:
                c += g.pow(2) / probes
    return ([None if g is None else -g + 0.5 * c for g, c in zip(grads, curvature, strict=True)],
            int(count.sum()))


def _float64(grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if g is None else g.double() for g in grads]


@torch.no_grad()
def _mean_loss(model, blocks, batch_size) -> tuple[float, int]:
    objective = objective_for(model)
    total, count = 0.0, 0.0
    for batch in blocks.batches(batch_size):
        loss, c, _ = objective.example_losses(model, batch)
        total += float((loss * c).sum())
        count += float(c.sum())
    total, count = distributed.sum_floats(total, count)
    return total / max(count, 1.0), int(count)


def _ablation_scores(model, blocks, batch_size):
    """Loss with one head gated off minus the loss with it on, head by head."""
    base, n_tokens = _mean_loss(model, blocks, batch_size)
    out = []
    jobs = [(i, p) for i, a in enumerate(model.attentions) for p in range(a.n_heads)]
    results: dict[tuple[int, int], float] = {}
    for i, p in track(jobs, total=len(jobs), description="ablating heads"):
        a = model.attentions[i]
        if a.head_gate[p] == 0:
            continue
        old = a.head_gate.clone()
        gates = old.clone()
        gates[p] = 0
        a.set_gates(gates)
        try:
            results[(i, p)] = _mean_loss(model, blocks, batch_size)[0] - base
        finally:
            a.set_gates(old)
    for i, a in enumerate(model.attentions):
        out.append(torch.tensor([results.get((i, p), math.nan) for p in range(a.n_heads)],
                                dtype=torch.float64))
    return out, n_tokens


@torch.no_grad()
def _pattern_scores(model, blocks, batch_size, method):
    from headlab.analysis import HeadStatsAccumulator, TokenRoles
    from headlab.attention.hooks import capture

    acc = HeadStatsAccumulator(model.n_layers)
    for batch in track(blocks.batches(batch_size), total=blocks.n_tokens, size=tokens_in,
                       unit="tokens", description=f"{method} of heads"):
        with capture(model, "pattern") as cap:
            model(batch["input_ids"].to(model.device),
                  attention_mask=batch["attention_mask"].to(model.device))
        roles = TokenRoles.from_mask(batch["attention_mask"].bool())
        # a layer with every head pruned never reaches its pattern hook: (B, 0, S, S)
        B, S = batch["input_ids"].shape
        empty = torch.zeros(B, 0, S, S)
        acc.update([cap.tensors.get(f"blocks.{i}.attn.pattern", empty).cpu()
                    for i in range(model.n_layers)], roles)
    acc.all_reduce()
    stats = acc.result()
    by_layer: list[list[float]] = [[] for _ in range(model.n_layers)]
    for rec in stats.records:
        v = rec["confidence"] if method == "confidence" else -rec["entropy"]
        by_layer[rec["layer"]].append(v)
    active = active_heads(model)
    out = [torch.where(m.cpu(), torch.tensor(v, dtype=torch.float64), torch.nan)
           for v, m in zip(by_layer, active, strict=True)]
    (n_tokens,) = distributed.sum_floats(blocks.n_tokens)
    return out, int(n_tokens)


def _layer_l2(scores: torch.Tensor) -> torch.Tensor:
    """Divide each layer by the l2 norm of its (present) scores, as Michel et al. do."""
    finite = torch.nan_to_num(scores, nan=0.0)
    norm = finite.pow(2).sum(1, keepdim=True).sqrt()
    return scores / torch.where(norm > 0, norm, torch.ones_like(norm))


def _minmax(scores: torch.Tensor) -> torch.Tensor:
    finite = scores[~scores.isnan()]
    if finite.numel() == 0:
        return scores
    lo, hi = finite.min(), finite.max()
    return (scores - lo) / ((hi - lo) if hi > lo else 1.0)
