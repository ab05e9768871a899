"""Back to Hugging Face format: a directory plain transformers ``from_pretrained`` loads.

Each family states its own export on its model class: ``hf_export_unsupported``, the
reason its pruned models have no HF config (None where they may have one), and
``to_hf(self) -> (config dict, state dict)`` where it can export. This module checks
the shape that is common to every HF config (one head count for all layers, whole
GQA groups) and writes the files.
"""

from __future__ import annotations

import json
from pathlib import Path

from headlab.errors import UserError
from headlab.models.base import HeadModel
from headlab.models.format import write_tensors


def hf_expressible(model: HeadModel) -> str | None:
    """None when the pruned shape fits the family's HF config; else the reason."""
    if model.hf_export_unsupported:
        return f"{model.family}: {model.hf_export_unsupported}"
    if any(a.streaming is not None for a in model.attentions):
        return ("the model has demoted heads (a sink + window cache), which a Hugging Face "
                "config cannot express: keep the headlab format, or prune without --demote")
    heads = set(model.heads_per_layer)
    if len(heads) != 1 or 0 in heads:
        return (f"layers keep different numbers of heads ({model.heads_per_layer}); HF configs "
                "hold one count for all layers: prune with --per-layer")
    kv = set(model.kv_heads_per_layer)
    if len(kv) != 1:
        return f"layers keep different numbers of key/value heads ({model.kv_heads_per_layer})"
    for a in model.attentions:
        if not a._kv_regular:
            return "a GQA group lost only some of its query heads: groups are uneven"
    return None


def export_hf(model: HeadModel, directory: str | Path) -> Path:
    """Write config.json, model.safetensors and the tokenizer to ``directory``.

    Only for shapes the HF config can express (see `hf_expressible`); raises a
    UserError saying why otherwise.
    """
    reason = hf_expressible(model)
    if reason is not None:
        raise UserError(f"cannot export to Hugging Face format: {reason}")
    config, state = model.to_hf()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_tensors(directory / "model.safetensors", state)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(directory))
    return directory
