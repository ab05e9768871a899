"""Heads grouped by behaviour: KMeans on the per-head statistics, each group named.

The statistics of `headlab.analysis.statistics` (optionally with relative-position
features from `pattern_features`) are standardised and clustered; each cluster is named
after the statistic that sets it apart ("previous-token heads", "first-token sinks",
...), and a PCA projection gives the scatter that `HeadClusters` draws as inline SVG.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .statistics import STAT_NAMES, HeadStats

__all__ = ["HeadClusters", "cluster_heads"]

# Behaviours a cluster can be named after, in tie-break order, with their names. Each
# names the cluster whose mean of that statistic stands furthest above the overall mean.
_BEHAVIOUR_NAMES: dict[str, str] = {
    "prev": "previous-token heads",
    "next": "next-token heads",
    "self": "self heads",
    "first": "first-token sinks",
    "cls": "[CLS] heads",
    "sep": "[SEP] heads",
    "punct": "punctuation heads",
    "entropy": "broad (high-entropy) heads",
    "confidence": "focused heads",
}

# Spread below which a feature counts as constant when standardising: a 0.05 share of
# attention (or 0.05 nats). Without it, a column that is zero up to rounding (say [SEP]
# mass in a model that has no [SEP]) would be blown up to unit variance and drive both
# the clustering and the names.
_MIN_SPREAD = 0.05

# KMeans restarts: fixed, so that a seed fully determines the clustering.
_KMEANS_N_INIT = 10

# Largest number of clusters tried when choosing k by silhouette.
_MAX_AUTO_CLUSTERS = 8


@dataclass
class HeadClusters:
    """Heads grouped by behaviour.

    ``labels[i]`` is the cluster of ``stats.records[i]``; ``coords[i]`` its [x, y] on the
    first two principal components of the standardised features; ``names`` maps each
    cluster to a readable, unique name; ``method`` says how it was computed.
    """

    labels: list[int]
    coords: list[list[float]]
    names: dict[int, str]
    method: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict {"labels", "coords", "names", "method"} (names keyed by str)."""
        return {
            "labels": list(self.labels),
            "coords": [list(xy) for xy in self.coords],
            "names": {str(k): v for k, v in self.names.items()},
            "method": self.method,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> HeadClusters:
        """Inverse of to_json; also accepts the dict serialised as a JSON string."""
        if isinstance(data, str):
            data = json.loads(data)
        missing = {"labels", "coords", "names", "method"} - set(data)
        if missing:
            raise ValueError(f"HeadClusters.from_json: missing keys {sorted(missing)}.")
        return cls(
            labels=[int(x) for x in data["labels"]],
            coords=[[float(x), float(y)] for x, y in data["coords"]],
            names={int(k): str(v) for k, v in data["names"].items()},
            method=str(data["method"]),
        )

    def _repr_html_(self) -> str:
        sizes = {c: self.labels.count(c) for c in self.names}
        rows = "".join(
            f"<tr><td>{c}</td><td style=\"color:{_colour(c)}\">&#9679;</td>"
            f"<td style=\"text-align:left\">{html.escape(name)}</td><td>{sizes[c]}</td></tr>"
            for c, name in sorted(self.names.items())
        )
        return (
            '<div class="headlab-clusters" style="font-family:monospace;font-size:12px">'
            f"{self._scatter_svg()}"
            '<table style="border-collapse:collapse;text-align:right">'
            "<thead><tr><th>cluster</th><th></th><th>name</th><th>heads</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
            f"<div>{html.escape(self.method)}</div></div>"
        )

    def _scatter_svg(self, width: int = 320, height: int = 220, pad: int = 10) -> str:
        """An inline SVG scatter of coords, coloured by cluster (no scripts, no CDN)."""
        if not self.coords:
            return ""
        xs = [xy[0] for xy in self.coords]
        ys = [xy[1] for xy in self.coords]
        span_x = (max(xs) - min(xs)) or 1.0
        span_y = (max(ys) - min(ys)) or 1.0
        dots = []
        for i, ((x, y), label) in enumerate(zip(self.coords, self.labels, strict=True)):
            cx = pad + (x - min(xs)) / span_x * (width - 2 * pad)
            cy = height - pad - (y - min(ys)) / span_y * (height - 2 * pad)
            title = html.escape(f"#{i}: {self.names.get(label, label)}")
            dots.append(
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{_colour(label)}" '
                f'fill-opacity="0.8"><title>{title}</title></circle>'
            )
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'style="border:1px solid #ccc">{"".join(dots)}</svg>'
        )


_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")


def _colour(label: int) -> str:
    return _PALETTE[label % len(_PALETTE)]


