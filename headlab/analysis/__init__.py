"""What each head does, measured over a dataset: statistics, token roles, rollout, clusters.

    roles       TokenRoles: valid / first / [CLS] / [SEP] / punctuation positions of a
                batch; display_token: a token as a reader would write it
    statistics  per-head entropy, confidence and attention mass on fixed places
                (Clark et al. 2019; Voita et al. 2019), streamed over batches
    rollout     the layers' attention composed into token-to-token flows
                (Abnar & Zuidema 2020)
    clusters    heads grouped by their statistics and named by their behaviour

Notation used for tensor shapes:
    B   batch size
    H   heads of one layer (may differ per layer after pruning, hence lists of tensors)
    S   query length
    T   key length (statistics and rollout need self-attention, so T == S)
    N   heads over all layers, one record each
    F   extra features per head
"""

from .clusters import HeadClusters, cluster_heads
from .roles import TokenRoles, display_token
from .rollout import rollout
from .statistics import (
    STAT_NAMES,
    HeadStats,
    HeadStatsAccumulator,
    attention_entropy,
    head_statistics,
    pattern_features,
)

__all__ = [
    "STAT_NAMES",
    "HeadClusters",
    "HeadStats",
    "HeadStatsAccumulator",
    "TokenRoles",
    "attention_entropy",
    "cluster_heads",
    "display_token",
    "head_statistics",
    "pattern_features",
    "rollout",
]
