"""``rescale``: Kwon et al. 2022's mask rescaling (prune/rescale.py of their code).

Layer by layer in order, on the walk's two streams (the reference's own, and the pruned
model's with its earlier layers already rescaled), one scale per kept head and, in
the MLP, one per neuron, fitted to the residual target

    B = Y - b        (N, E)  Y = ref_out(x_ref) + x_ref - x, the output the sublayer
                             should give for the pruned sum to equal the reference's;
                             b its output projection's bias (zeros if none)

Attention (skipped at layer 0, as Kwon's ``layer_idx != 0``): with P_h = z_h W_h^T
(N, E) head h's contribution through its columns W_h (E, D) of W_O, the unknowns are
s (H) and one constant c shared by every token and channel:

    A = [vec P_1, ..., vec P_H, 1]   (N*E, H + 1)

The MLP (every layer): with a_f (N) neuron f's input to the down projection and w_f
(E) its column, A = [vec a_1 w_1^T, ...] (N*E, F), no constant.

Both are solved as Kwon's ``lsmr_cupy_solver`` does: on the normal equations
G = A^T A, r = A^T vec B, for the deviation from 1, by LSMR with damping 1 and its
default stopping rules (scipy's, of which cupyx's is a port: tolerances 1e-6, condition
limit 1e8, at most P iterations),

    u ~ argmin ||G u - (r - G 1)||^2 + ||u||^2,   scales = 1 + u

LSMR's stopping is part of the method: it ends where the residual meets the tolerances,
before the small eigenvalues of G are resolved, and on an MLP's ill-conditioned G the
exact minimiser can lie far from that point and fit held-out text far worse
(docs/prune-and-repair.md). As in Kwon's code, a solve that ends for any other reason
(istop 3 and up: the condition limit, or the iterations spent) has failed. The sums are
float64 here (Kwon's are float32). The constant is dropped; the scales are folded into
the columns of W_O or of the down projection, biases kept. A failed solve, or any scale
outside [-10, 10], stops the rescaling: that sublayer and every later one are left as
they are. One safeguard is headlab's own: scales that, without the constant, would fit B
worse than all ones do are not installed (that sublayer only is left as it is), so no
sublayer's error rises.

G and r come from X^T X and X^T Y summed over batches (X = [z, 1] or [a, 1]), never
forming A: G_hg = sum_{d,e} (X^T X)[hd, ge] (W^T W)[hd, ge], and so on below.
"""

from __future__ import annotations

import torch
from torch import nn

from headlab.attention import MultiHeadAttention
from headlab.recovery.layerwise import DownFit, LayerFit
from headlab.recovery.lsq import NormalEquations, stacked

SCALE_BOUND = 10.0  # Kwon et al.'s code: a scale beyond it stops the rescaling


# LSMR's istop (scipy.sparse.linalg.lsmr) from 3 up: each a failure to Kwon et al.'s loop
_LSMR_FAILED = {
    3: "the condition number of G passed LSMR's limit of 1e8",
    4: "LSMR solved G u = r to machine precision, which Kwon et al.'s loop counts as "
       "a failure",
    5: "LSMR reached the least-squares solution to machine precision, which Kwon et "
       "al.'s loop counts as a failure",
    6: "the condition number of G is too large for float64",
    7: "LSMR spent its iterations (one per unknown) before meeting its tolerances",
}


class SolveFailed(Exception):
    """LSMR's solve of one sublayer's scales failed; the message says how."""


