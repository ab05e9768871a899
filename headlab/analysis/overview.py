"""What the report shows of a model's heads, taken once on the unpruned model: one
held-out sample's attention (8-bit encoded), per-head statistics over a few held-out
rows, and clusters of heads by those statistics.

Notation used for tensor shapes: L layers, H0 original heads per layer, S tokens.
"""

from __future__ import annotations

import logging

import torch

from headlab.analysis import (
    HeadClusters,
    HeadStatsAccumulator,
    TokenRoles,
    cluster_heads,
    display_token,
)
from headlab.attention.hooks import capture
from headlab.data.blocks import Blocks
from headlab.models.base import HeadModel
from headlab.report import encode_attention
from headlab.results import Sample

log = logging.getLogger("headlab")

# held-out rows (of at most this many tokens) the statistics are averaged over
_STAT_ROWS = 4
_STAT_TOKENS = 128


@torch.no_grad()
def overview(model: HeadModel, heldout: Blocks, *, sample_tokens: int, seed: int
             ) -> tuple[Sample, list[dict], HeadClusters | None]:
    """(sample, statistics records, clusters) of ``model`` on ``heldout``: the sample is
    the first row's first ``sample_tokens`` real tokens; clusters are None where there
    are too few heads to cluster (logged)."""
    tok = model.tokenizer
    n = min(sample_tokens, heldout.input_ids.shape[1])
    ids = heldout.input_ids[:1, :n]
    valid = heldout.attention_mask[:1, :n]
    n = int(valid.sum())
    ids, valid = ids[:, :n], valid[:, :n]
    with capture(model, "pattern") as cap:
        model(ids.to(model.device), attention_mask=valid.to(model.device))
    # (L, H0, S, S): heads a pruned model no longer has stay all-zero
    full = torch.zeros(model.n_layers, model.n_original_heads, n, n)
    for layer, (pat, ids_l) in enumerate(zip(cap.per_layer("pattern"), model.head_ids(),
                                            strict=True)):
        full[layer, ids_l] = pat[0].float().cpu()
    tokens = tok.convert_ids_to_tokens(ids[0].tolist())
    sample = Sample(tok.decode(ids[0].tolist()), [display_token(t) for t in tokens],
                    encode_attention(full.numpy()))

    acc = HeadStatsAccumulator(model.n_layers)
    width = min(heldout.input_ids.shape[1], _STAT_TOKENS)
    for start in range(min(len(heldout), _STAT_ROWS)):
        bids = heldout.input_ids[start : start + 1, :width]
        bmask = heldout.attention_mask[start : start + 1, :width]
        with capture(model, "pattern") as cap:
            model(bids.to(model.device), attention_mask=bmask.to(model.device))
        toks = [tok.convert_ids_to_tokens(bids[0].tolist())]
        roles = TokenRoles.from_tokens(toks, cls_token=tok.cls_token, sep_token=tok.sep_token,
                                       valid=bmask.bool())
        acc.update([p.float().cpu() for p in cap.per_layer("pattern")], roles,
                   head_ids=model.head_ids())
    stats = acc.result()
    clusters = None
    try:
        clusters = cluster_heads(stats, seed=seed)
    except ValueError as exc:
        log.warning("head clustering skipped: %s", exc)
    return sample, stats.to_records(), clusters
