"""Learned head gates (Voita et al. 2019): the heads kept are chosen jointly, by training.

One hard-concrete gate per query head, or per GQA group (Louizos et al. 2018): a
stochastic gate z = min(1, max(0, s (r - l) + l)), s = sigmoid((log u - log(1 - u) +
log_alpha) / beta), u ~ U(0, 1), with the temperature beta = 2/3 and the stretch
(l, r) = (-0.1, 1.1), so that z is exactly 0 or 1 with positive probability and the
probability that a gate is open, P(z != 0) = sigmoid(log_alpha - beta log(-l / r)), is
differentiable. Every model weight stays frozen; the log_alphas train on the calibration
blocks, one block a step by default, to minimise the objective's distillation loss
toward the model as it came (`Objective.distill_loss`: the KL to its next-token
distribution for causal LMs) while the expected number of open gates E = sum_u
P(z_u != 0) is held to a goal that falls linearly from all units to the target count
over the first half of the steps (CoFi's warm-up). A step draws the gates once per
block, every position of the block seeing the same pruned model (``block``, the
default), or once per token and head (``token``: the local reparameterisation that
Voita et al.'s code offers as ``local_rep``, there per element of the heads' outputs),
each position then its own draw, so that one step's gradient averages over as many
draws as the block has tokens. Two budgets hold it:

- ``projection`` (the default): each step moves the log_alphas by the loss's gradient
  over its root mean square (a step that keeps the gradients' relative sizes, where
  Adam's per-gate normalisation moves every gate by about the learning rate), then
  shifts all of them by one constant so that E equals the goal exactly (the shift found
  by bisection; E is monotone in it);
- ``lagrangian``: AdamW steps on the loss plus CoFi / Sheared-LLaMA's Lagrangian

      lambda1 (e - t) + lambda2 (e - t)^2,   e = E / U,  t = goal / U,

  whose multipliers train by gradient ascent, driving E toward the goal (not onto it in
  a given number of steps: a run that ends more than `TARGET_TOLERANCE` off warns).

The learned log_alphas are the scores: selection keeps the heads (or groups) whose gates
are the most open.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from headlab._util.checkpoint import Checkpoint
from headlab._util.progress import track
from headlab.data.blocks import Blocks
from headlab.errors import UserError
from headlab.models.base import HeadModel
from headlab.objectives import objective_for
from headlab.parallel import distributed

log = logging.getLogger(__name__)

BETA, LOW, HIGH = 2 / 3, -0.1, 1.1  # Louizos et al.'s temperature and stretch
EPS = 1e-6  # keeps the uniform noise off 0 and 1
INIT_LOG_ALPHA = 3.0  # every gate starts open: P(open) = 0.99
LOG_ALPHA_BOUNDS = (-10.0, 10.0)
DEFAULT_STEPS = 100
DEFAULT_LR = 0.1
DEFAULT_BATCH = 1  # calibration blocks per step: the most updates for the tokens read
TEACHER_SHARE = 0.25  # of the device's memory, at most, for the model's outputs kept
TARGET_TOLERANCE = 0.02  # of the target: the Lagrangian has bound where E ends within it
BUDGETS = ("lagrangian", "projection")  # how the expected number of open gates is held
DEFAULT_BUDGET = "projection"  # the defaults' study: docs/prune-and-repair.md
SAMPLES = ("block", "token")  # what one draw of the gates covers (module docstring)
DEFAULT_SAMPLE = "block"


def p_open(log_alpha: torch.Tensor) -> torch.Tensor:
    """P(z != 0) of hard-concrete gates with these log_alphas."""
    return torch.sigmoid(log_alpha - BETA * math.log(-LOW / HIGH))


def sample(log_alpha: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Hard-concrete gates in [0, 1] from uniform noise ``u`` (any shape ending in U)."""
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / BETA)
    return (s * (HIGH - LOW) + LOW).clamp(0.0, 1.0)


