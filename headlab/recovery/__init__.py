"""Repair a pruned model so it computes what the unpruned one did, on the scoring data.

    report = headlab.recover(pruned, reference, scoring_blocks, method="lsq")

Methods (`RECOVERY_METHODS`):
    none     change nothing; report the per-layer errors only
    bias     the removed heads' mean contribution folded into W_O's bias (`bias`)
    lsq      W_O and its bias refitted by ridge least squares, layer by layer (`lsq`)
    rescale  Kwon et al.'s scale per kept head and MLP neuron, to the residual target
             (`rescale`)
    distill  a short knowledge distillation toward the reference (`distill`)

The first four need no training and share one walk over the layers
(`headlab.recovery.layerwise`). All run on models sharded by FSDP2, every rank calling
`recover` in lockstep (`headlab.recovery.sharded`); distill there with its parameters
``out``, ``attention`` or ``all``, not LoRA.
Recovery only reads the scoring split; quality is measured on held-out data elsewhere.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from headlab.data.blocks import Blocks
from headlab.errors import UserError
from headlab.models.base import HeadModel
from headlab.recovery.bias import BiasCompensation
from headlab.recovery.layerwise import MakeDown, MakeFit, refitted, repair
from headlab.recovery.lsq import DEFAULT_RIDGE, DownProjection, LeastSquares, solve_ridge
from headlab.recovery.report import LayerError, RecoveryReport
from headlab.recovery.rescale import DownRescale, Rescale, SkipAttention, Stop
from headlab.recovery.sanity import check_sane
from headlab.recovery.sharded import RowWriter, is_fsdp

__all__ = ["DEFAULT_RIDGE", "RECOVERY_METHODS", "TRAINING_FREE", "LayerError",
           "RecoveryReport", "recover", "solve_ridge"]

RECOVERY_METHODS = ("none", "bias", "lsq", "rescale", "distill")
TRAINING_FREE = ("bias", "lsq", "rescale")  # the ones a schedule can run after each step
_RIDGE_METHODS = ("lsq",)

log = logging.getLogger(__name__)


def recover(
    pruned: HeadModel,
    reference: HeadModel,
    blocks: Blocks,
    *,
    method: str,
    batch_size: int = 8,
    ridge: float | None = None,
    **options: Any,
) -> RecoveryReport:
    """Repair ``pruned`` in place toward ``reference`` on ``blocks``; return what was done.

    ``pruned``: the physically pruned model, its kept heads' weights still the
    reference's. ``reference``: the model before pruning (not modified). ``blocks``:
    the scoring split, as prepared for scoring (only the hidden states matter here).
    ``ridge`` (lsq only; default `DEFAULT_RIDGE`) scales the pull toward the
    current weights. ``distill`` starts from ``lsq`` (with ``ridge``) unless
    ``start="none"``; its ``options`` go to `headlab.recovery.distill.distill`, and the
    report holds lsq's per-layer errors. The other methods take no options. On any
    error the model is left as it came (a distillation puts back its own changes).
    """
    if method not in RECOVERY_METHODS:
        raise UserError(f"unknown recovery method {method!r}; choose one of "
                        f"{', '.join(RECOVERY_METHODS)}")
    if method == "distill":
        return _distill(pruned, reference, blocks, batch_size=batch_size, ridge=ridge,
                        **options)
    if options:
        raise UserError(f"recovery {method!r} takes no options; got {sorted(options)}")
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    if method in _RIDGE_METHODS:
        ridge = DEFAULT_RIDGE if ridge is None else float(ridge)
        if not math.isfinite(ridge) or ridge < 0:
            raise UserError(f"ridge must be a finite number >= 0, got {ridge}")
    elif ridge is not None:
        raise UserError(f"ridge applies to {' and '.join(_RIDGE_METHODS)}, not {method!r}")
    if blocks.n_tokens == 0:
        raise UserError(f"{blocks.spec}: no scoring tokens to recover on")

    start = time.perf_counter()
    residual = method in ("lsq", "rescale")  # both fit the residual target
    refit_mlp = residual and bool(pruned.mlp_down)  # Absent(why) is falsy
    notes = []
    if residual and not refit_mlp:
        why = getattr(pruned.mlp_down, "reason", "none is declared")
        notes.append(f"{pruned.family} names no MLP down projection ({why}): "
                     f"{method} refitted W_O alone")
        log.warning(notes[-1])
    stop = Stop()  # rescale's: one per walk, a failed layer stops every later one
    make_fit, make_down = _make_fit(method, ridge, stop)
    originals = refitted(pruned)  # the walk replaces these; setting them back undoes it
    widest = max(getattr(module, "in_features", 0) for _, _, module in originals)
    if method == "lsq" and blocks.n_tokens < widest:
        notes.append(f"lsq fitted projections of up to {widest} inputs from "
                     f"{blocks.n_tokens} scoring tokens: fewer tokens than inputs leave the "
                     "fit to its ridge, and it may measure worse than no repair on held-out "
                     "text; give more tokens (--max-tokens)")
        log.warning(notes[-1])
    layers = repair(pruned, reference, blocks, make_fit=make_fit,
                    batch_size=batch_size, method=method, residual=residual,
                    make_down=make_down if refit_mlp else None)
    for note in stop.notes:  # where rescale stopped, and why
        log.warning(note)
    notes.extend(stop.notes)
    try:
        check_sane(pruned, reference, method)
    except UserError:
        for owner, name, module in originals:
            setattr(owner, name, module)
        raise
    return RecoveryReport(method, {} if ridge is None else {"ridge": ridge}, blocks.n_tokens,
                          time.perf_counter() - start, layers, notes)


def _distill(pruned, reference, blocks, *, batch_size: int, ridge: float | None,
             start: str = "lsq", **options: Any) -> RecoveryReport:
    """lsq (unless ``start="none"``), then the short distillation; one report."""
    from headlab.recovery.distill import distill

    if start not in ("lsq", "none"):
        raise UserError(f"distill starts from 'lsq' or 'none', got start={start!r}")
    begin = time.perf_counter()
    # lsq replaces the projections it refits and never writes into them: these put
    # its fit back; sharded, it writes into their rows, kept here
    originals = refitted(pruned)
    rows = RowWriter()
    if is_fsdp(pruned):
        for _, _, lin in originals:
            rows.keep(lin, "weight")
            rows.keep(lin, "bias")
    first = (recover(pruned, reference, blocks, method="lsq", batch_size=batch_size,
                     ridge=ridge) if start == "lsq" else None)
    try:
        summary = distill(pruned, reference, blocks, batch_size=batch_size, **options)
    except BaseException:
        rows.undo()
        for owner, name, module in originals:
            setattr(owner, name, module)
        raise
    plain = {k: v for k, v in summary.items() if k not in ("method", "tokens", "seconds")
             and (v is None or isinstance(v, (bool, int, float, str)))}
    return RecoveryReport(
        "distill", {"start": start, **(first.options if first else {}), **plain},
        int(summary.get("tokens", 0)), time.perf_counter() - begin,
        first.layers if first else [], first.notes if first else [])


def _make_fit(method: str, ridge: float | None,
              stop: Stop) -> tuple[MakeFit, MakeDown | None]:
    """The walk's fit of each layer's attention, and of its MLP's down projection;
    ``stop`` is what rescale's fits share."""
    if method == "bias":
        return (lambda layer, ref_attn, attn: BiasCompensation(ref_attn, attn)), None
    if method == "lsq":
        return ((lambda layer, ref_attn, attn: LeastSquares(attn, ridge=ridge)),
                lambda layer, lin: DownProjection(lin, ridge=ridge))
    if method == "rescale":
        return ((lambda layer, ref_attn, attn: Rescale(layer, attn, stop) if layer
                 else SkipAttention()), lambda layer, lin: DownRescale(layer, lin, stop))
    return (lambda layer, ref_attn, attn: None), None  # none: errors only
