"""Layer by layer over the scoring data: the walk that bias, lsq and rescale share.

Two streams of hidden states are kept, one entry per scoring batch: the reference
model's own and the pruned model's own (its earlier layers already repaired). At
layer i the walk

  1. runs the reference's block i on its stream, keeping the attention output Y
     (B, S, E) and showing the fit the reference's per-head outputs z_ref;
  2. runs the pruned layer's attention sublayer alone on its stream, showing the fit
     the pruned per-head outputs z with Y, and measuring the error before the repair
     (``none``, with nothing to fit, skips this);
  3. asks the fit for the layer's new W_O (E, H*D) and bias (E,), and installs them;
  4. advances the pruned stream by its repaired block, measuring the error after.

Each block runs once per stream and each pruned attention once more: about two
forwards without the output head, where a full pass per layer would cost L of them.
The streams and one layer's Y take N x E values each (N scoring tokens).

Fits see real tokens only (attention_mask), flattened: z (N, H, D), y (N, E).
A layer that already reproduces the reference exactly (error 0) is left as it is.
The errors are ``||Y_hat - Y||^2 / ||Y||^2`` over real tokens, in float64.

Every layer's W_O is replaced, not written into: on any failure, a non-finite fit
included, the original modules are put back and the model is as it came.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from headlab._progress import track
from headlab.attention import MultiHeadAttention
from headlab.data import Blocks
from headlab.errors import UserError
from headlab.hooks import hooks
from headlab.models.base import HeadModel
from headlab.recovery.report import LayerError


class LayerFit:
    """One method's repair of one layer. The walk shows it the activations of every
    scoring batch (real tokens only), then asks for the layer's new output projection."""

    def reference(self, z: torch.Tensor, y: torch.Tensor) -> None:
        """z (N, H_ref, D): the reference layer's gated per-head outputs on the
        reference's own stream; y (N, E): its attention output there."""

    def pruned(self, z: torch.Tensor, y: torch.Tensor) -> None:
        """z (N, H, D): the pruned layer's gated per-head outputs on the pruned stream;
        y (N, E): the reference's attention output it should match."""

    def solve(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The new (W_O (E, H*D), bias (E,) or None to keep the bias), or None to leave
        the layer as it is. Raises FloatingPointError when the statistics are not finite."""
        return None


# (layer, reference attention, pruned attention) -> the layer's fit, or None: report only
MakeFit = Callable[[int, MultiHeadAttention, MultiHeadAttention], LayerFit | None]


def check_pair(pruned: HeadModel, reference: HeadModel) -> None:
    """Raise a UserError unless ``pruned`` is ``reference`` with some heads removed."""
    if pruned is reference:
        raise UserError(
            "recovery needs the unpruned reference as a separate model: keep a copy "
            "(headlab.pruning.copy_model) from before pruning and pass it as reference"
        )
    if (pruned.family, pruned.n_layers) != (reference.family, reference.n_layers):
        raise UserError(
            f"the pruned model ({pruned.family}, {pruned.n_layers} layers) is not a pruned "
            f"copy of the reference ({reference.family}, {reference.n_layers} layers)"
        )
    for i, (a, r) in enumerate(zip(pruned.attentions, reference.attentions, strict=True)):
        extra = sorted(set(a.head_ids.tolist()) - set(r.head_ids.tolist()))
        if extra or (a.d_model, a.head_dim) != (r.d_model, r.head_dim):
            raise UserError(
                f"layer {i} of the pruned model does not come from the reference: heads "
                f"{extra} are not in the reference, or its sizes differ; pass the model "
                "the pruned one was made from"
            )


@torch.no_grad()
def repair(pruned: HeadModel, reference: HeadModel, blocks: Blocks, *, make_fit: MakeFit,
           batch_size: int, method: str) -> list[LayerError]:
    """Walk the layers in order (see the module docstring); return their errors."""
    check_pair(pruned, reference)
    modes = (pruned.training, reference.training)
    pruned.eval()
    reference.eval()
    replaced: dict[int, nn.Linear] = {}  # layer -> its W_O as it came
    try:
        return _walk(pruned, reference, blocks, make_fit, batch_size, method, replaced)
    except BaseException:
        for i, original in replaced.items():
            pruned.attentions[i].o_proj = original
        raise
    finally:
        pruned.train(modes[0])
        reference.train(modes[1])


def _walk(pruned, reference, blocks, make_fit, batch_size, method, replaced):
    device = pruned.device
    batches = [(b["input_ids"].to(device), b["attention_mask"].to(device))
               for b in blocks.batches(batch_size)]
    real = [mask.bool() for _, mask in batches]  # (B, S) each
    ref_in = [reference.block_inputs(ids, mask) for ids, mask in batches]
    pruned_in = [pruned.block_inputs(ids, mask) for ids, mask in batches]
    ref_h = [x.hidden for x in ref_in]  # (B, S, E) each: the reference's stream
    pruned_h = [x.hidden for x in pruned_in]  # the pruned model's own stream
    records = []
    layers = range(pruned.n_layers)
    for i in track(layers, total=len(layers), description=f"recovery ({method}) by layer"):
        ref_attn, attn = reference.attentions[i], pruned.attentions[i]
        fit = make_fit(i, ref_attn, attn)
        targets = []  # Y per batch (B, S, E)
        for b, x in enumerate(ref_in):
            with _tap(reference, i) as seen:
                ref_h[b] = x.block(i, ref_h[b])
            targets.append(seen["out"])
            if fit is not None:
                fit.reference(_z(seen, ref_attn, real[b]), seen["out"][real[b]])

        before = _Error()
        if fit is not None:  # the attention sublayer alone: the fit's activations
            for b, x in enumerate(pruned_in):
                with _tap(pruned, i) as seen:
                    out = x.attention(i, pruned_h[b])  # (B, S, E)
                y = targets[b][real[b]]  # (N, E)
                before.add(out[real[b]], y)
                fit.pruned(_z(seen, attn, real[b]), y)

        new = _solve(fit, i, method) if fit is not None and before.diff != 0 else None
        if new is not None:
            replaced[i] = _install(attn, *new)
        after = _Error()
        for b, x in enumerate(pruned_in):
            with _tap(pruned, i) as seen:
                pruned_h[b] = x.block(i, pruned_h[b])
            after.add(seen["out"][real[b]], targets[b][real[b]])
        if fit is None:  # nothing changed: one measurement is both
            before = after
        records.append(LayerError(i, before.value, after.value))
    return records


@contextlib.contextmanager
def _tap(model: HeadModel, layer: int) -> Iterator[dict[str, torch.Tensor]]:
    """Keep the layer's z (B, S, H, D) and attention output (B, S, E) of the next call."""
    seen: dict[str, torch.Tensor] = {}

    def keep(t: torch.Tensor, name: str) -> None:
        seen[name.rsplit(".", 1)[-1]] = t

    with hooks(model, {f"blocks.{layer}.attn.z": keep, f"blocks.{layer}.attn.out": keep}):
        yield seen


def _z(seen: dict[str, torch.Tensor], attn: MultiHeadAttention, real: torch.Tensor):
    """The real tokens' z (N, H, D); a layer with no head left never reaches its z hook."""
    if "z" in seen:
        return seen["z"][real]
    out = seen["out"]
    return out.new_zeros(int(real.sum()), 0, attn.head_dim)


def _solve(fit: LayerFit, layer: int, method: str):
    """The fit's new weights, checked finite; a UserError naming the layer if not."""
    try:
        new = fit.solve()
    except FloatingPointError as exc:
        raise _not_finite(method, layer, str(exc)) from exc
    if new is not None and not all(t is None or bool(torch.isfinite(t).all()) for t in new):
        raise _not_finite(method, layer, "the solution holds NaN or inf values")
    return new


def _not_finite(method: str, layer: int, detail: str) -> UserError:
    return UserError(
        f"recovery {method!r} failed at layer {layer}: {detail}. The activations on the "
        "scoring data or the model's weights are not finite there (check the checkpoint "
        "and try --dtype float32); the model is left as it was"
    )


def _install(attn: MultiHeadAttention, weight: torch.Tensor,
             bias: torch.Tensor | None) -> nn.Linear:
    """Put a copy of W_O holding the new weight (and bias) in place; return the old one."""
    original = attn.o_proj
    attn.o_proj = copy.deepcopy(original)
    attn.o_proj.weight.copy_(weight)
    if bias is not None:
        attn.ensure_out_bias().copy_(bias)
    return original


class _Error:
    """Sums ||Y_hat - Y||^2 and ||Y||^2 over batches, in float64."""

    def __init__(self) -> None:
        self.diff = 0.0
        self.norm = 0.0

    def add(self, y_hat: torch.Tensor, y: torch.Tensor) -> None:
        y = y.double()
        self.diff += float((y_hat.double() - y).pow(2).sum())
        self.norm += float(y.pow(2).sum())

    @property
    def value(self) -> float:
        if self.norm > 0:
            return self.diff / self.norm
        return 0.0 if self.diff == 0 else math.inf
