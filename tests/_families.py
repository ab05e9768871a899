"""Tiny random-weight checkpoints of every family headlab rebuilds, written by
transformers' ``save_pretrained`` (float32, 2 layers, 4 heads; ModernBERT 3 layers), and
what the conformance matrix (test_conformance.py) knows about each family.

The checkpoints: `DECODERS` (test_decoders.py's cases) and `write_decoder`, `ENCODERS`
(test_encoders.py's families, via _encoders.py) and `write_encoder`, and the matrix's
own GPT-2, Llama and BERT beside them. The matrix: `MATRIX` (one entry per family, its
checkpoint writer and headlab family), `FEATURES` (one test per feature) and `gaps`,
the features a family cannot have with the reason, which `capability_table` renders
into the README (scripts/capability_table.py writes it there).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers as tf

# ---------------------------------------------------------------------- decoders
DECODER_SIZE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=128, bos_token_id=None,
                    eos_token_id=None, pad_token_id=None)
_SLIDE = ["full_attention", "sliding_attention"]
DECODERS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                   max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(num_key_value_heads=2, head_dim=24, use_sliding_window=True,
                   sliding_window=4, layer_types=_SLIDE)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_key_value_heads=2, sliding_window=4)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                    query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                    final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                    query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={
                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                           "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(num_key_value_heads=2, sliding_window=4,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.5})),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(use_parallel_residual=True)),
    "neox-sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                        dict(use_parallel_residual=False, hidden_act="gelu_new",
                             rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.5})),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2)),
}
# the matrix's decoders beside those (GPT-2 reads DECODER_SIZE through its attribute map)
_MORE_DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_inner=96)),
}
_NORM = re.compile(r"norm|\bln_")  # a norm's weight: GPT-2's ln_1, ln_2, ln_f included


def write_decoder(directory, case: str, **override) -> str:
    """A random-weight HF checkpoint, weights large enough that attention is far from
    uniform (HF's init, std 0.02, would make every head look alike)."""
    cfg_class, model_class, extra = {**DECODERS, **_MORE_DECODERS}[case]
    torch.manual_seed(0)
    config = getattr(tf, cfg_class)(**{**DECODER_SIZE, **extra, **override})
    model = getattr(tf, model_class)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _NORM.search(name) and name.endswith("weight"):
                base = 0.0 if case.startswith("gemma") else 1.0  # Gemma scales by 1 + w
                p.copy_(base + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(directory)
    return str(directory)


# ---------------------------------------------------------------------- encoders
VOCAB = 97


@dataclass(frozen=True)
class Family:
    """One encoder family: its HF config class and keyword arguments, and its HF model
    class per headlab head ("encoder", "mlm", "classifier"), named in transformers (so
    that reading this module imports no model code: the sharded job's ranks import it)."""

    name: str
    config: str
    kwargs: dict
    classes: dict[str, str]
    pad: int

    def hf_config(self, **extra) -> tf.PretrainedConfig:
        return getattr(tf, self.config)(**{**self.kwargs, **extra})

    def hf_class(self, head: str) -> type[tf.PreTrainedModel]:
        return getattr(tf, self.classes[head])


_BERT_LIKE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, num_labels=3)
ENCODERS = {
    "roberta": Family(
        "roberta", "RobertaConfig",
        dict(_BERT_LIKE, max_position_embeddings=24, pad_token_id=1, bos_token_id=0,
             eos_token_id=2),
        {"encoder": "RobertaModel", "mlm": "RobertaForMaskedLM",
         "classifier": "RobertaForSequenceClassification"}, pad=1),
    "xlm-roberta": Family(
        "xlm-roberta", "XLMRobertaConfig",
        dict(_BERT_LIKE, max_position_embeddings=24, pad_token_id=1, bos_token_id=0,
             eos_token_id=2, hidden_act="gelu_new"),
        {"encoder": "XLMRobertaModel", "mlm": "XLMRobertaForMaskedLM",
         "classifier": "XLMRobertaForSequenceClassification"}, pad=1),
    "distilbert": Family(
        "distilbert", "DistilBertConfig",
        dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
             max_position_embeddings=24, num_labels=3, pad_token_id=0, activation="gelu"),
        {"encoder": "DistilBertModel", "mlm": "DistilBertForMaskedLM",
         "classifier": "DistilBertForSequenceClassification"}, pad=0),
    # 3 layers: global, local, global; a local query sees 2 keys either side (S = 12)
    "modernbert": Family(
        "modernbert", "ModernBertConfig",
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             intermediate_size=48, max_position_embeddings=64, local_attention=4,
             global_attn_every_n_layers=2, num_labels=3, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, cls_token_id=1, sep_token_id=2),
        {"encoder": "ModernBertModel", "mlm": "ModernBertForMaskedLM",
         "classifier": "ModernBertForSequenceClassification"}, pad=0),
}
# BERT's own tests (test_bert.py) write theirs; this one is the matrix's
BERT = Family("bert", "BertConfig", dict(_BERT_LIKE, max_position_embeddings=24),
              {"encoder": "BertModel", "mlm": "BertForMaskedLM",
               "classifier": "BertForSequenceClassification"}, pad=0)


