"""RecoveryReport: what a recovery did, in one type (to_json / from_json)."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LayerError:
    """One layer's relative reconstruction error of its attention output,
    ``||Y_hat - Y||^2 / ||Y||^2`` over the scoring tokens, before and after the repair
    (Y: the reference's attention output; see `headlab.recovery.layerwise`)."""

    layer: int
    error_before: float
    error_after: float
    mlp_error_before: float | None = None  # the MLP's, where its down projection is refitted
    mlp_error_after: float | None = None

    def to_json(self) -> dict[str, Any]:
        d = {"layer": self.layer, "error_before": _finite(self.error_before),
             "error_after": _finite(self.error_after)}
        if self.mlp_error_before is not None:
            d["mlp_error_before"] = _finite(self.mlp_error_before)
            d["mlp_error_after"] = _finite(self.mlp_error_after)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LayerError:
        mlp = ((_float(d["mlp_error_before"]), _float(d["mlp_error_after"]))
               if "mlp_error_before" in d else (None, None))
        return cls(int(d["layer"]), _float(d["error_before"]), _float(d["error_after"]), *mlp)


@dataclass
class RecoveryReport:
    """``method`` and its ``options``, the scoring ``tokens`` it used, its wall-clock
    ``seconds``, for the layer-wise methods the per-layer errors, and ``notes``: one
    line for each part of the method that did not run, and why."""

    method: str
    options: dict[str, Any] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0
    layers: list[LayerError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values; a non-finite error is written as null."""
        return {"method": self.method, "options": dict(self.options), "tokens": self.tokens,
                "seconds": self.seconds, "layers": [e.to_json() for e in self.layers],
                "notes": list(self.notes)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RecoveryReport:
        return cls(d["method"], dict(d.get("options") or {}), int(d.get("tokens", 0)),
                   float(d.get("seconds", 0.0)),
                   [LayerError.from_json(e) for e in d.get("layers") or []],
                   [str(n) for n in d.get("notes") or []])

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{e.layer}</td><td>{e.error_before:.4g}</td>"
                       f"<td>{e.error_after:.4g}</td></tr>" for e in self.layers)
        notes = "".join(f"<p>{html.escape(n)}</p>" for n in self.notes)
        return (f"<div><b>recovery</b> {self.method} {self.options or ''}: {self.tokens} "
                f"tokens, {self.seconds:.1f} s{notes}<table><tr><th>layer</th><th>error "
                f"before</th><th>error after</th></tr>{rows}</table></div>")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _float(x: float | None) -> float:
    return math.nan if x is None else float(x)
