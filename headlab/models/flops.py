"""FLOPs of one forward of a model as it stands (pruned or not), counted from its
shapes: what pruning heads should save, to set measured latency against."""

from __future__ import annotations

from torch import nn

__all__ = ["count_flops"]


def count_flops(model, batch: int, seq: int) -> dict[str, int]:
    """FLOPs (2 per multiply-add) of one forward of ``batch`` x ``seq`` tokens, no cache.

    Counted analytically from the model's current (possibly pruned) shapes:
    ``projections`` (W_Q, W_K, W_V, W_O), ``attention`` (Q K^T and weights @ V, over
    S(S+1)/2 query-key pairs per head when causal, S^2 otherwise), ``mlp``, ``lm_head``
    and ``other`` linear layers (a pooler or classifier runs on one token per row).
    Norms, softmax, activations and embeddings lookups are left out: they are O(E) per
    token against the O(E^2) matmuls.
    """
    tokens = batch * seq
    pairs = seq * (seq + 1) // 2 if model.causal else seq * seq
    out = {"projections": 0, "attention": 0, "mlp": 0, "lm_head": 0, "other": 0}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        rows = batch if name.split(".")[0] in ("pooler", "classifier") else tokens
        flops = 2 * mod.in_features * mod.out_features * rows
        if ".attn." in name:
            out["projections"] += flops
        elif ".mlp." in name:
            out["mlp"] += flops
        elif name == "lm_head":
            out["lm_head"] += flops
        else:
            out["other"] += flops
    if getattr(model, "head", None) == "mlm":  # BERT's decoder is the embedding matrix
        vocab, width = model.wte.weight.shape
        out["lm_head"] += 2 * width * vocab * tokens
    for attn in model.attentions:
        out["attention"] += 2 * 2 * batch * attn.n_heads * attn.head_dim * pairs
    out["total"] = sum(out.values())
    return out
