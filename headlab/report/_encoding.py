"""Compact attention storage and script-safe JSON for the HTML report.

Attention of the sample is stored in results.json as 8-bit codes (weight = byte / 255,
worst-case error 1/510) in base64, row-major over shape (L, H, S, S): a 12 x 12-head
model with a 64-token sample takes 0.8 MB instead of ~7 MB of JSON floats.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

ENCODING = "uint8-base64"

# Softmax output can stray this far outside [0, 1] through float rounding; anything
# further means the caller passed scores or logits, not attention weights.
_RANGE_SLACK = 1e-3

# Characters that could end the <script> element or open markup or an entity inside it,
# plus the two line separators that older JavaScript parsers reject in strings.
_SCRIPT_UNSAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
                  "\u2028": "\\u2028", "\u2029": "\\u2029"}


def encode_attention(weights: Any) -> dict:
    """Quantise attention weights (L, H, S, S) in [0, 1] to the results.json form.

    Accepts a numpy array or a torch tensor (any device or dtype). Returns
    {"encoding": "uint8-base64", "shape": [L, H, S, S], "data": str}.
    """
    if hasattr(weights, "detach"):  # a torch tensor, without importing torch here
        weights = weights.detach().float().cpu().numpy()
    w = np.asarray(weights, dtype=np.float32)
    if w.ndim != 4 or w.shape[2] != w.shape[3]:
        raise ValueError(
            f"attention must have shape (layers, heads, S, S); got {tuple(w.shape)}. "
            "Stack the per-layer patterns of one sample, batch dimension removed."
        )
    if w.size and not np.isfinite(w).all():
        raise ValueError("attention contains NaN or inf; zero fully masked rows first")
    if w.size and (w.min() < -_RANGE_SLACK or w.max() > 1 + _RANGE_SLACK):
        raise ValueError(
            f"attention weights must lie in [0, 1]; got [{w.min():.4g}, {w.max():.4g}]. "
            "Pass the softmax output (hook 'pattern'), not the scores."
        )
    codes = np.rint(np.clip(w, 0.0, 1.0) * 255.0).astype(np.uint8)  # (L, H, S, S)
    return {
        "encoding": ENCODING,
        "shape": [int(n) for n in w.shape],
        "data": base64.b64encode(codes.tobytes(order="C")).decode("ascii"),
    }


def decode_attention(d: dict) -> np.ndarray:
    """Inverse of encode_attention: float32 array of the stored shape, values byte/255."""
    if d.get("encoding") != ENCODING:
        raise ValueError(f"unknown attention encoding {d.get('encoding')!r}; "
                         f"expected {ENCODING!r}")
    shape = tuple(int(n) for n in d["shape"])
    codes = np.frombuffer(base64.b64decode(d["data"], validate=True), dtype=np.uint8)
    if codes.size != int(np.prod(shape)):
        raise ValueError(f"attention data holds {codes.size} values but shape {list(shape)} "
                         f"needs {int(np.prod(shape))}; the results file is damaged")
    return (codes.astype(np.float32) / 255.0).reshape(shape)


def script_json(obj: Any) -> str:
    """JSON text that is safe inside <script type="application/json">.

    <, > and & become \\u escapes, so no string in the data (a token such as
    "</script><img ...>") can close the element or form markup; JSON.parse restores them.
    NaN and inf are refused because JSON.parse would reject the whole block.
    """
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for char, escaped in _SCRIPT_UNSAFE.items():
        text = text.replace(char, escaped)
    return text