def ended(details: dict) -> str | None:
    """Where a gate training ended against its target, in words, from the ``extra`` it
    returned (read back from results.json's ``scoring_details``, so checked); None for
    a scoring that trained no gates."""
    end = [details.get(k) for k in ("expected_open", "target", "steps")]
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in end):
        return None
    met = details.get("target_met")
    verdict = ("" if not isinstance(met, bool) else " (target met)" if met
               else " (target missed; the top-scoring ones are kept all the same)")
    per = details.get("sample")
    drawn = f" of draws per {per}" if per in SAMPLES else ""
    return (f"{end[0]:.1f} {'groups' if details.get('unit') == 'kv-group' else 'heads'} "
            f"expected open against a target of {end[1]:g} after {end[2]:g} steps{drawn}"
            f"{verdict}")


def check_options(steps: int, lr: float, lagrange_lr: float | None = None,
                  budget: str = DEFAULT_BUDGET, batch: int = DEFAULT_BATCH,
                  per: str = DEFAULT_SAMPLE) -> None:
    if per not in SAMPLES:
        raise UserError(f"--gate-sample must be one of {', '.join(SAMPLES)}, got {per!r}")
    if budget not in BUDGETS:
        raise UserError(f"--gate-budget must be one of {', '.join(BUDGETS)}, got {budget!r}")
    if steps < 1:
        raise UserError(f"--gate-steps must be at least 1 training step, got {steps}")
    if batch < 1:
        raise UserError(f"--gate-batch must be at least 1 block per step, got {batch}")
    for flag, value in (("--gate-lr", lr), ("--gate-lagrange-lr", lagrange_lr)):
        if value is not None and (not value > 0 or not math.isfinite(value)):
            raise UserError(f"{flag} must be a positive learning rate, got {value}")


@contextmanager
def frozen(model: HeadModel) -> Iterator[None]:
    """``model`` in eval mode with every weight frozen, for gate tensors beside it that
    take gradients (scoring, gate training); afterwards as it was, with no gate override
    left on its attentions."""
    was_training = model.training
    model.eval()
    requires = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for a in model.attentions:
            a.gate_override = None
        for p, r in zip(model.parameters(), requires, strict=True):
            p.requires_grad_(r)
        model.train(was_training)


def run_steps(steps: int, start: int, step: Callable[[int], None], *, description: str,
              status: Callable[[], str], checkpoint: Checkpoint | None,
              save: Callable[[int], None]) -> None:
    """Call ``step(i)`` for i = ``start`` .. ``steps`` - 1 (the steps before ``start`` were
    done before an interruption) under a progress bar showing ``status()``; with a
    ``checkpoint``, ``save(steps done)`` every ``checkpoint.every`` steps and when
    interrupted, so that a resumed run continues exactly."""
    done = start
    try:
        for i in track(range(steps), total=steps, description=description, status=status):
            if i < start:
                continue
            step(i)
            done = i + 1
            if checkpoint is not None and done % checkpoint.every == 0:
                save(done)
    except KeyboardInterrupt:
        if checkpoint is not None and done > start:
            save(done)
        raise


def on_budget(log_alpha: torch.Tensor, goal: float) -> torch.Tensor:
    """``log_alpha`` shifted by one constant (and kept in `LOG_ALPHA_BOUNDS`) so that the
    expected number of open gates is ``goal``: bisection on the shift, since the sum of
    P(open) only grows with it."""
    low, high = LOG_ALPHA_BOUNDS
    lo, hi = low - float(log_alpha.max()), high - float(log_alpha.min())  # all shut .. open
    for _ in range(50):  # the bracket, 40 wide at most, to 4e-14
        mid = (lo + hi) / 2
        if float(p_open((log_alpha + mid).clamp(low, high)).sum()) > goal:
            hi = mid
        else:
            lo = mid
    return (log_alpha + (lo + hi) / 2).clamp(low, high)


def mean_over_ranks(grad: torch.Tensor) -> torch.Tensor:
    """A gradient averaged over the ranks of torchrun data parallel (itself alone)."""
    world = distributed.world_size() if distributed.data_parallel() else 1
    return distributed.all_reduce_sum(grad) / world


def _units(model: HeadModel, by_group: bool) -> tuple[list[torch.Tensor], int]:
    """Per layer, the unit of each present head (H,), -1 for a masked head: one unit per
    active head, or per key/value head with ``by_group``; and the number of units."""
    index, n = [], 0
    for a in model.attentions:
        active = (a.head_gate != 0).cpu()
        keys = a.kv_index.cpu() if by_group else torch.arange(a.n_heads)
        ids: dict[int, int] = {}
        row = []
        for p in range(a.n_heads):
            if not active[p]:
                row.append(-1)
                continue
            k = int(keys[p])
            if k not in ids:
                ids[k], n = n, n + 1
            row.append(ids[k])
        index.append(torch.tensor(row, dtype=torch.long))
    return index, n