def damped_scales(gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """1 + u, u LSMR's solution of G u ~ r - G 1 with damping 1 (see the module
    docstring), for G (P, P) symmetric, r (P,), in float64. Raises `SolveFailed` where
    LSMR reports failure (istop 3 and up, as Kwon's ``solution[1] < 3``) or gives
    non-finite values."""
    from scipy.sparse.linalg import lsmr

    if not (bool(torch.isfinite(gram).all()) and bool(torch.isfinite(rhs).all())):
        raise FloatingPointError("the accumulated activations hold NaN or inf values")
    g = gram.double().cpu().numpy()
    b = rhs.double().cpu().numpy() - g.sum(1)
    u, istop = lsmr(g, b, damp=1.0)[:2]
    if istop >= 3:
        raise SolveFailed(f"{_LSMR_FAILED.get(istop, 'LSMR failed')} (istop {istop})")
    scales = torch.from_numpy(1 + u)
    if not bool(torch.isfinite(scales).all()):
        raise SolveFailed("LSMR gave non-finite scales")
    return scales.to(gram.device)


class Stop:
    """Shared by one walk's fits: set once a solve fails or a scale leaves the bound.
    ``notes`` says, for the report, where and why it stopped, and which sublayers were
    left alone because their scales fit worse than none."""

    def __init__(self) -> None:
        self.stopped = False
        self.notes: list[str] = []

    def scales(self, gram: torch.Tensor, rhs: torch.Tensor, n: int,
               where: str) -> torch.Tensor | None:
        """The first ``n`` of the solved scales for the sublayer ``where`` (e.g. "layer
        3's MLP"), or None: stopping the walk if the solve failed or a scale is out of
        bounds, leaving this sublayer alone if the scales fit worse than 1 does."""
        try:
            scales = damped_scales(gram, rhs)
        except SolveFailed as failed:
            return self._halt(where, str(failed))
        widest = float(scales.abs().max())
        if widest > SCALE_BOUND:
            return self._halt(where, f"a scale of {widest:.3g} is outside "
                                     f"[-{SCALE_BOUND:g}, {SCALE_BOUND:g}]")
        s, g, r = scales[:n], gram[:n, :n], rhs[:n]
        ones = torch.ones_like(s)
        # ||A s - B||^2 - ||B||^2 without the constant, against the same at s = 1
        if float(s @ g @ s - 2 * s @ r) > float(ones @ g @ ones - 2 * ones @ r):
            self.notes.append(f"rescale left {where} as it was: its scales, without the "
                              "constant, fit the target worse than no scaling")
            return None
        return s

    def _halt(self, where: str, why: str) -> None:
        self.stopped = True
        self.notes.append(f"rescale stopped at {where}: {why}; as Kwon et al.'s loop "
                          "breaks, it and every later sublayer were left as they were")


class Rescale(LayerFit):
    """One scale per kept head of one layer (see the module docstring)."""

    def __init__(self, layer: int, attn: MultiHeadAttention, stop: Stop) -> None:
        self.where, self.attn, self.stop = f"layer {layer}'s attention", attn, stop
        w = attn.o_proj.weight
        self.eq = NormalEquations(w.shape[1] + 1, w.shape[0], w.device)

    def pruned(self, z: torch.Tensor, y: torch.Tensor) -> None:
        if not self.stop.stopped:
            x = z.reshape(z.shape[0], -1)  # (N, H*D)
            self.eq.add(torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1), y)

    def solve(self):
        H, D = self.attn.n_heads, self.attn.head_dim
        if H == 0 or self.stop.stopped:
            return None
        lin = self.attn.o_proj
        w = lin.weight.detach().to(self.eq.xtx.device, torch.float64)  # (E, H*D)
        b = (torch.zeros_like(w[:, 0]) if lin.bias is None
             else lin.bias.detach().to(w))  # (E,)
        F, E = H * D, w.shape[0]
        xtx, xsum, xty = self.eq.xtx[:F, :F], self.eq.xtx[:F, F], self.eq.xty[:F]
        ysum = self.eq.xty[F]  # (E,) sum of Y over tokens
        gram = torch.zeros(H + 1, H + 1, dtype=w.dtype, device=w.device)
        gram[:H, :H] = (xtx * (w.T @ w)).view(H, D, H, D).sum((1, 3))
        gram[:H, H] = gram[H, :H] = (xsum * w.sum(0)).view(H, D).sum(1)  # sum of P_h
        gram[H, H] = self.eq.rows * E
        rhs = torch.empty(H + 1, dtype=w.dtype, device=w.device)
        rhs[:H] = ((xty - xsum[:, None] * b[None]) * w.T).view(H, -1).sum(1)
        rhs[H] = ysum.sum() - self.eq.rows * b.sum()
        scales = self.stop.scales(gram, rhs, H, self.where)
        if scales is None:
            return None
        return (w.view(E, H, D) * scales[:, None].to(w)).reshape(E, F), None


class SkipAttention(LayerFit):
    """Layer 0's attention, which Kwon et al. leave as it is; reports its error."""


class DownRescale(DownFit):
    """One scale per neuron of one block's MLP down projection (F -> E)."""

    def __init__(self, layer: int, linear: nn.Linear, stop: Stop) -> None:
        self.where, self.linear, self.stop = f"layer {layer}'s MLP", linear, stop
        w = linear.weight
        self.eq = NormalEquations(w.shape[1] + 1, w.shape[0], w.device)

    def add(self, act: torch.Tensor, y: torch.Tensor) -> None:
        if not self.stop.stopped:
            self.eq.add(torch.cat([act, act.new_ones(act.shape[0], 1)], dim=1), y)

    def solve(self):
        if self.stop.stopped:
            return None
        w = self.linear.weight.detach().to(self.eq.xtx.device, torch.float64)  # (E, F)
        b = (torch.zeros_like(w[:, 0]) if self.linear.bias is None
             else self.linear.bias.detach().to(w))
        F = w.shape[1]
        xtx, xsum, xty = self.eq.xtx[:F, :F], self.eq.xtx[:F, F], self.eq.xty[:F]
        gram = xtx * (w.T @ w)  # (F, F)
        rhs = ((xty - xsum[:, None] * b[None]) * w.T).sum(1)  # (F,)
        scales = self.stop.scales(gram, rhs, F, self.where)
        if scales is None:
            return None
        return w * scales[None].to(w), None

    def error_before(self) -> float:
        return self.eq.sse(stacked(self.linear, bias=True))
