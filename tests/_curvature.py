"""The Gauss-Newton curvature of a model's per-example loss in its head gates, computed
by hand (float64 central differences of the outputs, the loss's Hessian written out),
for the tests of the objectives' `curvature_probes` and the `taylor` scorer."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F


def gauss_newton_by_hand(model, batch: dict, eps: float = 1e-4) -> torch.Tensor:
    """The Gauss-Newton curvature of each example's loss in each gate, (B, L, H), from
    float64 central differences of the model's outputs and the loss's Hessian in them:
    cross-entropy, sum_t J_t^T (diag p_t - p_t p_t^T) J_t / T over the T scored tokens;
    embedding, ||J||^2 of the normalised embedding."""
    model = copy.deepcopy(model).double()
    ids, mask = batch["input_ids"], batch["attention_mask"]

    def outputs() -> torch.Tensor:
        out = model(ids, attention_mask=mask)
        if model.kind == "embedding":
            return F.normalize(out.embeddings, dim=-1)[:, None, :]  # (B, 1, E)
        if model.kind == "causal-lm":
            return out.logits[:, :-1]  # (B, S-1, V)
        return out.logits if model.kind == "masked-lm" else out.logits[:, None, :]

    if model.kind == "causal-lm":
        valid = (mask[:, 1:] * mask[:, :-1]).double()
    elif model.kind == "masked-lm":
        valid = (batch["labels"] != -100).double()
    else:
        valid = torch.ones(len(ids), 1, dtype=torch.float64)
    with torch.no_grad():
        base = outputs()
        p = base.softmax(-1)
        L, H = model.n_layers, model.n_original_heads
        out = torch.zeros(len(ids), L, H, dtype=torch.float64)
        for layer, attn in enumerate(model.attentions):
            for h in range(H):
                moved = []
                for sign in (1, -1):
                    g = attn.head_gate.double().clone()  # at the current mask
                    g[h] += sign * eps
                    attn.gate_override = g
                    moved.append(outputs())
                attn.gate_override = None
                J = (moved[0] - moved[1]) / (2 * eps)  # (B, T, O)
                if model.kind == "embedding":
                    out[:, layer, h] = J.pow(2).sum((1, 2))
                else:
                    per_token = (p * J.pow(2)).sum(-1) - (p * J).sum(-1).pow(2)  # J^T F J
                    out[:, layer, h] = (per_token * valid).sum(1) / valid.sum(1)
    return out