class _Teacher:
    """The model's own output on each batch, every active gate at 1: the target of each
    step. A batch recurs every len(batches) steps, and its output with it: the outputs
    are kept after the first pass where all of them take at most `TEACHER_SHARE` of the
    device's memory (`headlab.parallel.distributed.available`), else computed at each step.
    Either way every step sees the same values."""

    def __init__(self, model: HeadModel, objective, batches: list) -> None:
        self.model, self.objective, self.batches = model, objective, batches
        self.kept: dict[int, object] | None = {}  # batch index -> output; None: not kept

    def __call__(self, i: int):
        if self.kept is not None and i in self.kept:
            return self.kept[i]
        for a in self.model.attentions:
            a.gate_override = None
        with torch.no_grad():
            out = self.objective.forward(self.model, self.batches[i])
        if self.kept is not None:
            tensors = [v for v in vars(out).values() if isinstance(v, torch.Tensor)]
            size = sum(t.numel() * t.element_size() for t in tensors) * len(self.batches)
            if size <= TEACHER_SHARE * distributed.available(str(self.model.device)):
                self.kept[i] = out
            else:
                self.kept = None
        return out


def train_gates(model: HeadModel, blocks: Blocks, *, target: int, by_group: bool = False,
                steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR,
                lagrange_lr: float | None = None, budget: str = DEFAULT_BUDGET,
                batch: int = DEFAULT_BATCH, per: str = DEFAULT_SAMPLE, seed: int = 0,
                checkpoint: Checkpoint | None = None, key: str = "gates"
                ) -> tuple[list[torch.Tensor], int, dict]:
    """Train the gates of ``model``'s active heads toward ``target`` open units, each
    step on the next ``batch`` blocks (cycling through them), the gates at ``lr``, the
    Lagrangian's multipliers at ``lagrange_lr`` (None: ``lr``, as Sheared-LLaMA shares
    one rate between them); or, with ``budget="projection"``, by normalised gradient
    steps of ``lr`` held on the target by a shift (module docstring); the gates drawn
    once per block or, with ``per="token"``, once per token.

    ``blocks`` is this rank's shard; under torchrun data parallel the gates' gradients
    are averaged over ranks. Returns per layer the log_alpha of each present head (its
    group's with ``by_group``; NaN where masked), the tokens trained on, and what the
    training ended at (``expected_open``, ``target_met``: whether that is within
    `TARGET_TOLERANCE` of the target, warned of where not; ``loss``, the multipliers).
    """
    check_options(steps, lr, lagrange_lr, budget, batch, per)
    lagrange_lr = lr if lagrange_lr is None else lagrange_lr
    unit_of, n_units = _units(model, by_group)
    what = "groups" if by_group else "heads"
    if not 1 <= target <= max(n_units, 1):
        raise UserError(f"gates need a target of 1 to {n_units} open {what} (the ones "
                        f"not yet removed), got {target}")
    objective = objective_for(model)
    device = model.device
    log_alpha = torch.full((n_units,), INIT_LOG_ALPHA, requires_grad=True)
    lagrangian = budget == "lagrangian"
    lambdas = torch.zeros(2, requires_grad=True)  # lambda1, lambda2: the Lagrangian's
    optimisers = {"gate_opt": torch.optim.AdamW([log_alpha], lr=lr, weight_decay=0.0),
                  # ascent: the multipliers maximise what the gates minimise
                  "lambda_opt": torch.optim.AdamW([lambdas], lr=lagrange_lr,
                                                  weight_decay=0.0, maximize=True),
                  } if lagrangian else {}  # projection steps by hand
    batches = list(blocks.batches(batch))
    start, n_tokens = 0, 0
    saved = checkpoint.get(key) if checkpoint is not None else None
    if saved is not None:
        start, n_tokens = saved["step"], saved["n_tokens"]
        with torch.no_grad():
            log_alpha.copy_(saved["log_alpha"])
            lambdas.copy_(saved["lambdas"])
        for name, opt in optimisers.items():
            opt.load_state_dict(saved[name])
    status = {"loss": math.nan, "open": float(p_open(log_alpha.detach()).sum())}

    def save(done: int) -> None:
        checkpoint.put(key, {"step": done, "n_tokens": n_tokens,
                             "log_alpha": log_alpha.detach().clone(),
                             "lambdas": lambdas.detach().clone(),
                             **{name: opt.state_dict() for name, opt in optimisers.items()}})

    warmup = max(1, steps // 2)
    teacher = _Teacher(model, objective, batches)

    def train_step(step: int) -> None:
        nonlocal n_tokens
        if not batches:
            return
        batch = batches[step % len(batches)]
        t_out = teacher(step % len(batches))
        gen = distributed.step_generator(seed, step)
        # (B, U) draws, or (B, S, U) with one per token
        shape = batch["input_ids"].shape[:1 if per == "block" else 2]
        u = torch.rand(*shape, n_units, generator=gen).clamp(EPS, 1 - EPS)
        z = torch.cat([sample(log_alpha, u), torch.zeros(*shape, 1)], -1)  # (..., U + 1)
        for a, index in zip(model.attentions, unit_of, strict=True):
            # masked heads read the zero column: they stay closed; (B, H) or (B, S, H)
            a.gate_override = z[..., index.where(index >= 0, n_units)].to(device)
        s_out = objective.forward(model, batch)
        distill = objective.distill_loss(model, s_out, model, t_out, batch, 1.0)
        goal = n_units - (n_units - target) * min(1.0, (step + 1) / warmup)
        loss = distill
        if lagrangian:
            gap = (p_open(log_alpha).sum() - goal) / n_units
            loss = loss + lambdas[0] * gap + lambdas[1] * gap.pow(2)
        log_alpha.grad = lambdas.grad = None
        loss.backward()
        if not torch.isfinite(distill):
            raise FloatingPointError("non-finite loss while training gates; see "
                                     "--dtype float32")
        log_alpha.grad = mean_over_ranks(log_alpha.grad)
        if lagrangian:
            for opt in optimisers.values():
                opt.step()
            with torch.no_grad():
                log_alpha.clamp_(*LOG_ALPHA_BOUNDS)
        else:
            g = log_alpha.grad
            with torch.no_grad():
                moved = log_alpha - lr * g / g.pow(2).mean().sqrt().clamp_min(1e-30)
                log_alpha.copy_(on_budget(moved, goal))
        n_tokens += int(batch["attention_mask"].sum())
        status.update(loss=float(distill.detach()),
                      open=float(p_open(log_alpha.detach()).sum()))

    with frozen(model):
        run_steps(steps, start, train_step, description="training head gates",
                  status=lambda: f"loss {status['loss']:.4f} open "
                                 f"{status['open']:.1f}/{target}",
                  checkpoint=checkpoint, save=save)
    (n_tokens,) = distributed.sum_floats(n_tokens)
    alpha = log_alpha.detach().double()
    padded = torch.cat([alpha, torch.tensor([math.nan], dtype=torch.float64)])
    raw = [padded[index.where(index >= 0, n_units)] for index in unit_of]
    expected = float(p_open(alpha).sum())
    target_met = abs(expected - target) <= TARGET_TOLERANCE * target
    if not target_met:
        why, move = (("the Lagrangian did not pull them down to it", "a faster")
                     if expected > target else ("the multipliers overshot", "a slower"))
        log.warning("the gates ended with %.1f %s expected open against a target of %d "
                    "after %d steps (%s); the %d with the largest log alpha are kept. More "
                    "--gate-steps or %s --gate-lagrange-lr trains them nearer the target, "
                    "which does not always choose better heads (docs/prune-and-repair.md, "
                    "'When the Lagrangian misses its target')", expected, what, target, steps,
                    why, target, move)
    extra = {"steps": steps, "lr": lr, "budget": budget, "batch": batch, "sample": per,
             "target": target,
             "lagrange_lr": lagrange_lr if lagrangian else None,
             "unit": "kv-group" if by_group else "head", "expected_open": expected,
             "target_met": target_met,
             "loss": status["loss"],
             "lambdas": lambdas.detach().tolist() if lagrangian else None}
    return raw, int(n_tokens), extra
