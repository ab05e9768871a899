"""DuoAttention's gates (Xiao et al. 2024): which key/value heads can do with a sink +
window cache, learned.

One gate alpha in [0, 1] per key/value head (GQA group) of every layer mixes, for each
query head h of its group g, the head's output under full attention with its output
when the group reads only the first ``sinks`` and the last ``window`` positions (a
demoted head's, `headlab.attention.streaming`):

    z_h = alpha_g z_h^full + (1 - alpha_g) z_h^stream.

Every model weight stays frozen. The alphas start at 1 and train with AdamW on synthetic
passkey-retrieval prompts (`passkey_prompt`: "The pass key is 71432. Remember it." at a
random depth of filler taken from the calibration blocks, then the question and the
answer) to minimise DuoAttention's distillation loss, the squared distance between the
final hidden states of the gated model and of the model as it came at the positions that
predict the answer, plus ``reg`` times the mean alpha (their L1 penalty); after each
step the alphas are clamped to [0, 1], as in their code. The groups whose alpha ends
lowest are the ones to demote.

Both outputs come from the layer's own forward, the streaming one with every group of
the layer demoted. W_O is affine, so the mix is the sum of the layer's outputs with its
head gates at alpha and at 1 - alpha, less W_O's bias once:
W_O (a z_f + (1 - a) z_s) + b = (W_O a z_f + b) + (W_O (1 - a) z_s + b) - b.

Shape notation: H query heads, H_kv key/value heads of a layer, U key/value heads of
all layers, S prompt length, A answer positions, E model dim.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch

from headlab._util.checkpoint import Checkpoint
from headlab.attention.streaming import Streaming
from headlab.data.blocks import Blocks
from headlab.errors import UserError
from headlab.importance.gates import (
    DEFAULT_LR,
    DEFAULT_STEPS,
    check_options,
    frozen,
    mean_over_ranks,
    run_steps,
)
from headlab.importance.scores import HeadScores, to_original
from headlab.models.base import HeadModel
from headlab.objectives import objective_for
from headlab.parallel import distributed

DEFAULT_REG = 0.05  # DuoAttention's weight of the L1 penalty (reg_weight)
CONTEXT_SPANS = 4  # a prompt spans 4 x (sinks + window) positions, the model's limit at most
MIN_FILLER = 8  # tokens of filler a prompt needs at least
_FACT = " The pass key is {value}. Remember it. {value} is the pass key."
_QUESTION = "\nWhat is the pass key? The pass key is"


def check_reg(reg: float) -> None:
    if not reg >= 0 or not math.isfinite(reg):
        raise UserError(f"--gate-reg must be a finite weight >= 0 on the gates' L1 "
                        f"penalty, got {reg}")


def context_length(model: HeadModel, sinks: int, window: int) -> int:
    """The prompts' length: ``CONTEXT_SPANS`` times what a demoted head reads, so that
    the fact lies beyond the window mostly, within the model's positions."""
    return min(model.max_positions, CONTEXT_SPANS * (sinks + window))


def passkey_prompt(stream: torch.Tensor, tokenizer, *, length: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, slice]:
    """A prompt of ``length`` tokens (S,) and the positions that predict its answer:
    filler from ``stream`` (calibration tokens, read from a random offset, wrapping)
    with the fact of a random 5-digit pass key at a random depth, then the question and
    the answer."""
    value = str(int(torch.randint(10_000, 100_000, (1,), generator=generator)))

    def enc(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"],
                            dtype=torch.long)

    fact, question, answer = enc(_FACT.format(value=value)), enc(_QUESTION), enc(f" {value}")
    n = length - len(fact) - len(question) - len(answer)
    if n < MIN_FILLER:
        raise UserError(f"passkey prompts of {length} tokens (4 x (sinks + window), within "
                        f"the model's positions) leave {max(n, 0)} tokens of filler beside "
                        f"the fact, question and answer; give --window W so that "
                        f"4 x (sinks + W) is at least {length - n + MIN_FILLER}")
    offset = int(torch.randint(len(stream), (1,), generator=generator))
    depth = int(torch.randint(n + 1, (1,), generator=generator))
    filler = stream[(offset + torch.arange(n)) % len(stream)]
    ids = torch.cat([filler[:depth], fact, filler[depth:], question, answer])  # (S,)
    return ids, slice(length - len(answer) - 1, length - 1)


@contextmanager
def mixed(model: HeadModel, alpha: torch.Tensor, *, sinks: int, window: int
          ) -> Iterator[None]:
    """Within: each query head of ``model`` outputs alpha times its full-attention output
    plus 1 - alpha times its sink + window output, ``alpha`` (U,) one per key/value head,
    layer after layer in the order of their key/value heads present. For whole sequences
    (no cache, no attention weights), on a model without demoted heads."""
    handles, offset = [], 0
    try:
        for a in model.attentions:
            if a.streaming is not None:
                raise UserError("gates mix full and sink + window attention of a model "
                                "without demoted heads: train them on the model as it came")
            g = alpha[offset:offset + a.n_kv_heads]  # (H_kv,)
            offset += a.n_kv_heads
            every = Streaming(tuple(a.kv_head_ids.tolist()), sinks, window)
            handles.append(a.register_forward_pre_hook(partial(_full, alpha=g),
                                                       with_kwargs=True))
            handles.append(a.register_forward_hook(partial(_add_streaming, alpha=g,
                                                           streaming=every), with_kwargs=True))
        if offset != alpha.numel():
            raise ValueError(f"{alpha.numel()} gates for {offset} key/value heads")
        yield
    finally:
        for h in handles:
            h.remove()
        for a in model.attentions:
            a.gate_override = None


