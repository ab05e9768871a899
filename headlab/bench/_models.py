"""The models the benchmarks run, and the cache that builds each once per run.

Random models are built by transformers in memory (seeded), written with
``save_pretrained`` and read back with ``headlab.load``, so both sides hold the same
weights. A bundled model is loaded with ``headlab.load`` (which keeps its own converted
copy of a GGUF file, see `headlab.models.loading`) and handed to transformers through
headlab's Hugging Face export, so again both sides hold the same weights.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

__all__ = ["BERT_BASE", "GPT2_SMALL", "SMOLLM2", "TINY_BERT", "TINY_GPT2", "TINY_LLAMA",
           "ModelCache", "ModelSpec", "model_cache", "random_ids"]


@dataclass(frozen=True)
class ModelSpec:
    """A model to benchmark: random weights from an HF config (``hf_config``), or a
    bundled real model (``bundled``)."""

    name: str
    family: str  # "gpt2" | "bert" | "llama"
    hf_config: Mapping[str, Any] | None = None
    bundled: str | None = None

    def __str__(self) -> str:
        return self.name


GPT2_SMALL = ModelSpec("gpt2-small-random", "gpt2",
                       {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257,
                        "n_positions": 1024})
BERT_BASE = ModelSpec("bert-base-random", "bert",
                      {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768,
                       "intermediate_size": 3072, "vocab_size": 30522})
SMOLLM2 = ModelSpec("smollm2-135m", "llama", bundled="smollm2-135m")
TINY_GPT2 = ModelSpec("gpt2-tiny-random", "gpt2",
                      {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256,
                       "n_positions": 128, "bos_token_id": 0, "eos_token_id": 0})
TINY_BERT = ModelSpec("bert-tiny-random", "bert",
                      {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                       "intermediate_size": 128, "vocab_size": 256,
                       "max_position_embeddings": 128})
TINY_LLAMA = ModelSpec("llama-tiny-random", "llama",
                       {"num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128,
                        "vocab_size": 256, "max_position_embeddings": 256,
                        "tie_word_embeddings": True})

_HF_CLASSES = {  # family -> (config class, auto class): GPT2LMHeadModel, BertModel, ...
    "gpt2": ("GPT2Config", "AutoModelForCausalLM"),
    "bert": ("BertConfig", "AutoModel"),
    "llama": ("LlamaConfig", "AutoModelForCausalLM"),
}


class ModelCache:
    """Models built once per run and shared by the benchmarks that use them."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._pairs: dict[str, tuple[Any, nn.Module, str]] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="headlab-bench-")

    def pair(self, spec: ModelSpec) -> tuple[Any, nn.Module, str]:
        """(headlab model, transformers model, where the weights came from), both in eval."""
        if spec.name not in self._pairs:
            with _quiet_transformers():
                self._pairs[spec.name] = self._build(spec)
        return self._pairs[spec.name]

    def headlab(self, spec: ModelSpec):
        return self.pair(spec)[0]

    def close(self) -> None:
        self._pairs.clear()
        self._tmp.cleanup()

    def _build(self, spec: ModelSpec):
        import transformers

        import headlab

        t0 = time.perf_counter()
        path = Path(self._tmp.name) / spec.name
        if spec.bundled is not None:
            from headlab.models.export import export_hf

            model = headlab.load(spec.bundled)  # its tokenizer: the long-context text
            export_hf(model, path)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.float32, attn_implementation="sdpa")
            source = (f"{spec.bundled} as headlab.load reads it (float32), handed to "
                      "transformers through headlab's Hugging Face export")
        else:
            config_cls, auto_cls = _HF_CLASSES[spec.family]
            torch.manual_seed(0)
            config = getattr(transformers, config_cls)(**spec.hf_config)
            hf = getattr(transformers, auto_cls).from_config(config, attn_implementation="sdpa")
            hf.save_pretrained(path)
            model = headlab.load(path, tokenizer=False)
            source = "random weights (seed 0) saved by transformers' save_pretrained"
        model = model.to(self.device)
        hf = hf.to(self.device).eval()
        log.info("  %s ready in %.1f s (%s)", spec.name, time.perf_counter() - t0, source)
        return model, hf, source


@contextlib.contextmanager
def model_cache(models: ModelCache | None, device: str) -> Iterator[ModelCache]:
    """The cache a benchmark builds its models in: ``models`` when the caller shares one
    (`run_benchmarks` does, and closes it after every benchmark has run), else a cache of
    the benchmark's own, closed when the benchmark ends, even on error."""
    if models is not None:
        yield models
        return
    cache = ModelCache(device)
    try:
        yield cache
    finally:
        cache.close()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' progress bars off while models are built, as they were after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def random_ids(vocab: int, batch: int, seq: int, device: str, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids (batch, seq) on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
