"""What a run's checkpoint belongs to, so that `--resume` never continues another run.

A checkpoint records the run's identity: the model (its name and a fingerprint of its
files: the small ones, config.json and the tokenizer's, by content, the weights by
size and modification time), every key of the configuration that shapes the result
(all but where the run is written), and a fingerprint of the scoring and held-out
tokens. `--resume` compares the configuration's part before the model loads and the
tokens once they are cut, and refuses naming the first key that changed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from headlab.data.blocks import Blocks
from headlab.models.loading import BUNDLED, bundled_path
from headlab.runs.config import RunConfig

__all__ = ["config_identity", "token_identity"]

_NOT_SHAPING = ("out", "overwrite")  # where a run is written changes nothing in it
_BY_CONTENT = 1 << 20  # files up to 1 MB (config, tokenizer) are hashed whole


def config_identity(cfg: RunConfig) -> dict[str, Any]:
    """The model's identity and the configuration's shaping keys, known before loading."""
    keys = {k: v for k, v in cfg.to_dict().items() if k not in _NOT_SHAPING}
    return {"model": cfg.model, "model_files": _model_fingerprint(cfg.model), **keys}


def token_identity(scoring: Blocks, heldout: Blocks) -> dict[str, str]:
    """A fingerprint of the tokens the run scores and measures on."""
    h = hashlib.sha256()
    for blocks in (scoring, heldout):
        for t in (blocks.input_ids, blocks.attention_mask):  # (N, S)
            h.update(str(tuple(t.shape)).encode())
            h.update(t.to(torch.int64).contiguous().numpy().tobytes())
    return {"tokens": h.hexdigest()[:16]}


def _model_fingerprint(name: str) -> str | None:
    path = bundled_path(name) if name in BUNDLED else Path(name)
    if not path.exists():
        return None  # a hub id: its name is its identity
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for f in files:
        stat = f.stat()
        h.update(str(f.relative_to(path) if f != path else f.name).encode())
        if stat.st_size <= _BY_CONTENT:
            h.update(f.read_bytes())
        else:
            h.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]
