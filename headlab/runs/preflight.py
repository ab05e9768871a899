"""What a run checks before it loads a model: everything that can be checked cheaply.

The model's head count comes from its config.json or GGUF header (the files checked
against their lengths on the way), so an impossible target is refused in a second
instead of after the model has loaded; the run directory must be creatable, not a
file and not in use by a live run; the data must exist, be text and parse, a dataset
spec must follow its grammar; and a disk too small for the pruned model's save is
warned about. Everything raises the errors of `headlab.errors`.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from headlab._util.filecheck import (
    check_dataset_spec,
    check_safetensors,
    read_config,
    read_gguf_header,
)
from headlab.data.texts import BUNDLED_SPEC, load_texts
from headlab.errors import RunLockedError, UserError
from headlab.models.format import is_headlab
from headlab.models.loading import BUNDLED, bundled_path, gguf_cache_dir
from headlab.runs import lock as runlock
from headlab.runs.config import RunConfig
from headlab.selection import heads_to_keep

log = logging.getLogger("headlab")

_LAYER_KEYS = ("num_hidden_layers", "n_layer")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DISK_MARGIN = 1.2  # the save needs the model plus config, tokenizer and report


def check_run(cfg: RunConfig, out: Path, *, resume: bool) -> None:
    """Refuse (UserError) what would make ``cfg``'s run fail after its model loads."""
    check_out(out, resume=resume)
    check_data(cfg)
    heads, params = model_size(cfg.model)
    targeted = cfg.keep is not None or cfg.prune is not None  # a score's too (gates)
    if (cfg.command == "prune" or targeted) and heads is not None and cfg.unit == "head":
        try:
            heads_to_keep(heads, keep=cfg.keep, prune=cfg.prune)
        except UserError as exc:
            raise UserError(f"{cfg.model} has {heads} attention heads: {exc}") from None
    if cfg.command == "prune" and params is not None:
        _warn_if_disk_small(out, params * _DTYPE_BYTES.get(cfg.dtype, 4))


def check_out(out: Path, *, resume: bool) -> None:
    """``out`` is, or can be made, a writable directory that no live run holds."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory; give a directory path")
    base = out
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise UserError(f"--out {out}: {base} is a file, not a directory; give another --out")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: {base} is not writable (read-only file system or no "
                        "permission); give a writable --out")
    pid = runlock.holder(out) if out.is_dir() else None
    if pid is not None:
        raise RunLockedError(f"run directory {out} is in use by process {pid}; wait for it "
                             "to end or give another --out", pid=pid)
    if resume and not out.is_dir():
        raise UserError(f"--resume {out}: no such run directory")


def check_data(cfg: RunConfig) -> None:
    """The data is readable before the model loads: a dataset spec by its grammar, a
    file by reading it (its text, rows and columns); --data, --calib-data and
    --eval-data alike."""
    for spec in dict.fromkeys((cfg.data, cfg.calib_data, cfg.eval_data)):
        _check_spec(cfg, spec)


def _check_spec(cfg: RunConfig, spec: str | None) -> None:
    if spec is None or spec == BUNDLED_SPEC:
        return
    if spec.count(":") >= 1 and not Path(spec).exists() and Path(spec).suffix.lower() not in (
            ".txt", ".jsonl", ".json", ".csv", ".tsv"):
        check_dataset_spec(spec)  # the hub is asked later, once the model is loaded
        return
    load_texts(spec, text_column=cfg.text_column, label_column=cfg.label_column)


def model_size(name: str) -> tuple[int | None, int | None]:
    """(attention heads, parameters) of a model from its header files alone; None
    where they cannot be known without loading it (a hub id, an unknown config)."""
    if name in BUNDLED:
        path = bundled_path(name)
    elif Path(name).exists() or name.endswith(".gguf"):
        path = Path(name)
    else:
        return None, None
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            return None, None  # the loader says it does not exist
        cached = gguf_cache_dir(path)
        if (cached / "config.json").is_file():
            return _from_dir(cached)
        meta = read_gguf_header(path)
        arch = meta.get("general.architecture")
        heads = _product(meta.get(f"{arch}.block_count"),
                         meta.get(f"{arch}.attention.head_count"))
        return heads, None
    if path.is_dir() and (path / "config.json").is_file():
        return _from_dir(path)
    return None, None


def _from_dir(path: Path) -> tuple[int | None, int | None]:
    config = read_config(path / "config.json")
    n_params = 0
    for f in sorted(path.glob("*.safetensors")):
        n_params += _safetensors_params(f)
    inner = config.get("config") if is_headlab(config) else config
    if not isinstance(inner, dict):
        return None, n_params or None
    layers = next((inner[k] for k in _LAYER_KEYS if k in inner), None)
    heads = next((inner[k] for k in _HEAD_KEYS if k in inner), None)
    return _product(layers, heads), n_params or None


def _safetensors_params(path: Path) -> int:
    """Elements of a safetensors file, read from its checked header."""
    import json
    import math
    import struct

    check_safetensors(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(n))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def _product(layers: Any, heads: Any) -> int | None:
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (layers, heads))
    return layers * heads if ok else None


def _warn_if_disk_small(out: Path, needed: int) -> None:
    base = Path(out)
    while not base.exists():
        base = base.parent
    free = shutil.disk_usage(base).free
    if free < _DISK_MARGIN * needed:
        log.warning("only %.1f MB free at %s; saving the pruned model needs up to %.1f MB: "
                    "free space or give another --out", free / 1e6, base, needed / 1e6)