def write_encoder(path, fam: Family, head: str, *, seed: int = 0, std: float = 0.3, **extra):
    """Save a random HF model whose every parameter is drawn with ``std`` (biases and
    norms included), so attention is far from uniform; returns the directory."""
    torch.manual_seed(seed)
    hf = fam.hf_class(head)(fam.hf_config(**extra))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, std)
    directory = path / f"{fam.name}-{head}"
    hf.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------- the matrix
@dataclass(frozen=True)
class Entry:
    """One family of the matrix: the headlab family its checkpoint loads as, and the
    writer of that checkpoint (directory, tokenizer) -> directory, sized to the tokenizer
    and saved with it (decoders get the decoder tokenizer, encoders the encoder one)."""

    family: str
    write: Callable[[Path, Any], Path]

    @property
    def causal(self) -> bool:
        return model_class(self.family).causal


def _decoder(case: str) -> Callable[[Path, Any], Path]:
    def write(directory: Path, tok) -> Path:
        write_decoder(directory, case, vocab_size=len(tok))
        tok.save_pretrained(directory)
        return directory
    return write


def _encoder(fam: Family) -> Callable[[Path, Any], Path]:
    def write(directory: Path, tok) -> Path:
        out = write_encoder(directory, fam, "mlm", vocab_size=len(tok),
                            pad_token_id=tok.pad_token_id)
        tok.save_pretrained(out)
        return out
    return write


# matrix id -> entry; XLM-R is left out: it loads as RoBERTa's class, RoBERTa's row
MATRIX: dict[str, Entry] = {
    "gpt2": Entry("gpt2", _decoder("gpt2")),
    "llama": Entry("llama", _decoder("llama")),
    "mistral": Entry("llama", _decoder("mistral")),
    "qwen2": Entry("qwen2", _decoder("qwen2")),
    "qwen3": Entry("qwen3", _decoder("qwen3")),
    "gemma2": Entry("gemma2", _decoder("gemma2")),
    "gemma3": Entry("gemma3", _decoder("gemma3")),
    "phi3": Entry("phi3", _decoder("phi3")),
    "gpt_neox": Entry("gpt_neox", _decoder("neox")),  # parallel residual
    "olmo2": Entry("olmo2", _decoder("olmo2")),
    "bert": Entry("bert", _encoder(BERT)),
    "roberta": Entry("roberta", _encoder(ENCODERS["roberta"])),
    "distilbert": Entry("distilbert", _encoder(ENCODERS["distilbert"])),
    "modernbert": Entry("modernbert", _encoder(ENCODERS["modernbert"])),
}

