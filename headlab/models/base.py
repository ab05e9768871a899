"""What every headlab model shares: the model interface, structure, gates, pruning (the
weight conversion from Hugging Face names is `headlab.models.weights`).

A family file (gpt2.py, bert.py, llama.py) subclasses `HeadModel`, declares each piece
of its interface, builds its blocks (each with an ``attn`` that is a
`headlab.attention.MultiHeadAttention`), declares its weight mapping from Hugging Face
names as data, converted by `headlab.models.weights.convert_state_dict`, and registers its class
(`headlab.models.registry`). Models are saved through `headlab.models.format`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from headlab.attention import MultiHeadAttention
from headlab.attention.kv_cache import Cache
from headlab.attention.streaming import StreamingCache, cache_bytes, n_streaming


@dataclass
class ModelOutput:
    """What a forward returns. ``logits`` (B, S, V) for language models, (B, C) for
    classifiers; ``last_hidden_state`` (B, S, E) always; ``embeddings`` (B, E) for
    sentence-embedding models (mean-pooled, as sentence-transformers does)."""

    last_hidden_state: torch.Tensor
    logits: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None


@dataclass
class BlockInputs:
    """The first block's input and the blocks as the forward calls them (its mask and
    rotary positions bound): ``block(i, x)`` and ``attention(i, x)``, block i's
    attention sublayer alone (its norm and attention, no residual), on x (B, S, E)."""

    hidden: torch.Tensor  # (B, S, E)
    block: Callable[[int, torch.Tensor], torch.Tensor]  # (B, S, E) -> (B, S, E)
    attention: Callable[[int, torch.Tensor], torch.Tensor]  # (B, S, E) -> (B, S, E)


@dataclass
class FamilyConfig:
    """Base for family configs: plain fields, dict round trip that rejects unknown keys."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(
                f"unknown {cls.__name__} keys {sorted(unknown)}; known keys: {sorted(known)}"
            )
        return cls(**d)

    @classmethod
    def known(cls, hf: Mapping[str, Any], *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """The entries of an HF config.json that are fields of this config: HF configs
        carry many keys a headlab model does not need, and those are ignored."""
        return {k: hf[k] for k in cls.__dataclass_fields__ if k in hf and k not in skip}


@dataclass(frozen=True)
class Absent:
    """A piece of the model interface that a family does not have, and why. Falsy, so
    ``if model.mlp_down:`` reads "the family has one"."""

    reason: str

    def __bool__(self) -> bool:
        return False


class HeadModel(nn.Module):
    """A transformer whose every block has ``attn``, a MultiHeadAttention.

    Subclasses set ``family`` and ``kind`` and implement ``forward(input_ids,
    attention_mask=None, *, cache=None, position_ids=None) -> ModelOutput``. A family
    declares every piece of the model interface below, each a value or an `Absent`
    saying why it has none: `headlab.models.registry.register` refuses a class that
    leaves one out (`interface_gaps`).
    """

    family: ClassVar[str] = ""
    causal: ClassVar[bool] = False  # whether a query attends only to itself and the past
    config_class: ClassVar[type[FamilyConfig]]
    # capabilities this family lacks (features of the conformance matrix, tests/_families.py)
    # -> why; what follows from the kind (an encoder keeps no KV cache) is not declared
    not_applicable: ClassVar[Mapping[str, str]] = {}
    kind: str
    blocks: nn.ModuleList
    tokenizer: Any = None

    # ---------------------------------------------------------------- the model interface
    # the norm between the last block and the output (direct logit attribution reads
    # the residual stream through it): a property, or a module set in __init__ and
    # declared by an annotation, or Absent
    final_norm: nn.Module | Absent
    # each block's MLP down projection (F -> E), a dotted path relative to the block:
    # recovery refits it
    mlp_down: ClassVar[str | Absent]
    # the most positions the model reads: a property, from the config
    max_positions: int
    # why pruned models of this family have no Hugging Face export (`models.export`);
    # None (or a property) where the family defines to_hf(self) -> (config, state dict)
    hf_export_unsupported: ClassVar[str | None]
    # with to_hf: the HF config key that gives W_O a bias (with Q, K and V's), under
    # which a W_O bias that recovery added is exported
    # (a property where it depends on the model's configuration)
    hf_attention_bias_key: ClassVar[str | Absent]

    def __init__(self, config: FamilyConfig) -> None:
        super().__init__()
        self.config = config

    @classmethod
    def interface_gaps(cls) -> list[str]:
        """The pieces of the model interface ``cls`` leaves out, each with what it
        should be; empty where the class declares them all. Only what a family class
        itself (or a class between it and this module's) declares counts."""
        def declared(name: str) -> bool:
            return any(name in vars(c) or name in inspect.get_annotations(c)
                       for c in cls.__mro__
                       if issubclass(c, HeadModel) and c.__module__ != __name__)

        def value(name: str) -> Any:
            return inspect.getattr_static(cls, name, None) if declared(name) else None

        gaps = []
        if not cls.family:
            gaps.append("family: the name saved model directories record")
        if not hasattr(cls, "config_class"):
            gaps.append("config_class: the family's FamilyConfig")
        if not declared("final_norm"):
            gaps.append("final_norm: the norm after the last block, or Absent(why)")
        if not isinstance(value("mlp_down"), str | Absent):
            gaps.append("mlp_down: the MLP down projection's path in a block, or Absent(why)")
        if not isinstance(value("max_positions"), property | int):
            gaps.append("max_positions: the most positions the model reads")
        reason = value("hf_export_unsupported")
        exports = (declared("hf_export_unsupported") and callable(getattr(cls, "to_hf", None))
                   and (reason is None or isinstance(reason, property)))
        if not exports and not (isinstance(reason, str) and reason):
            gaps.append("hf_export_unsupported: why the family has no HF export, or None "
                        "with to_hf")
        if exports and not isinstance(value("hf_attention_bias_key"), str | Absent | property):
            gaps.append("hf_attention_bias_key: the HF config key that gives W_O a bias, "
                        "or Absent(why)")
        return gaps

    # ---------------------------------------------------------------- structure
    @property
    def attentions(self) -> list[MultiHeadAttention]:
        return [block.attn for block in self.blocks]

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    @property
    def heads_per_layer(self) -> list[int]:
        """Query heads in each layer (uneven after pruning)."""
        return [a.n_heads for a in self.attentions]

    @property
    def kv_heads_per_layer(self) -> list[int]:
        return [a.n_kv_heads for a in self.attentions]

    @property
    def n_original_heads(self) -> int:
        """Query heads per layer before any pruning."""
        return self.attentions[0].n_original_heads

    @property
    def head_dim(self) -> int:
        return self.attentions[0].head_dim

    def layout(self) -> list[list[int]]:
        """Each layer's kv_index: enough, with the config, to rebuild a pruned model."""
        return [a.kv_index.tolist() for a in self.attentions]

    def head_ids(self) -> list[list[int]]:
        """Original indices of the heads each layer still has."""
        return [a.head_ids.tolist() for a in self.attentions]

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def kv_cache_bytes_per_token(self, length: int | None = None) -> float:
        """Bytes of key/value cache one token costs across all layers: each further
        token's, or with ``length`` the cache holding ``length`` positions / length.
        Demoted key/value heads (`headlab.attention.streaming`) keep at most sinks + window
        positions, so they add nothing per further token."""
        size = torch.finfo(self.dtype).bits // 8
        if length is None:
            return sum(2 * a.head_dim * size * (a.n_kv_heads - n_streaming(a))
                       for a in self.attentions)
        return self.kv_cache_bytes(length) / length

    def kv_cache_bytes(self, length: int) -> int:
        """Bytes of the key/value cache holding ``length`` positions, batch 1."""
        size = torch.finfo(self.dtype).bits // 8
        return sum(cache_bytes(a, length, dtype_size=size) for a in self.attentions)

    # ---------------------------------------------------------------- gates
    def gates(self) -> list[torch.Tensor]:
        """Per-layer head gates, (H_l,) each, indexed by current head position."""
        return [a.head_gate for a in self.attentions]

    def set_gates(self, gates: Mapping[int, Iterable[float]] | list) -> None:
        """Set gates per layer: {layer: values (H_l,)} or a list over all layers."""
        items = gates.items() if isinstance(gates, Mapping) else enumerate(gates)
        for layer, values in items:
            self.attentions[int(layer)].set_gates(values)

    def mask_heads(self, heads: Mapping[int, Iterable[int]]) -> None:
        """Set the gates of {layer: original head indices} to 0 (a soft prune)."""
        for layer, ids in heads.items():
            attn = self.attentions[int(layer)]
            pos = {h: p for p, h in enumerate(attn.head_ids.tolist())}
            g = attn.head_gate.clone()
            for h in ids:
                if int(h) in pos:
                    g[pos[int(h)]] = 0.0
            attn.set_gates(g)

    def prune_heads(self, heads: Mapping[int, Iterable[int]]) -> None:
        """Physically remove {layer: original head indices}."""
        for layer, ids in heads.items():
            if not 0 <= int(layer) < self.n_layers:
                raise ValueError(f"layer {layer} out of range: the model has {self.n_layers}")
            self.attentions[int(layer)].prune_heads(ids)

    # ---------------------------------------------------------------- forward helpers
    def block_inputs(self, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None = None) -> BlockInputs:
        """What ``forward`` hands its blocks for ``input_ids`` (B, S) (no cache), so the
        blocks can be run one at a time, as layer-wise recovery does."""
        raise NotImplementedError(f"{self.family} does not expose its blocks one by one")

    def new_cache(self) -> Cache:
        cache = Cache(self.n_layers)
        for i, attn in enumerate(self.attentions):
            if attn.streaming is not None:  # demoted heads: sinks + a ring of the window
                cache.layers[i] = StreamingCache(attn.streaming)
        return cache

    # ---------------------------------------------------------------- save / load
    def save(self, directory: str | Path) -> Path:
        """Write the model, its config and its tokenizer (`headlab.models.format`)."""
        from headlab.models.format import write

        return write(self, directory)

    def extra_config(self) -> dict[str, Any]:
        """Family-specific construction facts beyond the config (e.g. head kind)."""
        return {}

    @classmethod
    def upgrade(cls, meta: dict[str, Any], state: dict[str, Any]
                ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A saved directory's config.json and state dict, as an older headlab wrote
        them, in this family's present format; what is already present passes as it is.
        The state's values are not read (a loader may pass names in place of tensors)."""
        return meta, state


class DecoderLM(HeadModel):
    """A causal language model: embeddings, causal blocks, a final norm, ``lm_head``.

    ``forward`` settles what every decoder shares (the positions after the cached ones,
    the logits); a family implements ``decode``, its embeddings, mask and blocks.
    """

    causal = True
    lm_head: nn.Linear

    def __init__(self, config: FamilyConfig) -> None:
        super().__init__(config)
        self.kind = "causal-lm"

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        cache: Cache | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids (B, S); attention_mask (B, T) with 1 = real token, T = past + S;
        position_ids (B|1, S), by default past .. past + S - 1 as in HF's forward."""
        past = cache.length if cache is not None else 0
        if position_ids is None:
            S = input_ids.shape[1]
            position_ids = torch.arange(past, past + S, device=input_ids.device)[None]
        h = self.decode(input_ids, attention_mask, position_ids, past, cache)  # (B, S, E)
        return ModelOutput(last_hidden_state=h, logits=self.cap_logits(self.lm_head(h)))

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the family does to ``lm_head``'s output (soft-capping, in Gemma-2); here
        nothing."""
        return logits

    def logits_at(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``forward``'s logits of the tokens ``ids`` (..., K) at the final hidden states
        ``hidden`` (..., E): K rows of the unembedding, not the whole vocabulary."""
        weight, bias = (_whole(p) for p in (self.lm_head.weight, self.lm_head.bias))
        rows = weight[ids]  # (..., K, E)
        logits = (rows @ hidden[..., None].to(rows.dtype))[..., 0]  # (..., K)
        if bias is not None:
            logits = logits + bias[ids]
        return self.cap_logits(logits)

    def generate(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """Greedy or sampled continuation with the KV cache; see `headlab.models.generation`;
        only causal language models generate."""
        from headlab.models.generation import generate

        return generate(self, input_ids, **kwargs)

    def decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor, past: int, cache: Cache | None) -> torch.Tensor:
        """The final hidden states (B, S, E) of ``input_ids`` after ``past`` cached ones."""
        raise NotImplementedError


def _whole(p: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter whole: outside a forward, FSDP2 leaves each rank its shard (a DTensor),
    gathered here from every rank, which must all call this alike."""
    return p.full_tensor() if isinstance(p, DTensor) else p
