"""``flap``: FLAP's fluctuation metric with its adaptive structure (An et al. 2024,
lib/prune.py of their code, ``--metrics WIFV --structure AL-AM``, its attention part).

For each input channel c of a layer's output projection W_O (E, H*D), over the
calibration tokens (real tokens only):

    m_c = (Var_tokens[z_c] * ||W_O[:, c]||^2)^2     (FLAP squares the attention WIFV)

standardised within the layer over its channels, (m - mean) / std (unbiased std, as
``torch.std``), so that one threshold compares heads across layers; a head's score is
the mean of its D standardised channels. FLAP's running variance drops its first
sample and divides by the sample count; the per-layer standardisation makes a common
factor irrelevant, so the plain unbiased variance over tokens is used here.
"""

from __future__ import annotations

import torch

from headlab._util.progress import track
from headlab.attention.hooks import hooks
from headlab.data.blocks import Blocks
from headlab.importance.scores import active_heads
from headlab.models.base import HeadModel
from headlab.parallel import distributed


@torch.no_grad()
def flap_scores(model: HeadModel, blocks: Blocks,
                batch_size: int) -> tuple[list[torch.Tensor], int]:
    """Per layer the heads' standardised WIFV (n_heads,), NaN for heads gated off; and
    the number of tokens read."""
    attns = model.attentions
    # per layer: token count, sum and sum of squares of each W_O input channel (H*D,)
    count = torch.zeros(len(attns), dtype=torch.float64)
    sums = [torch.zeros(a.n_heads * a.head_dim, dtype=torch.float64) for a in attns]
    squares = [torch.zeros_like(s) for s in sums]
    real: torch.Tensor | None = None

    def keep(z: torch.Tensor, name: str) -> None:  # z (B, S, H, D)
        i = int(name.split(".")[1])
        x = z[real].reshape(-1, sums[i].numel()).double().cpu()  # (N, H*D)
        count[i] += x.shape[0]
        sums[i] += x.sum(0)
        squares[i] += x.pow(2).sum(0)

    was_training = model.training
    model.eval()
    try:
        with hooks(model, {"blocks.*.attn.z": keep}):
            for batch in track(blocks.batches(batch_size),
                               total=blocks.n_batches(batch_size), description="flap"):
                ids = batch["input_ids"].to(model.device)
                mask = batch["attention_mask"].to(model.device)
                real = mask.bool()
                model(ids, attention_mask=mask)
    finally:
        model.train(was_training)
    count = distributed.all_reduce_sum(count)
    out = []
    for i, (a, active) in enumerate(zip(attns, active_heads(model), strict=True)):
        H, D = a.n_heads, a.head_dim
        n = float(count[i])
        if H == 0 or n < 2:
            out.append(torch.full((H,), torch.nan, dtype=torch.float64))
            continue
        s, q = distributed.all_reduce_sum(sums[i]), distributed.all_reduce_sum(squares[i])
        var = ((q - s * s / n) / (n - 1)).clamp_min(0)  # (H*D,)
        norms = a.o_proj.weight.detach().double().cpu().pow(2).sum(0)  # (H*D,)
        metric = (var * norms).pow(2).view(H, D)
        present = active.cpu()
        kept = metric[present]  # the layer's channels, heads gated off left out
        std = kept.std() if kept.numel() > 1 else kept.new_tensor(0.0)
        std = std if float(std) > 0 else kept.new_tensor(1.0)
        head = ((metric - kept.mean()) / std).mean(1)  # (H,)
        out.append(torch.where(present, head, torch.nan))
    (n_tokens,) = distributed.sum_floats(blocks.n_tokens)
    return out, int(n_tokens)