# feature -> its column in the README; test_conformance has one test per feature,
# test_<feature with _ for ->
FEATURES = {
    "transformers": "equals transformers",
    "hooks": "hooks",
    "scores": "score methods",
    "gate-equals-prune": "gated = pruned",
    "kv-groups": "kv-group pruning",
    "demotion": "demotion",
    "lsq": "lsq (+ MLP)",
    "bias": "bias",
    "rescale": "rescale",
    "attribution": "logit attribution",
    "patching": "patching",
    "detectors": "detectors",
    "save-load": "save / load",
    "sharded": "sharded save / load",
    "export-hf": "`--export hf`",
    "generation": "generate",
}
# what no encoder has, a fact of attending both ways, so no family declares it
_NOT_CAUSAL = {
    "kv-groups": "an encoder attends both ways and keeps no key/value cache to shrink",
    "demotion": "demotion keeps a causal model's first and last positions; an encoder "
                "attends both ways",
    "generation": "an encoder does not generate",
}


@functools.cache
def family_classes() -> dict[str, type]:
    """Every headlab family -> its model class (every model module imported); the
    shared decoder, which only its families build, is none."""
    import headlab.models as package
    from headlab.models.base import HeadModel

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    found: dict[str, list[type]] = {}
    todo = [HeadModel]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        family = cls.__dict__.get("family")
        if family not in (None, "", "decoder"):
            found.setdefault(family, []).append(cls)
    assert all(len(c) == 1 for c in found.values()), found
    return {family: classes[0] for family, classes in found.items()}


def model_class(family: str):
    """The headlab model class of ``family``."""
    return family_classes()[family]


def export_gap(cls) -> str | None:
    """Why the family has no HF export of a pruned model, from its declaration (a model
    may add reasons of its own, e.g. a W_O bias that recovery gave it)."""
    reason = inspect.getattr_static(cls, "hf_export_unsupported")
    if isinstance(reason, property):  # decided per model: the family's part of it
        reason = getattr(cls, "_hf_export_unsupported", None)
    return reason


def gaps(matrix_id: str) -> dict[str, str]:
    """The features that do not apply to a matrix family -> why: from its kind (an
    encoder) and from its class's ``not_applicable`` declaration."""
    cls = model_class(MATRIX[matrix_id].family)
    declared = dict(cls.not_applicable)
    unknown = sorted(set(declared) - set(FEATURES))
    assert not unknown, f"{cls.__name__}.not_applicable names no feature: {unknown}"
    return {**({} if cls.causal else _NOT_CAUSAL), **declared}


MARKERS = ("<!-- capabilities:start -->", "<!-- capabilities:end -->")


def capability_table() -> str:
    """The README's capability table: a row per family, a column per feature, "yes" or
    "no (n)" with the numbered reasons below; `--export hf` "refused (n)" where the
    family's HF config cannot hold a pruned layer."""
    notes: list[str] = []

    def note(reason: str) -> int:
        if reason not in notes:
            notes.append(reason)
        return notes.index(reason) + 1

    header = ["family", "class", *FEATURES.values()]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for matrix_id, entry in MATRIX.items():
        cls = model_class(entry.family)
        missing = gaps(matrix_id)
        cells = []
        for feature in FEATURES:
            if feature in missing:
                cells.append(f"no ({note(missing[feature])})")
            elif feature == "export-hf" and export_gap(cls):
                cells.append(f"refused ({note(export_gap(cls))})")
            else:
                cells.append("yes")
        rows.append(f"| `{matrix_id}` | `{cls.__name__}` | " + " | ".join(cells) + " |")
    listed = [f"{i}. {reason}" for i, reason in enumerate(notes, 1)]
    return "\n".join([MARKERS[0], *rows, "", *listed, MARKERS[1]])


def readme_table(readme: str) -> str:
    """The capability table between the README's markers, markers included."""
    start, end = (readme.index(m) for m in MARKERS)
    return readme[start:end + len(MARKERS[1])]
