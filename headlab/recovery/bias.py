"""Bias compensation (FLAP, An et al. 2024): the removed heads' mean contribution to a
layer's attention output, folded into the output projection's bias.

For layer l with removed heads R:

    c = sum_{h in R} W_h mean_t z_h(t)      (E,)

with z_h (D,) head h's gated output and W_h (E, D) its columns of W_O. It is computed
on the reference model, where the removed heads still exist, on the hidden states the
reference itself produces (the inputs those heads saw before pruning), averaged over
the real scoring tokens. A family whose W_O has no bias gains one
(`MultiHeadAttention.ensure_out_bias`).
"""

from __future__ import annotations

import torch

from headlab.attention import MultiHeadAttention
from headlab.recovery.layerwise import LayerFit


class BiasCompensation(LayerFit):
    def __init__(self, ref_attn: MultiHeadAttention, attn: MultiHeadAttention) -> None:
        kept = set(attn.head_ids.tolist())
        # positions in the reference layer of the heads the pruned layer lost
        self.removed = [p for p, h in enumerate(ref_attn.head_ids.tolist()) if h not in kept]
        self.ref_attn, self.attn = ref_attn, attn
        self.total = torch.zeros(len(self.removed), ref_attn.head_dim, dtype=torch.float64)
        self.count = 0

    def reference(self, z: torch.Tensor, y: torch.Tensor) -> None:
        if self.removed:
            self.total += z[:, self.removed].double().sum(0).cpu()  # (R, D)
            self.count += z.shape[0]

    def solve(self):
        if not self.removed or not self.count:
            return None
        mean = self.total / self.count  # (R, D)
        if not bool(torch.isfinite(mean).all()):
            raise FloatingPointError("the removed heads' mean output holds NaN or inf values")
        D = self.ref_attn.head_dim
        cols = (torch.tensor(self.removed)[:, None] * D + torch.arange(D)).reshape(-1)
        w_ref = self.ref_attn.o_proj.weight.detach().cpu().double()  # (E, H_ref*D)
        contribution = w_ref[:, cols] @ mean.reshape(-1)  # (E,)
        lin = self.attn.o_proj
        bias = contribution if lin.bias is None else lin.bias.detach().cpu().double() + contribution
        return lin.weight.detach(), bias
