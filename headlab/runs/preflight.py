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
from headlab.data import enwiki
from headlab.data.protocol import split_documents
from headlab.data.texts import BUNDLED_SPEC, TextData, load_texts
from headlab.errors import DataError, ModelNotFoundError, RunLockedError, UserError
from headlab.models import registry
from headlab.models.format import is_headlab
from headlab.models.loading import (
    BUNDLED,
    TOKENIZER_FILES,
    bundled_path,
    config_vocab_size,
    gguf_cache_dir,
    read_tokenizer,
)
from headlab.parallel.distributed import available
from headlab.parallel.memory import GIB, HEADROOM
from headlab.runs import lock as runlock
from headlab.runs.config import RunConfig, resolve_device
from headlab.selection import heads_to_keep

log = logging.getLogger("headlab")

_LAYER_KEYS = ("num_hidden_layers", "n_layer")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_POSITION_KEYS = ("max_position_embeddings", "n_positions")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DISK_MARGIN = 1.2  # the save needs the model plus config, tokenizer and report


def check_run(cfg: RunConfig, out: Path, *, resume: bool,
              recipe: Path | None = None) -> None:
    """Refuse (UserError) what would make ``cfg``'s run fail after its model loads, or
    write into its inputs."""
    check_out(out, resume=resume)
    check_apart(cfg, out, recipe=recipe)
    check_model_config(cfg)
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
    if params is not None and cfg.shard is None:
        check_weights_fit(cfg, params)


def check_weights_fit(cfg: RunConfig, params: int) -> None:
    """The weights alone (a prune holds its pruned copy beside them) within the device's
    memory, before any is read. Under --shard the sharded loader checks its own
    estimate, activations included (`headlab.parallel.memory.check_memory`)."""
    device = resolve_device(cfg.device)
    copies = 2 if cfg.command == "prune" else 1
    need = params * _DTYPE_BYTES.get(cfg.dtype, 4) * copies
    have = int(HEADROOM * available(device))
    if need > have:
        twice = " (twice: a prune keeps the pruned copy beside it)" if copies == 2 else ""
        raise UserError(f"{cfg.model}: its {params:,} parameters need {need / GIB:.1f} GiB in "
                        f"{cfg.dtype}{twice}, more than the {have / GIB:.1f} GiB {device} can "
                        "give; use --dtype bfloat16, a smaller model, or --shard fsdp on "
                        "several GPUs")


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


def check_apart(cfg: RunConfig, out: Path, *, recipe: Path | None = None) -> None:
    """The run directory neither is, lies inside, nor contains an input: the model's
    directory or file, a data file, the task folder, or the recipe (or its folder), so
    a run (with --overwrite or not) never writes over or deletes what it reads."""
    inputs = [("--model", _model_path(cfg.model))]
    inputs += [(f"--{key.replace('_', '-')}", Path(getattr(cfg, key)))
               for key in ("data", "calib_data", "eval_data", "include_path")
               if getattr(cfg, key) and Path(getattr(cfg, key)).exists()]
    if recipe is not None:
        inputs.append(("the recipe", Path(recipe)))
    where = Path(out).resolve()
    for flag, path in inputs:
        if path is None:
            continue
        path = path.resolve()
        inside = where.is_relative_to(path) and (path.is_dir() or where == path)
        if flag == "the recipe":  # beside a recipe is fine, its own folder is not
            inside = where in (path, path.parent)
        if inside or path.is_relative_to(where):
            relation = "is" if where == path else "contains" if path.is_relative_to(
                where) else "lies inside"
            raise UserError(f"--out {out} {relation} {flag} {path}: a run must not write "
                            "over its inputs; give another --out")


def _model_path(name: str) -> Path | None:
    """The local directory or file a model name reads; None for a hub id."""
    if name in BUNDLED:
        return bundled_path(name)
    return Path(name) if Path(name).exists() else None


def check_model_config(cfg: RunConfig) -> None:
    """What the model's config.json and the environment tell against the options: a
    head count that is a positive whole number dividing the hidden size, a per-layer
    minimum within it, lengths within the positions, torchrun for --shard."""
    if cfg.shard is not None and "WORLD_SIZE" not in os.environ:
        raise UserError(f"--shard {cfg.shard} splits the weights across torchrun ranks: start "
                        "it with torchrun --nproc-per-node N -m headlab ..., or drop --shard")
    found = _config_file(cfg.model)
    if found is None:
        return
    path, config = found
    _check_family(cfg, path)
    _check_config_values(cfg, path, config)
    _check_tokenizer(cfg, path)


