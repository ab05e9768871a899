"""Least-squares refits of a pruned layer's output projection (lsq).

``lsq`` refits the kept heads' W_O (E x H*D) and its bias so that the pruned layer's
residual sum matches the reference's (Kwon et al. 2022's layer-wise reconstruction, on
the output projection), and then the MLP's down projection likewise (`DownProjection`):

    X = [z, 1]   (N, H*D + 1)  the pruned layer's per-head outputs, computed on the
                               hidden states x the pruned model (its earlier layers
                               already repaired) produces at that layer
    Y            (N, E)        the residual target x_ref + attn_ref(x_ref) - x
                               (`headlab.recovery.layerwise`; the reference's attention
                               output alone behind a post-norm)
    W = argmin ||X W - Y||^2 + lambda ||W - W0||^2,   W0 = [W_O^T; bias]

So each layer's fit also corrects the drift that earlier layers leave in the pruned
stream. Kwon et al.'s own, cheaper variant, one scale per kept head, is ``rescale``
(`headlab.recovery.rescale`).

X^T X, X^T Y and ||Y||^2 are summed in float64 over batches (memory O((H*D)^2 + H*D*E)
per layer; at most 2048 rows of activations are held), the products taken in float32
when a ridge bounds the solve's conditioning (`NormalEquations`); the error of any W
follows from them. The ridge pulls toward the current weights, with lambda = ridge *
mean(diag(X^T X)), so the fitted error is never above the error of the weights as they
were. Solved by Cholesky, by least squares if that fails.
"""

from __future__ import annotations

import torch
from torch import nn

from headlab.attention import MultiHeadAttention
from headlab.recovery.layerwise import DownFit, LayerFit

DEFAULT_RIDGE = 0.3  # a study on calibration articles: docs/prune-and-repair.md


class NormalEquations:
    """X^T X (P, P) and X^T Y (P, E), summed in float64 over batches of rows.

    Rows are gathered until `_FLUSH_ROWS` are held (or the sums are read), then taken in
    one product: a scoring batch's few hundred real tokens make a thin product, and each
    float64 accumulation of the (P, P) sums costs as much as a few hundred rows of it.
    X^T X is symmetric: each product adds only the entries on and above the diagonal, in
    ``_PARTS`` column blocks ((parts + 1) / (2 parts) of the work), and `xtx` mirrors
    them once when read. With ``fast``, the products are taken in float32 on the rows'
    device and only their sums kept in float64: the N P^2 work runs at float32 speed,
    with the rounding of one float32 product over at most `_FLUSH_ROWS` rows (relative
    ~1e-6). A ridge fit is as accurate as that (its lambda bounds the condition number);
    an unregularised one (ridge 0) is not, and takes the products in float64."""

    def __init__(self, p: int, e: int, device: torch.device, *, fast: bool = False) -> None:
        if device.type == "mps":  # no float64 there
            device = torch.device("cpu")
        self._upper = torch.zeros(p, p, dtype=torch.float64, device=device)
        self._mirrored: torch.Tensor | None = None
        self._xty = torch.zeros(p, e, dtype=torch.float64, device=device)
        self.dtype = torch.float32 if fast else torch.float64
        self._rows = 0
        self._yty = 0.0  # ||Y||^2
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (x, y) not yet summed
        self._held = 0  # rows in _pending

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """x (N, P), y (N, E)."""
        if self.dtype == torch.float64:
            x, y = x.to(self._xty.device), y.to(self._xty.device)
        self._pending.append((x.to(self.dtype), y.to(self.dtype)))
        self._held += x.shape[0]
        self._mirrored = None
        if self._held >= _FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        """Add the rows held to the sums, in one product."""
        if not self._pending:
            return
        x = torch.cat([a for a, _ in self._pending])  # (N, P)
        y = torch.cat([b for _, b in self._pending])  # (N, E)
        self._pending, self._held = [], 0
        P = x.shape[1]
        width = -(-P // _PARTS) if P >= _MIN_BLOCKED else P
        for a in range(0, P, width):  # rows a .. a + width of the upper triangle
            block = x[:, a:a + width].T @ x[:, a:]  # (width, P - a)
            self._upper[a:a + width, a:] += block.to(self._xty.device, torch.float64)
        self._xty += (x.T @ y).to(self._xty.device, torch.float64)
        self._yty += float(y.square().sum())
        self._rows += x.shape[0]

    @property
    def xtx(self) -> torch.Tensor:
        """X^T X (P, P), float64, exactly symmetric."""
        self._flush()
        if self._mirrored is None:
            upper = self._upper.triu()
            self._mirrored = upper + upper.triu(1).T
        return self._mirrored

    @property
    def xty(self) -> torch.Tensor:
        """X^T Y (P, E), float64."""
        self._flush()
        return self._xty

    def sse(self, w: torch.Tensor) -> float:
        """||X W - Y||^2 for W (P, E), from the sums: tr(W^T X^T X W) - 2 tr(W^T X^T Y)
        + ||Y||^2, the first product at the products' precision."""
        w = w.to(self._xty.device, torch.float64)
        xtx_w = (self.xtx.to(self.dtype) @ w.to(self.dtype)).double()  # (P, E)
        value = float((w * xtx_w).sum() - 2 * (w * self.xty).sum()) + self._yty
        return max(value, 0.0)  # rounding, where X W fits Y to within it

    @property
    def rows(self) -> int:
        """Rows summed so far."""
        self._flush()
        return self._rows


_PARTS = 4
_MIN_BLOCKED = 256  # narrower X^T X in one product: thin blocks do not pay for themselves
_FLUSH_ROWS = 2048  # rows gathered per product: (2048, P) float32, 9 MB for P = 1152


def solve_ridge(xtx: torch.Tensor, xty: torch.Tensor, w0: torch.Tensor,
                ridge: float) -> torch.Tensor:
    """argmin_W ||X W - Y||^2 + lambda ||W - W0||^2 from X^T X (P, P) and X^T Y (P, E),
    lambda = ridge * mean(diag(X^T X)): (X^T X + lambda I) W = X^T Y + lambda W0.
    Returns W (P, E) in float64."""
    if not (bool(torch.isfinite(xtx).all()) and bool(torch.isfinite(xty).all())):
        raise FloatingPointError("the accumulated activations hold NaN or inf values")
    w0 = w0.to(xtx.device, torch.float64)
    lam = ridge * float(xtx.diagonal().mean()) if xtx.numel() else 0.0
    a = xtx + lam * torch.eye(xtx.shape[0], dtype=xtx.dtype, device=xtx.device)
    rhs = xty + lam * w0
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, chol)
    # not positive definite (ridge 0 on rank-deficient activations): the minimum-norm
    # least-squares solution; gelsd needs the CPU
    solution = torch.linalg.lstsq(a.cpu(), rhs.cpu(), driver="gelsd").solution
    return solution.to(xtx.device)


