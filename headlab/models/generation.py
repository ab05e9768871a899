"""Text generation for any causal-lm HeadModel, with a key/value cache.

The prompt is run once (prefill); each new token then costs one forward of a single
position over the cached keys and values. Left-padded batches work: positions are
counted from each row's first real token, as transformers' ``generate`` does.
Logits are processed in transformers' order: temperature, then top-k, then top-p.

Decode steps multiply a few rows by every weight, at the speed the weights stream from
memory. On the CPU, with ``decode_kernel=True`` (the default), the model's ``nn.Linear``
layers run those steps on headlab's C kernel (`headlab.models.kernels`), which streams each
weight on every thread where torch's product uses one. The switch is local to the decode
loop of one `generate` call (`_kernel_products`) and always undone; the prefill and every
other forward use torch's products. Outputs agree with torch's within float32 rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from headlab.errors import UserError
from headlab.models import kernels

__all__ = ["generate"]

# decode steps of at most this many rows (batch size) take the kernel: it keeps one weight
# tile in L1 while it visits every row, and torch's own products use every thread for more
KERNEL_MAX_ROWS = 16


@torch.no_grad()
def generate(
    model: nn.Module,  # a causal LM (models.base.DecoderLM, which calls here)
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int = 32,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    decode_kernel: bool = True,
) -> torch.Tensor:
    """Continue ``input_ids`` (B, S); return (B, S + n) with n <= ``max_new_tokens``.

    Greedy unless ``do_sample`` (then ``temperature``, ``top_k``, ``top_p`` and
    ``generator`` apply). ``attention_mask`` (B, S), 1 = real token, must pad on the
    left. A row stops at its first token in ``eos_token_id`` (default: the model
    config's ``eos_token_id``; pass ``()`` to never stop early) and is filled with
    ``pad_token_id`` (default: the config's, else the first EOS id) afterwards;
    generation ends when every row has stopped.

    ``decode_kernel``: run the decode steps' linear layers on headlab's C kernel where it
    applies (CPU, float32, at most 16 rows, kernel built); ``False`` keeps every product
    torch's (see the module docstring).
    """
    if not callable(getattr(model, "generate", None)):  # only causal LMs have the method
        raise UserError("generate needs a causal language model, got kind "
                        f"{getattr(model, 'kind', type(model).__name__)!r}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (B, S) with S >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    _check_sampling(temperature, top_k, top_p)
    B, S = input_ids.shape
    limit = model.max_positions
    if S + max_new_tokens > limit:
        raise ValueError(
            f"{S} prompt tokens + {max_new_tokens} new ones exceed the model's {limit} "
            "positions; shorten the prompt or ask for fewer tokens"
        )
    if max_new_tokens == 0:
        return input_ids.clone()

    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones(B, S, dtype=torch.long, device=device)
    elif attention_mask.shape != (B, S):
        raise ValueError(
            f"attention_mask must match input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    elif not bool(attention_mask[:, -1].bool().all()):
        raise ValueError(
            "attention_mask pads on the right: the next token would follow a pad. "
            "Pad prompts on the left (tokenizer.padding_side = 'left')"
        )
    eos = _eos_ids(model, eos_token_id, device)
    if pad_token_id is None:
        pad_token_id = getattr(model.config, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = int(eos[0]) if eos.numel() else 0

    # positions count real tokens only, so a left-padded row matches its unpadded self
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, S)
    # without padding no mask is needed: the models then skip building one each step
    padded = not bool(attention_mask.bool().all())
    cache = model.new_cache()
    logits = model(
        input_ids, attention_mask if padded else None, cache=cache, position_ids=position_ids
    ).logits

    finished = torch.zeros(B, dtype=torch.bool, device=device)
    new: list[torch.Tensor] = []
    kernel = decode_kernel and device.type == "cpu" and B <= KERNEL_MAX_ROWS
    with _kernel_products(model) if kernel else contextlib.nullcontext():
        for step in range(max_new_tokens):
            token = _next_token(  # (B,)
                logits[:, -1], do_sample, temperature, top_k, top_p, generator
            )
            token = token.masked_fill(finished, pad_token_id)
            new.append(token)
            finished = finished | torch.isin(token, eos)
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            if padded:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)],
                                           dim=1)
            position_ids = position_ids[:, -1:] + 1  # (B, 1)
            logits = model(
                token[:, None], attention_mask if padded else None, cache=cache,
                position_ids=position_ids,
            ).logits
    return torch.cat([input_ids, torch.stack(new, dim=1).to(input_ids.dtype)], dim=1)


@contextlib.contextmanager
def _kernel_products(model: nn.Module) -> Iterator[None]:
    """Inside this block, each ``nn.Linear`` of ``model`` with a float32, row-major CPU
    weight computes its product with `headlab.models.kernels.linear_rows`; on exit every layer
    is its plain self again, whatever happened inside. Nothing changes where the kernel
    is not built."""
    if not kernels.available():
        yield
        return
    switched = []
    try:
        for mod in model.modules():
            if (type(mod) is nn.Linear and "forward" not in mod.__dict__
                    and kernels.fits(mod.weight, mod.bias)):
                mod.forward = _KernelForward(mod)  # an instance attribute, deleted below
                switched.append(mod)
        yield
    finally:
        for mod in switched:
            del mod.forward


class _KernelForward:
    """``linear.forward`` on the decoding kernel, torch's F.linear where it declines."""

    __slots__ = ("linear",)

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        y = kernels.linear_rows(x, lin.weight, lin.bias)
        return F.linear(x, lin.weight, lin.bias) if y is None else y


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature}; for greedy use do_sample=False"
        )
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or None), got {top_p}")


def _eos_ids(model, eos_token_id, device) -> torch.Tensor:
    if eos_token_id is None:
        eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        ids: list[int] = []
    elif isinstance(eos_token_id, int):
        ids = [eos_token_id]
    else:
        ids = [int(i) for i in eos_token_id]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _next_token(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Pick one token per row from logits (B, V)."""
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        # (as transformers' TopPLogitsWarper);
        # the most likely token always stays
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
