"""What the bidirectional encoder families share (BERT, RoBERTa, DistilBERT, ModernBERT).

Their options (head, pooling), the head a checkpoint carries and the building of the
model from it, the masked LM's decoder tied to the word embeddings, the pooling of
hidden states into sentence embeddings as sentence-transformers does it, and the
reading of a sentence-transformers pipeline (``modules.json``) that says which pooling
a checkpoint directory uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from headlab.models.layers import ACTIVATIONS
from headlab.models.weights import WeightMap, convert_state_dict, load_into

POOLINGS = ("mean", "cls", "max")
# an encoder's head -> the kind of model it makes (headlab.objectives)
HEADS = {"mlm": "masked-lm", "classifier": "classifier", "none": "embedding"}


def check_options(family: str, *, head: str, pooling: str, layout: list | None,
                  n_layers: int) -> list:
    """Validate an encoder's head, pooling and layout; return the layout (one entry per
    layer, None for an unpruned one)."""
    if head not in HEADS:
        raise ValueError(f"{family} head {head!r} is unknown; choose one of {sorted(HEADS)}")
    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r} is unknown; choose one of {POOLINGS}")
    layout = layout or [None] * n_layers
    if len(layout) != n_layers:
        raise ValueError(f"layout has {len(layout)} layers, config has {n_layers}")
    return layout


class TiedDecoder(nn.Module):
    """The masked LM's decoder: logits (B, S, V) = h (B, S, E) @ W.T + bias, where W
    (V, E) is the word embedding matrix itself.

    W is the embedding's own Parameter registered here too, as GPT-2's ``lm_head``
    holds ``wte.weight``: a tie is one Parameter held by two modules, which is how
    `headlab.parallel.memory.units` sees it and keeps both in the root FSDP unit (a unit of its
    own, the embedding would be resharded before the decoder reads it). The state
    dict holds W once, under the embedding's name: this module saves and loads nothing.
    """

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(h, self.weight, bias)  # (B, S, V)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Nothing: the embedding saves W."""

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        """Nothing: the embedding loads W."""


def activation(name: str, *, family: str):
    """The activation HF names ``name``; a ValueError naming the supported ones else."""
    if name not in ACTIVATIONS:
        raise ValueError(
            f"{family} activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def pool(h: torch.Tensor, attention_mask: torch.Tensor | None, *, pooling: str,
         normalize: bool) -> torch.Tensor:
    """Pool hidden states (B, S, E) over real tokens to (B, E), as
    sentence-transformers' Pooling (then Normalize, when the pipeline has it) does."""
    if attention_mask is None:
        attention_mask = torch.ones(h.shape[:2], dtype=torch.long, device=h.device)
    m = attention_mask.to(h.dtype)[..., None]  # (B, S, 1)
    if pooling == "mean":
        out = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
    elif pooling == "cls":
        first = attention_mask.to(torch.int).argmax(dim=1)  # first real token
        out = h[torch.arange(h.shape[0], device=h.device), first]
    else:
        out = h.masked_fill(m == 0, float("-inf")).amax(dim=1)
    return F.normalize(out, p=2, dim=-1) if normalize else out


def sentence_transformers_pooling(path: str | Path | None) -> tuple[str, bool] | None:
    """(pooling, normalize) of a sentence-transformers directory, None if it is not one.

    Reads ``modules.json`` and the Pooling module's ``config.json`` (both the legacy
    ``pooling_mode_*`` flags and the newer ``pooling_mode`` key)."""
    if path is None or not (Path(path) / "modules.json").is_file():
        return None
    path = Path(path)
    modules = json.loads((path / "modules.json").read_text())
    pooling, normalize = "mean", False
    for m in modules:
        kind = m.get("type", "").rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            cfg_file = path / m.get("path", "") / "config.json"
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
            pooling = _pooling_mode(cfg, cfg_file)
        else:
            raise ValueError(
                f"{path}: sentence-transformers module {m.get('type')!r} is not supported; "
                "headlab reproduces Transformer -> Pooling -> Normalize pipelines only"
            )
    return pooling, normalize


def _pooling_mode(cfg: dict, where: Path) -> str:
    legacy = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
              "pooling_mode_mean_tokens": "mean",
              "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
              "pooling_mode_weightedmean_tokens": "weightedmean",
              "pooling_mode_lasttoken": "lasttoken"}
    modes = cfg.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in legacy.items() if cfg.get(key)] or ["mean"]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in POOLINGS:
        raise ValueError(
            f"{where}: pooling {modes} is not supported; headlab pools with exactly one "
            f"of {POOLINGS}"
        )
    return modes[0]


def head_of(hf_config: dict, hf_state: dict[str, torch.Tensor], *, family: str,
            architectures: dict[str, str], mlm_prefix: str) -> str:
    """The head ("mlm", "classifier", "none") from the config's architectures, else
    from which keys are present (``mlm_prefix`` starts the MLM head's keys)."""
    archs = hf_config.get("architectures") or []
    unknown = [a for a in archs if a not in architectures]
    if unknown:
        raise ValueError(
            f"{family} architecture {unknown[0]!r} is not supported; supported: "
            f"{sorted(architectures)}"
        )
    if archs:
        return architectures[archs[0]]
    if any(k.startswith("classifier.") for k in hf_state):
        return "classifier"
    if any(k.startswith(mlm_prefix) for k in hf_state):
        return "mlm"
    return "none"


def head_map(backbone: WeightMap, heads: dict[str, tuple[dict[str, str], tuple[str, ...]]],
             head: str) -> WeightMap:
    """The backbone's mapping plus ``heads[head]``: that head's weights, and the known
    checkpoint parts it does not use (ignored)."""
    single, ignore = heads[head]
    return WeightMap(per_layer=backbone.per_layer, single={**backbone.single, **single},
                     ignore=backbone.ignore + ignore)


def build(model_class, cfg, hf_config: dict, hf_state: dict[str, torch.Tensor], *,
          head: str, wmap, prefixes: tuple[str, ...], path, what: str):
    """An encoder of ``model_class`` with ``head``, its weights converted by ``wmap``;
    ``path``, the checkpoint directory, tells whether it is a sentence-transformers
    model and how it pools."""
    if head == "mlm" and hf_config.get("tie_word_embeddings", True) is False:
        raise ValueError(
            f"{what}s of a masked LM with tie_word_embeddings=false are not supported: "
            "headlab's MLM decoder is the word embedding matrix"
        )
    st = sentence_transformers_pooling(path) if head == "none" else None
    pooling, normalize = st or ("mean", False)
    model = model_class(cfg, head=head, pooling=pooling, normalize=normalize)
    state = convert_state_dict(hf_state, wmap, cfg.num_hidden_layers, prefixes=prefixes)
    load_into(model, state, what=what)
    return model