class LeastSquares(LayerFit):
    """``lsq``: W_O and its bias refitted on X = [z, 1] (see the module docstring)."""

    def __init__(self, attn: MultiHeadAttention, *, ridge: float) -> None:
        self.attn, self.ridge = attn, ridge
        w = attn.o_proj.weight
        self.eq = NormalEquations(w.shape[1] + 1, w.shape[0], w.device, fast=ridge > 0)

    def pruned(self, z: torch.Tensor, y: torch.Tensor) -> None:
        x = z.reshape(z.shape[0], -1)  # (N, H*D)
        self.eq.add(torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1), y)

    def solve(self):
        w0 = stacked(self.attn.o_proj, bias=True)  # (H*D + 1, E)
        fitted = solve_ridge(self.eq.xtx, self.eq.xty, w0, self.ridge)
        return fitted[:-1].T, fitted[-1]  # W_O (E, H*D), bias (E,)


class DownProjection(DownFit):
    """``lsq``'s second fit in each block: the MLP's down projection (E x F) and its
    bias (where it has one), refitted on the MLP's inputs on the pruned stream (its
    attention already repaired) so that the block's residual sum after the MLP matches
    the reference's. Same ridge toward the current weights as the attention fit."""

    def __init__(self, linear: nn.Linear, *, ridge: float) -> None:
        self.linear, self.ridge = linear, ridge
        self.bias = linear.bias is not None
        w = linear.weight
        self.eq = NormalEquations(w.shape[1] + self.bias, w.shape[0], w.device,
                                  fast=ridge > 0)

    def add(self, act: torch.Tensor, y: torch.Tensor) -> None:
        x = torch.cat([act, act.new_ones(act.shape[0], 1)], dim=1) if self.bias else act
        self.eq.add(x, y)

    def solve(self):
        fitted = solve_ridge(self.eq.xtx, self.eq.xty, stacked(self.linear, self.bias),
                             self.ridge)
        if self.bias:
            return fitted[:-1].T, fitted[-1]
        return fitted.T, None

    def error_before(self) -> float:
        return self.eq.sse(stacked(self.linear, self.bias))


def stacked(linear: nn.Linear, bias: bool) -> torch.Tensor:
    """The projection's weights as the unknowns of X W = Y: W^T (F, E), with ``bias``
    its bias (zeros if none) as one more row (F + 1, E); float64."""
    w = linear.weight.detach().double().T  # (F, E); F is 0 for a W_O with no head left
    if not bias:
        return w
    b = (w.new_zeros(w.shape[1]) if linear.bias is None
         else linear.bias.detach().to(w))
    return torch.cat([w, b[None]], dim=0)
