"""Layer by layer over the scoring data: the walk that bias, lsq and rescale share.

Two streams of hidden states are kept, one entry per scoring batch: the reference
model's own and the pruned model's own (its earlier layers already repaired). At
layer i the walk

  1. runs the reference's block i on its stream, keeping its residual sums: after
     attention, x_ref + attn_ref(x_ref), and after the MLP, mid_ref + mlp_ref(mid_ref)
     (the sublayers' outputs before any post-norm; in a pre-norm block, the residual
     stream). ``mid`` is the residual the MLP's output is added to: ``resid_mid``, or
     in a parallel residual x + attn(n1(x)) + mlp(n2(x)) (GPT-NeoX), which never
     reaches that hook, x + attn(n1(x)), the block's output less the MLP's;
  2. runs the pruned layer's attention sublayer alone on its stream x, showing the fit
     the pruned per-head outputs z with its target Y (and the reference's per-head
     outputs, for bias compensation), and installs the new W_O (E, H*D) and bias (E,);
  3. with ``down`` (lsq, rescale), runs the pruned block with that attention output (z
     through the new W_O) and refits the MLP's down projection so that the block's residual
     sum after the MLP matches the reference's (`headlab.recovery.lsq.DownProjection`,
     `headlab.recovery.rescale.DownRescale`). The down projection itself is left out of
     that run (its input is all the fit needs) and runs once, with the new weights; the
     error before comes from the fit's sums (`DownFit.error_before`);
  4. advances the pruned stream by the block, its sublayers answering with the outputs
     computed in 2 and 3 (the norms and residual sums around them are the block's own).

The target Y of the attention output is, with ``residual`` (lsq, rescale), what makes
the pruned residual sum equal the reference's: Y = x_ref + attn_ref(x_ref) - x. So each
layer also corrects the drift that the earlier layers left in the stream (Kwon et al.
2022 reconstruct a layer's output with its residual). Without it (bias), Y is
the reference's attention output alone; so it is, and the MLP's, behind a post-norm
(Gemma, OLMo-2 add norm(out) to the residual): there the drift lives in the normalised
space, and added to a target in the projection's space it asks for a fit that
follows neither.

Each block runs once per stream, and the pruned block's attention and MLP (less its down
projection) once more each: about two forwards without the output head, where a full
pass per layer would cost L of them. The streams and one layer's targets take N x E
values each (N scoring tokens); with ``down`` one layer's MLP activations N x F are kept
too.

Fits see real tokens only (attention_mask), flattened: z (N, H, D), y (N, E).
A layer that already reproduces the reference exactly (error 0; for the MLP, its block
input and residual equal the reference's on every batch) is left as it is. The errors
are ``||Y_hat - Y||^2 / ||Y||^2`` over real tokens, summed over batches in float64.

Every refitted projection is replaced, not written into: on any failure, a non-finite
fit included, the original modules are put back and the model is as it came. In a
model sharded by FSDP2 only block i (and the reference's) is whole during layer i, and
the new weights are written into each rank's rows, the rows written over kept to put
back (`headlab.recovery.sharded`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn

from headlab._util.progress import track
from headlab.attention import MultiHeadAttention
from headlab.data.blocks import Blocks
from headlab.errors import UserError
from headlab.models.base import HeadModel
from headlab.recovery.report import LayerError
from headlab.recovery.sharded import RowWriter, gathered, is_fsdp, ready
from headlab.recovery.sublayers import (
    Real,
    down_owner,
    down_projection,
    fixed,
    head_outputs,
    skipped_down,
    tap,
)


class LayerFit:
    """One method's repair of one layer. The walk shows it the activations of every
    scoring batch (real tokens only), then asks for the layer's new output projection."""

    def reference(self, z: torch.Tensor, y: torch.Tensor) -> None:
        """z (N, H_ref, D): the reference layer's gated per-head outputs on the
        reference's own stream; y (N, E): its attention output there."""

    def pruned(self, z: torch.Tensor, y: torch.Tensor) -> None:
        """z (N, H, D): the pruned layer's gated per-head outputs on the pruned stream;
        y (N, E): the attention output it should give there."""

    def solve(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The new (W_O (E, H*D), bias (E,) or None to keep the bias), or None to leave
        the layer as it is. Raises FloatingPointError when the statistics are not finite."""
        return None


class DownFit:
    """A refit of one block's MLP down projection (F -> E), shown every scoring batch.
    The walk never computes the projection's output with its weights as they came: a fit
    that needs it computes it from ``act``."""

    linear: nn.Linear

    def add(self, act: torch.Tensor, y: torch.Tensor) -> None:
        """act (N, F): the down projection's input; y (N, E): the output it should give."""

    def solve(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The new (weight (E, F), bias (E,) or None), or None to leave it."""
        return None

    def error_before(self) -> float:
        """||act W^T + b - y||^2 over every row added, the weights as they came (asked
        only after a `solve` that returned new weights, before they are installed)."""
        raise NotImplementedError


# (layer, reference attention, pruned attention) -> the layer's fit, or None: report only
MakeFit = Callable[[int, MultiHeadAttention, MultiHeadAttention], LayerFit | None]
# (layer, its MLP's down projection) -> the projection's fit
MakeDown = Callable[[int, nn.Linear], DownFit]


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
           batch_size: int, method: str, residual: bool = False,
           make_down: MakeDown | None = None) -> list[LayerError]:
    """Walk the layers in order (see the module docstring); return their errors.
    ``make_down`` needs a family that names its MLP's down projection
    (`HeadModel.mlp_down`)."""
    check_pair(pruned, reference)
    if make_down is not None and not pruned.mlp_down:  # None or Absent(why)
        raise ValueError(f"{pruned.family} names no MLP down projection to refit "
                         f"({pruned.mlp_down!r}): call repair without make_down")
    modes = (pruned.training, reference.training)
    pruned.eval()
    reference.eval()
    installer = RowWriter() if is_fsdp(pruned) else _Replacer()
    try:
        walk = _Walk(pruned, reference, blocks, batch_size, method, installer)
        return walk.run(make_fit, residual, make_down)
    except BaseException:
        installer.undo()
        raise
    finally:
        pruned.train(modes[0])
        reference.train(modes[1])


class _Walk:
    def __init__(self, pruned, reference, blocks, batch_size, method, installer) -> None:
        device = pruned.device
        batches = [(b["input_ids"].to(device), b["attention_mask"].to(device))
                   for b in blocks.batches(batch_size)]
        self.pruned, self.reference, self.method = pruned, reference, method
        self.installer = installer
        for model in (pruned, reference):
            if is_fsdp(model):
                ready(model, batches[0][0])
        self.real = [Real(mask.bool()) for _, mask in batches]
        self.ref_in = [reference.block_inputs(ids, mask) for ids, mask in batches]
        self.pruned_in = [pruned.block_inputs(ids, mask) for ids, mask in batches]
        self.ref_h = [x.hidden for x in self.ref_in]  # (B, S, E) each: reference stream
        self.pruned_h = [x.hidden for x in self.pruned_in]  # the pruned model's own

    def run(self, make_fit: MakeFit, residual: bool, make_down: MakeDown | None):
        records = []
        layers = range(self.pruned.n_layers)
        for i in track(layers, total=len(layers),
                       description=f"recovery ({self.method}) by layer"):
            with gathered(self.pruned.blocks[i], self.reference.blocks[i]):
                records.append(self._layer(i, make_fit, residual, make_down))
        return records

    def _layer(self, i: int, make_fit: MakeFit, residual: bool,
               make_down: MakeDown | None) -> LayerError:
        fit = make_fit(i, self.reference.attentions[i], self.pruned.attentions[i])
        down = (make_down(i, down_projection(self.pruned, i)) if make_down is not None
                else None)
        attn_refs, mlp_refs = self._reference(i, fit, mlp=down is not None)
        # Y = attn_ref + (x_ref - x): the pruned sum matches the reference's; where the
        # streams agree, Y is the reference's output exactly
        block = self.pruned.blocks[i]
        attn_drift = residual and _added_as_is(block, "attn")
        targets = [y + (h_ref - r(h)) if attn_drift else y
                   for (y, h_ref), h, r in zip(attn_refs, self.pruned_h, self.real,
                                               strict=True)]
        attn_out, before = self._fit_attention(i, fit, targets)
        after = _Error()
        for b, out in enumerate(attn_out):
            after.add(self.real[b](out), targets[b])
        mlp_drift = residual and _added_as_is(block, "mlp")
        mlp_out, mlp_errors = (self._fit_down(i, down, attn_out, mlp_refs, attn_refs,
                                              residual=mlp_drift)
                               if down is not None else (None, (None, None)))
        # the repaired block's output, its sublayers' outputs as just computed
        for b, x in enumerate(self.pruned_in):
            with fixed(self.pruned, i, attn_out[b], None if mlp_out is None
                        else mlp_out[b]):
                self.pruned_h[b] = x.block(i, self.pruned_h[b])
        return LayerError(i, after.value if before is None else before.value, after.value,
                          *mlp_errors)

    def _reference(self, i: int, fit: LayerFit | None, *, mlp: bool):
        """Advance the reference stream by block i; return per batch, over real tokens,
        (attention output, block input) and, with ``mlp``, (MLP output, its residual
        after attention), each (N, E)."""
        ref_attn = self.reference.attentions[i]
        attn_refs, mlp_refs = [], []
        for b, x in enumerate(self.ref_in):
            r = self.real[b]
            with tap(self.reference, i, mlp=mlp) as seen:
                h_in = self.ref_h[b]
                self.ref_h[b] = x.block(i, h_in)
            attn_refs.append((r(seen["out"]), r(h_in)))
            if mlp:
                mlp_refs.append((r(seen["mlp"]), r(seen["mid"])))
            if fit is not None:
                fit.reference(head_outputs(seen, ref_attn, r), r(seen["out"]))
        return attn_refs, mlp_refs

    def _fit_attention(self, i: int, fit: LayerFit | None, targets):
        """Run the pruned attention sublayer on its stream, show the fit its activations
        and install its solution; return the attention's outputs after (B, S, E) per
        batch, computed from its z by the new W_O, and the error before (None: no fit)."""
        attn = self.pruned.attentions[i]
        before = _Error()
        zs = []
        for b, x in enumerate(self.pruned_in):
            with tap(self.pruned, i) as seen:
                out = x.attention(i, self.pruned_h[b])  # (B, S, E)
            zs.append(seen.get("z"))
            if fit is not None:
                r = self.real[b]
                before.add(r(out), targets[b])
                fit.pruned(head_outputs(seen, attn, r), targets[b])
        if fit is not None and before.diff != 0:
            new = _solve(fit, i, self.method)
            if new is not None:
                self.installer.install(self.pruned.blocks[i], attn, "o_proj", *new)
        outs = []
        for b, z in enumerate(zs):
            h = self.pruned_h[b]
            if z is None:  # no head left: W_O takes nothing, its bias is the output
                z = h.new_zeros(*h.shape[:2], 0, attn.head_dim)
            outs.append(attn.o_proj(z.reshape(*z.shape[:2], -1)))  # (B, S, E)
        return outs, (before if fit is not None else None)

    def _fit_down(self, i: int, down: DownFit, attn_out, mlp_refs, attn_refs, *,
                  residual: bool):
        """Refit block i's down projection on the pruned stream, its attention repaired;
        return the MLP's outputs after (B, S, E) per batch, and the errors before, after.
        The projection's output with the old weights is never computed: the error before
        comes from the fit's sums (`DownFit.error_before`), and where the block's input
        and MLP residual equal the reference's on every batch, it is 0 and no fit runs."""
        acts, ys, same = [], [], True
        for b, x in enumerate(self.pruned_in):
            with fixed(self.pruned, i, attn_out[b], None), skipped_down(self.pruned, i), \
                    tap(self.pruned, i, attn=False, mlp=True) as seen:
                x.block(i, self.pruned_h[b])
            r = self.real[b]
            m_ref, mid_ref = mlp_refs[b]
            mid = r(seen["mid"])
            same = (same and torch.equal(mid, mid_ref)
                    and torch.equal(r(self.pruned_h[b]), attn_refs[b][1]))
            # (N, E): the sums after the MLP agree, or with a post-norm its outputs
            y = m_ref + (mid_ref - mid) if residual else m_ref
            down.add(r(seen["act"]), y)
            acts.append(seen["act"])
            ys.append(y)
        new = None if same else _solve(down, i, self.method)
        before = down.error_before() if new is not None else None
        if new is not None:
            owner, name = down_owner(self.pruned, i)
            self.installer.install(self.pruned.blocks[i], owner, name, *new)
        linear = down_projection(self.pruned, i)
        outs = [linear(act) for act in acts]  # the down projection ends the MLP
        after = _Error()
        for b, out in enumerate(outs):
            after.add(self.real[b](out), ys[b])
        if before is not None:  # the weights changed: the same ||Y||^2, another error
            return outs, (_Error.ratio(before, after.norm), after.value)
        return outs, (after.value, after.value)


class _Replacer:
    """Installs refitted projections in a model that is not sharded, each as a copy put
    in place of the module; `undo` puts the originals back."""

    def __init__(self) -> None:
        self.replaced: list[tuple[nn.Module, str, nn.Linear]] = []  # (owner, name, as came)

    def install(self, block: nn.Module, owner: nn.Module, name: str, weight: torch.Tensor,
                bias: torch.Tensor | None) -> None:
        """Put a copy of ``owner.name`` (in ``block``) holding the new weight (and bias)
        in place."""
        original = getattr(owner, name)
        new = copy.deepcopy(original)
        setattr(owner, name, new)
        self.replaced.append((owner, name, original))
        new.weight.copy_(weight)
        if bias is not None:
            if isinstance(owner, MultiHeadAttention):
                owner.ensure_out_bias().copy_(bias)
            else:
                new.bias.copy_(bias)

    def undo(self) -> None:
        for owner, name, original in reversed(self.replaced):
            setattr(owner, name, original)
        self.replaced.clear()


def refitted(model: HeadModel) -> list[tuple[nn.Module, str, nn.Module]]:
    """(owner, name, module) of every projection a walk may replace: each W_O and, where
    the family names it, each MLP down projection. Setting them back undoes a walk."""
    found = [(a, "o_proj", a.o_proj) for a in model.attentions]
    if model.mlp_down:  # None or Absent(why): no down projection to replace
        for i in range(model.n_layers):
            owner, name = down_owner(model, i)
            found.append((owner, name, getattr(owner, name)))
    return found


def _added_as_is(block: nn.Module, sublayer: str) -> bool:
    """Whether the block adds its ``sublayer``'s (attn, mlp) output to the residual as
    it is. Behind a post-norm (Gemma, OLMo-2: x + norm(out)) the residual's drift is in
    the normalised space, not the projection's: such a sublayer is fitted to the
    reference's output alone."""
    return getattr(block, f"{sublayer}_post_norm", None) is None


def _solve(fit: LayerFit | DownFit, layer: int, method: str):
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


class _Error:
    """Sums ||Y_hat - Y||^2 and ||Y||^2 over batches: each batch's in its own dtype
    (torch sums pairwise: relative rounding ~1e-7 in float32), the batches' in float64."""

    def __init__(self) -> None:
        self.diff = 0.0
        self.norm = 0.0

    def add(self, y_hat: torch.Tensor, y: torch.Tensor) -> None:
        if y.dtype.itemsize < 4:  # bfloat16, float16: sums that precise are of no use
            y_hat, y = y_hat.float(), y.float()
        self.diff += float((y_hat - y).square().sum())
        self.norm += float(y.square().sum())

    @property
    def value(self) -> float:
        return self.ratio(self.diff, self.norm)

    @staticmethod
    def ratio(diff: float, norm: float) -> float:
        """diff / norm; 0 for 0 / 0 and inf for anything else over 0."""
        if norm > 0:
            return diff / norm
        return 0.0 if diff == 0 else math.inf