def cluster_heads(
    stats: HeadStats,
    *,
    pattern_features: Any = None,
    n_clusters: int | None = None,
    seed: int = 0,
) -> HeadClusters:
    """Group heads by their statistics with KMeans and name each group by its behaviour.

    Features are the STAT_NAMES columns of ``stats``, standardised, plus optional extra
    features (N, F) aligned with ``stats.records`` (e.g. from ``pattern_features``),
    standardised and scaled so that the F extra columns together weigh as much as the
    statistics. With ``n_clusters`` None, k is chosen by silhouette over 2..min(8, N-1).
    Cluster numbers follow the order of first appearance in the records. A cluster is named
    after the statistic whose cluster mean stands furthest above the overall mean (in
    standard deviations): "previous-token heads", "first-token sinks", "[SEP] heads",
    "broad (high-entropy) heads", ...; a repeated name gets " 2", " 3" appended.
    """
    # scikit-learn is imported here, not at module level: it is slow to import,
    # and only clustering needs it.
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA
    from sklearn.metrics import silhouette_score

    records = stats.records
    n_heads = len(records)
    if n_heads == 0:
        raise ValueError("cluster_heads needs at least one head; stats.records is empty.")
    values = np.array([[r[name] for name in STAT_NAMES] for r in records], dtype=np.float64)
    if not np.isfinite(values).all():
        bad = [(r["layer"], r["head"]) for r, row in zip(records, values, strict=True)
               if not np.isfinite(row).all()]
        raise ValueError(
            f"heads {bad} (layer, head) have non-finite statistics (no valid rows were seen); "
            "drop those records before clustering."
        )
    z_stats = _standardise(values)  # (N, 9)
    blocks = [z_stats]
    n_extra = 0
    if pattern_features is not None:
        extra = np.asarray(pattern_features, dtype=np.float64)
        if extra.ndim == 1:
            extra = extra[:, None]
        if extra.ndim != 2 or extra.shape[0] != n_heads:
            raise ValueError(
                f"pattern_features has shape {extra.shape}; expected ({n_heads}, F), one row "
                "per record of stats, in the same order."
            )
        if not np.isfinite(extra).all():
            raise ValueError("pattern_features contains NaN or infinite values.")
        n_extra = extra.shape[1]
        blocks.append(_standardise(extra) * math.sqrt(len(STAT_NAMES) / max(n_extra, 1)))
    features = np.concatenate(blocks, axis=1)  # (N, 9 + F)
    n_distinct = len(np.unique(features.round(12), axis=0))

    if n_clusters is not None:
        if not 1 <= n_clusters <= n_heads:
            raise ValueError(f"n_clusters must be between 1 and {n_heads} heads; got {n_clusters}.")
        k = n_clusters
        how = "k given"
    else:
        k_max = min(_MAX_AUTO_CLUSTERS, n_heads - 1, n_distinct)
        k, how = 1, "k = 1: fewer than 2 distinct heads"
        best = -math.inf
        for candidate in range(2, k_max + 1):
            labels = _kmeans(KMeans, features, candidate, seed)
            score = float(silhouette_score(features, labels))
            if score > best:
                k, best = candidate, score
                how = f"k by silhouette over 2..{k_max}, best {best:.3f}"
    labels = _kmeans(KMeans, features, k, seed) if k > 1 else np.zeros(n_heads, dtype=int)
    labels = _relabel_by_appearance(labels)

    coords = np.zeros((n_heads, 2))
    if n_distinct > 1:
        n_components = min(2, n_heads, features.shape[1])
        projected = PCA(n_components=n_components, svd_solver="full").fit_transform(features)
        coords[:, :n_components] = projected

    return HeadClusters(
        labels=[int(x) for x in labels],
        coords=[[float(x), float(y)] for x, y in coords],
        names=_name_clusters(z_stats, labels),
        method=(
            f"KMeans(n_clusters={k}, n_init={_KMEANS_N_INIT}, random_state={seed}); {how}; "
            f"features: {len(STAT_NAMES)} standardised statistics + {n_extra} pattern "
            "features; coords: PCA, 2 components"
        ),
    )


def _standardise(x: np.ndarray) -> np.ndarray:
    """Column z-scores, with spreads below _MIN_SPREAD taken as _MIN_SPREAD."""
    return (x - x.mean(axis=0)) / np.maximum(x.std(axis=0), _MIN_SPREAD)


def _kmeans(kmeans: Any, features: np.ndarray, k: int, seed: int) -> np.ndarray:
    model = kmeans(n_clusters=k, n_init=_KMEANS_N_INIT, random_state=seed)
    return model.fit_predict(features)


def _relabel_by_appearance(labels: np.ndarray) -> np.ndarray:
    """Renumber clusters 0, 1, ... in order of first appearance, so runs compare."""
    order: dict[int, int] = {}
    for label in labels:
        order.setdefault(int(label), len(order))
    return np.array([order[int(label)] for label in labels], dtype=int)


def _name_clusters(z_stats: np.ndarray, labels: np.ndarray) -> dict[int, str]:
    """Name each cluster after its most distinctive behaviour; make the names unique."""
    clusters = sorted(set(int(x) for x in labels))
    if len(clusters) == 1:
        return {clusters[0]: "all heads"}
    # z_stats columns have overall mean 0, so a cluster's column mean is its deviation.
    columns = [STAT_NAMES.index(name) for name in _BEHAVIOUR_NAMES]
    base: dict[int, tuple[str, float]] = {}
    for c in clusters:
        deviation = z_stats[labels == c][:, columns].mean(axis=0)
        best = int(np.argmax(deviation))  # first of equals: _BEHAVIOUR_NAMES order
        if deviation[best] > 0:
            base[c] = (list(_BEHAVIOUR_NAMES.values())[best], float(deviation[best]))
        else:
            base[c] = ("mixed heads", 0.0)
    names: dict[int, str] = {}
    for name in dict.fromkeys(n for n, _ in base.values()):
        # The most distinctive cluster keeps the plain name; the others are numbered.
        same = sorted((c for c in clusters if base[c][0] == name), key=lambda c: -base[c][1])
        for rank, c in enumerate(same, start=1):
            names[c] = name if rank == 1 else f"{name} {rank}"
    return dict(sorted(names.items()))