def _check_config_values(cfg: RunConfig, path: Path, config: dict[str, Any]) -> None:
    """Head and layer counts, the hidden size against the heads and the weights, the
    per-layer minimum and the lengths against what ``config`` states."""
    values = {}
    for what, keys in (("layers", _LAYER_KEYS), ("heads", _HEAD_KEYS)):
        key = next((k for k in keys if k in config), None)
        if key is None:
            return
        value = config[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{path}: {key} must be a whole number >= 1, got {value!r}; the "
                            "model's config is broken")
        values[what] = value
    heads = values["heads"]
    hidden = next((config[k] for k in _HIDDEN_KEYS if k in config), None)
    if ("head_dim" not in config and isinstance(hidden, int) and not isinstance(hidden, bool)
            and hidden % heads):
        raise UserError(f"{path}: the hidden size {hidden} is not divisible by the "
                        f"{heads} attention heads; the model's config is broken")
    if isinstance(hidden, int) and not isinstance(hidden, bool):
        _check_size(path, values["layers"], hidden, heads, config.get("head_dim"))
    if cfg.min_heads_per_layer > heads:
        raise UserError(f"--min-heads-per-layer {cfg.min_heads_per_layer} is more than the "
                        f"{heads} heads of each layer of {cfg.model}")
    positions = next((config[k] for k in _POSITION_KEYS if k in config), None)
    if isinstance(positions, int) and not isinstance(positions, bool):
        lengths = [("--calib-seq-len", cfg.calib_seq_len), ("--eval-seq-len", cfg.eval_seq_len),
                   *(("--needle-lengths", n) for n in cfg.needle_lengths)]
        for flag, n in lengths:
            if n is not None and n > positions:
                raise UserError(f"{flag} {n} is beyond the {positions} positions of "
                                f"{cfg.model}; give at most {positions}")


def _check_family(cfg: RunConfig, path: Path) -> None:
    """The family config.json names is one headlab reads; what only a causal LM does
    (--demote, the needle test) is not asked of an encoder."""
    raw = read_config(path)
    try:
        family = (registry.by_name(raw.get("family")) if is_headlab(raw)
                  else registry.by_hf_type(raw.get("model_type", "?")))
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(f"{path}: {exc}") from None
    what = f"{cfg.model} ({family.cls.family}) attends both ways"
    if not family.cls.causal and cfg.demote:
        raise UserError(f"--demote keeps the first and the last positions of a causal "
                        f"model's past; {what}: prune its heads instead (without --demote)")
    if not family.cls.causal and "needle" in cfg.tasks:
        raise UserError(f"--tasks needle asks a causal language model to retrieve a planted "
                        f"fact; {what}: drop needle from --tasks")


def _check_tokenizer(cfg: RunConfig, path: Path) -> None:
    """The tokenizer beside config.json is there, parses, and fits the embedding."""
    if Path(cfg.model).suffix == ".gguf":
        return  # the tokenizer is the GGUF file's own
    if not any((path.parent / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{path.parent} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                        "a run reads text through the model's tokenizer: copy them into the "
                        "model's directory")
    read_tokenizer(path.parent, config_vocab_size(read_config(path)))


def _check_size(path: Path, layers: int, hidden: int, heads: int, head_dim: Any) -> None:
    """The sizes config.json states against the parameters the weight files hold: the
    query and output projections alone (2 E H D a layer) must fit in them, else building
    the model would allocate for a config the weights contradict. A headlab directory
    (pruned: fewer heads than its config's) is left to the loader's shape check."""
    _, stored = _from_dir(path.parent)
    if not stored or is_headlab(read_config(path)):
        return
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        head_dim = hidden // heads
    least = layers * 2 * hidden * heads * head_dim
    if least > stored:
        raise UserError(f"{path}: {layers} layers of hidden size {hidden} need at least "
                        f"{least:,} parameters, but the weight files hold {stored:,}; the "
                        "config and the weights disagree: restore config.json")


def _config_file(name: str) -> tuple[Path, dict[str, Any]] | None:
    """(config.json, the model's own config in it) where a local model has one."""
    path = _model_dir(name)
    if path is None or not (path / "config.json").is_file():
        return None
    config = read_config(path / "config.json")
    inner = config.get("config") if is_headlab(config) else config
    return (path / "config.json", inner) if isinstance(inner, dict) else None


def _model_dir(name: str) -> Path | None:
    path = bundled_path(name) if name in BUNDLED else Path(name)
    if path.suffix == ".gguf" and path.is_file():
        return gguf_cache_dir(path)
    return path if path.is_dir() else None


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
    texts = load_texts(spec, text_column=cfg.text_column, label_column=cfg.label_column)
    if texts.documents:
        _check_corpus_budget(cfg, texts)


# more tokens than words in English for every tokenizer headlab loads (GPT-2, Llama,
# Gemma and BERT vocabularies read Wikipedia at 1.2-1.5 tokens a word), so a budget
# above this many tokens per word cannot be met
_MAX_TOKENS_PER_WORD = 2


def _check_corpus_budget(cfg: RunConfig, texts: TextData) -> None:
    """--max-tokens that a corpus (or, the one source of both sets, each of its halves)
    cannot hold, known from its words before any tokenizer is read (the exact count is
    checked once the text is tokenised)."""
    one_source = (cfg.calib_data or cfg.data) == (cfg.eval_data or cfg.data)
    parts = (zip(("calibration articles", "evaluation articles"),
                 split_documents(texts, heldout=cfg.heldout, seed=cfg.seed), strict=True)
             if one_source else [("articles", texts)])
    for what, part in parts:
        words = enwiki.n_words(part.texts)
        if cfg.max_tokens > _MAX_TOKENS_PER_WORD * words:
            raise DataError(
                f"--max-tokens {cfg.max_tokens} is more than the {what} of "
                f"--data {texts.spec} hold ({len(part.texts)} articles, {words} words, fewer "
                f"than {_MAX_TOKENS_PER_WORD * words} tokens); give a smaller --max-tokens")


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
