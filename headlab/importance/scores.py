"""HeadScores, the scores of every head by original index, and the helpers every
scorer shares: which heads are active and the placing of scores at original indices."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from headlab._util.html import head_map
from headlab._util.io import atomic_write_json, atomic_write_text
from headlab.models.base import HeadModel


@dataclass
class HeadScores:
    """Importance per layer and original head: ``scores[layer][head]`` (NaN = absent)."""

    scores: list[list[float]]
    method: str
    data: str = ""
    n_tokens: int = 0
    normalisation: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.scores)

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.scores, dtype=torch.float64)

    def top(self, k: int = 10) -> list[tuple[int, int, float]]:
        """The ``k`` highest-scoring present heads as (layer, head, score)."""
        flat = [(layer, head, v) for layer, row in enumerate(self.scores)
                for head, v in enumerate(row) if not math.isnan(v)]
        return sorted(flat, key=lambda x: -x[2])[:k]

    def to_json(self) -> dict:
        d = asdict(self)
        d["scores"] = [[None if math.isnan(v) else v for v in row] for row in self.scores]
        return d

    @classmethod
    def from_json(cls, d: dict | str) -> HeadScores:
        d = json.loads(d) if isinstance(d, str) else dict(d)
        rows = d.get("scores")
        if not isinstance(rows, list) or not all(
                isinstance(row, list) and all(v is None or (isinstance(v, (int, float))
                                                            and not isinstance(v, bool))
                                              for v in row) for row in rows):
            raise TypeError("scores must be a list of rows (one per layer) of numbers or None "
                            f"(as HeadScores.to_json writes them), got {str(rows)[:60]!r}")
        d["scores"] = [[math.nan if v is None else float(v) for v in row] for row in d["scores"]]
        return cls(**d)

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_json())

    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["layer", "head", "importance"])
        for layer, row in enumerate(self.scores):
            for head, v in enumerate(row):
                w.writerow([layer, head, "" if math.isnan(v) else f"{v:.8g}"])
        return buf.getvalue()

    def save_csv(self, path: str | Path) -> None:
        atomic_write_text(path, self.to_csv())

    def _repr_html_(self) -> str:
        """A layers x heads heatmap as an HTML table (self-contained)."""
        t = self.tensor()
        finite = t[~t.isnan()]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
        span = (hi - lo) or 1.0

        def cell(layer: int, head: int, v: float) -> tuple[str, str, str]:
            # unnormalised loss estimates are small: two significant digits
            return (f"rgba(200,60,30,{0.08 + 0.92 * (v - lo) / span:.2f})",
                    f"L{layer} H{head}: {v:.4g}", f"{v:.2g}")

        return head_map(self.scores, cell, absent="removed",
                        caption=f"<b>{self.method}</b> importance on {self.data} "
                                f"({self.n_tokens} tokens)")


def active_heads(model: HeadModel) -> list[torch.Tensor]:
    """Per layer, which present heads are not masked (gate != 0)."""
    return [a.head_gate != 0 for a in model.attentions]


def to_original(model: HeadModel, raw: Sequence[torch.Tensor]) -> torch.Tensor:
    """Place per-present-head scores at original head indices; absent heads NaN."""
    out = torch.full((model.n_layers, model.n_original_heads), math.nan, dtype=torch.float64)
    for i, (a, s) in enumerate(zip(model.attentions, raw, strict=True)):
        active = a.head_gate.cpu() != 0
        for p, h in enumerate(a.head_ids.tolist()):
            out[i, h] = s[p] if active[p] else math.nan
    return out
