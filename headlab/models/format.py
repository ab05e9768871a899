"""headlab's own model directory: the one writer and the one reader of it.

    DIR/config.json        the meta (below)
    DIR/model.safetensors  the state dict, tied tensors stored as separate copies; or,
                           written block by block by `headlab.parallel.sharding`, several
                           safetensors files and model.safetensors.index.json
    DIR/tokenizer*         the tokenizer's own files, where the model has one

The meta: ``headlab_format`` (`HEADLAB_FORMAT`); ``family``, the name the model's exact
class registered (`headlab.models.registry`), so a Qwen3 comes back a Qwen3; ``kind``;
``config`` and ``extra`` (the family config and the constructor's other arguments);
and per layer ``layout`` (its kv_index: a pruned layer's shape), ``out_bias`` (whether
W_O has a bias: recovery may give one to a family built without) and ``streaming``
(its demoted key/value heads, `headlab.attention.streaming`, or null).

`write` writes a whole model; the sharded writer writes the same directory from the
rows it gathers, with `write_tensors` and `write_meta`. `build` makes the model a
directory describes, for `headlab.load` to load its tensors into and for the sharded
reader to build on the meta device and fill with each rank's rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn

from headlab._util.io import atomic_path, atomic_write_text, os_error
from headlab.attention.streaming import Streaming
from headlab.errors import ModelNotFoundError, UserError
from headlab.models import registry

if TYPE_CHECKING:
    from headlab.attention import MultiHeadAttention

HEADLAB_FORMAT = 1
INDEX = "model.safetensors.index.json"


def is_headlab(config: dict) -> bool:
    """Whether a directory's config.json is headlab's meta (else an HF config)."""
    return "headlab_format" in config


# ---------------------------------------------------------------------- writing
def write(model: nn.Module, directory: str | Path) -> Path:
    """Write ``model`` (a `HeadModel`) to ``directory``: config.json, model.safetensors,
    the tokenizer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_tensors(directory / "model.safetensors", model.state_dict())
    write_meta(model, directory, [layer_meta(a) for a in model.attentions])
    return directory


def layer_meta(attn: MultiHeadAttention) -> dict[str, Any]:
    """What the meta records of one layer: its layout, W_O bias and demoted heads."""
    return {"layout": attn.kv_index.tolist(), "out_bias": attn.o_proj.bias is not None,
            "streaming": attn.streaming.to_json() if attn.streaming is not None else None}


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file, written whole or not at all."""
    with atomic_path(path) as tmp:
        try:
            save_file(_untied(tensors), str(tmp), metadata={"format": "pt"})
        except Exception as exc:  # safetensors wraps a full disk in its own error
            raise os_error(exc, path) from exc


def write_meta(model: nn.Module, directory: Path, layers: list[dict[str, Any]], *,
               files: dict[str, str] | None = None) -> None:
    """config.json for ``model`` whose layers are ``layers`` (`layer_meta` each), the
    tokenizer, and with ``files`` (tensor name -> file) the safetensors index."""
    if files is not None:
        atomic_write_text(directory / INDEX, json.dumps(
            {"metadata": {"format": "pt"}, "weight_map": files}, indent=2))
    meta = {
        "headlab_format": HEADLAB_FORMAT,
        "family": model.family,
        "kind": model.kind,
        "config": model.config.to_dict(),
        "extra": model.extra_config(),
        **{key: [layer[key] for layer in layers] for key in ("layout", "out_bias", "streaming")},
    }
    atomic_write_text(directory / "config.json", json.dumps(meta, indent=2))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(directory))


def _untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each name its own contiguous tensor, as safetensors wants: tied weights (an
    embedding and its head) and one rank's gathered copies of them share storage."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        v = v.detach().contiguous()
        ptr = v.untyped_storage().data_ptr()
        if v.numel() and ptr in seen:
            v = v.clone()
        seen.add(ptr)
        out[k] = v
    return out


# ---------------------------------------------------------------------- reading
def build(meta: dict[str, Any], state: dict[str, torch.Tensor],
          where: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model ``meta`` describes, without its weights, and ``state`` as the model
    names it: the family's `HeadModel.upgrade` may change both first (a directory an
    older headlab wrote). Refuses a format or a family this headlab does not know."""
    version = meta["headlab_format"]
    if version != HEADLAB_FORMAT:
        raise UserError(f"{where}: headlab format {version} is not supported (this "
                        f"headlab reads format {HEADLAB_FORMAT}); upgrade headlab")
    try:
        cls = registry.by_name(meta.get("family")).cls
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(f"{where}: {exc}") from None
    meta, state = cls.upgrade(meta, state)
    model = cls(cls.config_class.from_dict(meta["config"]), layout=meta["layout"],
                **meta.get("extra", {}))
    for attn, has_bias in zip(model.attentions, meta.get("out_bias") or [], strict=False):
        if has_bias:  # a bias recovery added to a family built without one
            attn.ensure_out_bias()
    for attn, streaming in zip(model.attentions, meta.get("streaming") or [], strict=False):
        if streaming is not None:  # demoted heads keep their sink + window cache
            attn.streaming = Streaming.from_json(streaming)
    return model, state