def _full(module, args, kwargs, *, alpha: torch.Tensor) -> None:
    """Before the layer's forward: its head gates (H,) at alpha of their group."""
    module.gate_override = module.head_gate * alpha.to(module.head_gate)[module.kv_index]


def _add_streaming(module, args, kwargs, out, *, alpha: torch.Tensor, streaming: Streaming):
    """After it: add the layer's output with every group demoted and the gates at
    1 - alpha, less W_O's bias, counted in both."""
    if kwargs.get("cache") is not None or isinstance(out, tuple):
        raise ValueError("the gated mix is computed on whole sequences, without a cache "
                         "or attention weights")
    module.streaming = streaming
    module.gate_override = module.head_gate * (1 - alpha.to(module.head_gate))[module.kv_index]
    try:
        streamed = module.forward(*args, **kwargs)  # (B, S, E)
    finally:
        module.streaming, module.gate_override = None, None
    bias = module.o_proj.bias
    return out + streamed if bias is None else out + streamed - bias


def streaming_gates(model: HeadModel, blocks: Blocks, *, sinks: int = 4, window: int = 256,
                    steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR,
                    reg: float = DEFAULT_REG, seed: int = 0,
                    checkpoint: Checkpoint | None = None, key: str = "streaming-gates"
                    ) -> HeadScores:
    """Train DuoAttention's gates of ``model`` on passkey prompts whose filler is the
    tokens of ``blocks`` (the calibration split), one prompt per step, and score each
    query head by its group's alpha (NaN where absent or masked): select the groups to
    keep with `headlab.selection.select_groups` (``group_score="max"``), and the rest
    are the ones to demote.

    ``extra`` holds ``alphas`` (per layer, one per key/value head present), the final
    ``loss`` and ``mean_alpha``, and the settings. Under torchrun data parallel each
    rank draws its own prompts and the gradients are averaged. Seeded: the prompt of
    step i depends on ``seed`` and i only, so a resumed run (``checkpoint``) continues
    exactly.
    """
    check_options(steps, lr)
    check_reg(reg)
    if not objective_for(model).generates or model.tokenizer is None:
        raise UserError("streaming gates train on passkey prompts that a causal language "
                        f"model with a tokenizer answers; got a {model.kind} model")
    stream = blocks.input_ids[blocks.attention_mask.bool()]  # the calibration tokens
    if stream.numel() == 0:
        raise UserError("streaming gates need calibration tokens for the prompts' filler; "
                        "the blocks hold none")
    length = context_length(model, sinks, window)
    n_units = sum(a.n_kv_heads for a in model.attentions)
    alpha = torch.ones(n_units, requires_grad=True)  # (U,), every head full at first
    opt = torch.optim.AdamW([alpha], lr=lr, weight_decay=0.0)
    start = 0
    saved = checkpoint.get(key) if checkpoint is not None else None
    if saved is not None:
        start = saved["step"]
        with torch.no_grad():
            alpha.copy_(saved["alpha"])
        opt.load_state_dict(saved["opt"])
    status = {"loss": math.nan}

    def save(done: int) -> None:
        checkpoint.put(key, {"step": done, "alpha": alpha.detach().clone(),
                             "opt": opt.state_dict()})

    def train_step(step: int) -> None:
        gen = distributed.step_generator(seed, step)
        ids, rows = passkey_prompt(stream, model.tokenizer, length=length, generator=gen)
        ids = ids[None].to(model.device)  # (1, S)
        with torch.no_grad():  # the model as it came
            want = model(ids).last_hidden_state[:, rows].float()  # (1, A, E)
        with mixed(model, alpha, sinks=sinks, window=window):
            got = model(ids).last_hidden_state[:, rows].float()
        distill = (got - want).pow(2).mean(-1).mean()
        loss = distill + reg * alpha.abs().mean()
        opt.zero_grad()
        loss.backward()
        if not torch.isfinite(loss):
            raise FloatingPointError("non-finite loss while training streaming gates; see "
                                     "--dtype float32")
        alpha.grad = mean_over_ranks(alpha.grad)
        opt.step()
        with torch.no_grad():
            alpha.clamp_(0.0, 1.0)
        status["loss"] = float(distill.detach())

    with frozen(model):
        run_steps(steps, start, train_step, description="training streaming gates",
                  status=lambda: f"loss {status['loss']:.4g} mean alpha "
                                 f"{float(alpha.detach().mean()):.3f}",
                  checkpoint=checkpoint, save=save)
    values = alpha.detach().double()
    per_layer, offset = [], 0
    for a in model.attentions:
        per_layer.append(values[offset:offset + a.n_kv_heads])  # (H_kv,)
        offset += a.n_kv_heads
    raw = [g[a.kv_index.cpu()] for a, g in zip(model.attentions, per_layer, strict=True)]
    extra = {"alphas": [g.tolist() for g in per_layer], "loss": status["loss"],
             "mean_alpha": float(values.mean()), "steps": steps, "lr": lr, "reg": reg,
             "sinks": sinks, "window": window, "context": length}
    return HeadScores(to_original(model, raw).tolist(), "streaming-gates", data=blocks.spec,
                      n_tokens=steps * length, extra=extra)
