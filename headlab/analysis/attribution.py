"""Direct logit attribution per head: how much each head's output, read straight off the
residual stream, pushes the logit of a target token over a foil's.

A pre-norm decoder's last residual is a sum: the embeddings, every head's output
z_h W_O[h] and W_O's bias per layer, every MLP's output. The final norm is linear in
that sum once its scale is frozen at the value it has on the actual residual
(1/sqrt(mean(x^2) + eps) for RMSNorm; for LayerNorm the mean is subtracted and
1/sqrt(var(x) + eps) taken), so

    logit(target) - logit(foil) = sum over parts c of  (w * P c / s) . (u_target - u_foil)
                                  + b . (u_target - u_foil)

with w, b the norm's weight and bias (Gemma's RMSNorm: 1 + w), P the centering
(LayerNorm) or the identity (RMSNorm), s the frozen scale and u the unembedding rows.
Heads are attributed their direct path only: what they do through later layers counts
to those layers' parts. A block that norms its attention output before adding it
(Gemma, OLMo-2) has that norm frozen the same way at the attention output, each head's
part carried through it; with a parallel residual (GPT-NeoX) the MLP's part is the
block's sum less its attention's. The logits attributed are ``lm_head``'s: where the
model soft-caps them after (Gemma-2's tanh(l / c) * c, monotone), the parts sum to
the difference before the cap, as in TransformerLens, and ``extra["output_logit_diff"]``
holds the model's own difference after it.

A post-norm masked LM (BERT) normalises the residual after every sublayer, and its MLM
head is dense, activation, LayerNorm, then the tied embeddings. Each part is carried
through every later LayerNorm with that norm's scale frozen, through the dense layer,
through the activation with its gate act(a)/a frozen at the actual pre-activation a
(exact for GELU's a * Phi(a) with Phi frozen), and through the last LayerNorm; each
norm's bias and the dense layer's bias join the rest. The sum stays exact.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from headlab._util.html import head_map, signed_colour
from headlab.attention.hooks import capture
from headlab.data.tokens import token_id
from headlab.errors import UserError
from headlab.importance import HeadScores
from headlab.models.base import DecoderLM, HeadModel
from headlab.models.bert import Bert
from headlab.models.layers import RMSNorm
from headlab.objectives import objective_for

__all__ = ["LogitAttribution", "logit_attribution"]


@dataclass
class LogitAttribution:
    """Per-head direct contributions to logit(target) - logit(foil) at one position.

    ``heads[layer][head]`` by original head index (NaN: pruned); ``rest`` holds every
    other part by name (``embeddings``, ``mlp.{i}``, ``attn_bias.{i}``, ``norm_bias``,
    ``unembed_bias``); ``logit_diff`` is the model's own difference (before any final
    soft-capping, see the module docstring), which the parts sum to. ``norm_scale`` is
    the frozen 1/s of the final norm.
    """

    heads: list[list[float]]
    rest: dict[str, float]
    logit_diff: float
    target: str
    foil: str
    position: int
    norm_scale: float
    text: str = ""
    extra: dict = field(default_factory=dict)

    def total(self) -> float:
        """The sum of every part: equals ``logit_diff`` up to rounding."""
        heads = sum(v for row in self.heads for v in row if not math.isnan(v))
        return heads + sum(self.rest.values())

    def top(self, k: int = 10) -> list[tuple[int, int, float]]:
        """The ``k`` heads of largest |contribution| as (layer, head, contribution)."""
        flat = [(layer, head, v) for layer, row in enumerate(self.heads)
                for head, v in enumerate(row) if not math.isnan(v)]
        return sorted(flat, key=lambda x: -abs(x[2]))[:k]

    def as_scores(self) -> HeadScores:
        return HeadScores(self.heads, "logit-attribution", self.text, 1, None,
                          {"target": self.target, "foil": self.foil})

    def _repr_html_(self) -> str:
        """A layers x heads map, red pushes toward the target, blue toward the foil."""
        bound = max((abs(v) for _, _, v in self.top(1)), default=1.0) or 1.0
        return head_map(
            self.heads, lambda layer, head, v: (signed_colour(v, bound),
                                                f"L{layer} H{head}: {v:+.4g}", f"{v:+.2g}"),
            caption=f"<b>direct logit attribution</b>: logit({html.escape(self.target)}) - "
                    f"logit({html.escape(self.foil)}) = {self.logit_diff:.4g} at position "
                    f"{self.position}; heads sum to "
                    f"{self.total() - sum(self.rest.values()):.4g}")


@torch.no_grad()
def logit_attribution(model: HeadModel, text: str | torch.Tensor, *, target: str | int,
                      foil: str | int, position: int | None = None) -> LogitAttribution:
    """Each head's direct contribution to logit(target) - logit(foil) at ``position`` of
    ``text`` (a string, or input ids (1, S)); see the module docstring. By default the
    position is the one the model's objective reads (`Objective.logit_position`): the
    last for decoders, the first [MASK] token for masked LMs."""
    tok = model.tokenizer
    if isinstance(text, str):
        ids = torch.tensor([tok(text)["input_ids"]])
    else:
        ids, text = text, ""
    ids = ids.to(model.device)
    default = objective_for(model).logit_position(ids, tok)  # refuses models without logits
    position = default if position is None else position
    t_id, t_name = token_id(tok, target)
    f_id, f_name = token_id(tok, foil)
    if isinstance(model, DecoderLM):
        return _decoder(model, ids, t_id, t_name, f_id, f_name, position, text)
    if isinstance(model, Bert):
        return _masked_lm(model, ids, t_id, t_name, f_id, f_name, position, text)
    raise UserError(f"direct logit attribution reads a decoder's residual stream or BERT's "
                    f"post-norm blocks and MLM head; {model.family} ({model.kind}) has neither")


@torch.no_grad()
def _decoder(model, ids, t_id, t_name, f_id, f_name, position, text) -> LogitAttribution:
    """The pre-norm walk of the module docstring: the last residual as a sum of parts,
    read through the frozen final norm and the unembedding."""
    with capture(model, ["z", "out", "resid_pre", "resid_post"]) as cap:
        out = model(ids)
    pos = position % ids.shape[1]
    hidden = out.last_hidden_state[0, pos]  # (E,) after the final norm
    logits = model.lm_head(hidden[None])[0].double()  # (V,) before any soft-capping
    capped = out.logits[0, pos].double()
    unembed = model.lm_head.weight.double()
    direction = unembed[t_id] - unembed[f_id]  # (E,)
    last = cap[f"blocks.{model.n_layers - 1}.resid_post"][0, pos].double()  # (E,)
    read, bias, scale = _frozen_norm(model.final_norm, last)

    def through(x: torch.Tensor) -> torch.Tensor:  # parts of the residual (..., E) -> (...)
        return read(x) @ direction

    rest = {"embeddings": float(through(cap["blocks.0.resid_pre"][0, pos].double()))}
    heads = [[math.nan] * model.n_original_heads for _ in range(model.n_layers)]
    for i, (block, attn) in enumerate(zip(model.blocks, model.attentions, strict=True)):
        z = cap[f"blocks.{i}.attn.z"][0, pos].double()  # (H, D)
        w_o = attn.o_proj.weight.double().view(attn.d_model, attn.n_heads, attn.head_dim)
        per_head = torch.einsum("hd,ehd->he", z, w_o)  # (H, E)
        attn_out = cap[f"blocks.{i}.attn.out"][0, pos].double()  # (E,)
        own_bias = attn_out - per_head.sum(0)  # W_O's bias (and rounding)
        added = attn_out  # what the attention sublayer adds to the residual stream
        # the shared decoder's norm on the attention output (Gemma, OLMo-2), frozen
        post = getattr(block, "attn_post_norm", None)
        if post is not None:
            read_post, bias_post, _ = _frozen_norm(post, attn_out)
            per_head, own_bias = read_post(per_head), read_post(own_bias) + bias_post
            added = post(cap[f"blocks.{i}.attn.out"][0, pos][None])[0].double()
        for p, h in enumerate(cap.head_ids[f"blocks.{i}.attn.z"]):
            heads[i][h] = float(through(per_head[p]))
        rest[f"attn_bias.{i}"] = float(through(own_bias))
        # the rest of the block's sum: its MLP, beside or after the attention
        mlp_out = (cap[f"blocks.{i}.resid_post"] - cap[f"blocks.{i}.resid_pre"])[0, pos]
        rest[f"mlp.{i}"] = float(through(mlp_out.double() - added))
    rest["norm_bias"] = float(bias @ direction)
    lm_bias = model.lm_head.bias
    rest["unembed_bias"] = 0.0 if lm_bias is None else float(lm_bias[t_id] - lm_bias[f_id])
    return LogitAttribution(heads, rest, float(logits[t_id] - logits[f_id]), t_name, f_name,
                            pos, scale, text,
                            {"output_logit_diff": float(capped[t_id] - capped[f_id])})


def _frozen_norm(norm: nn.Module, x: torch.Tensor):
    """``norm`` as a linear map with its scale frozen at its input ``x`` (E,):
    (read, bias, 1/s), read(c) = w * P c / s on parts c (..., E)."""
    eps = float(norm.eps)
    if isinstance(norm, nn.LayerNorm):
        weight = norm.weight.double()
        inv = float(1.0 / torch.sqrt(x.var(unbiased=False) + eps))
        bias = norm.bias.double() if norm.bias is not None else torch.zeros_like(weight)
        return (lambda c: weight * (c - c.mean(-1, keepdim=True)) * inv), bias, inv
    if isinstance(norm, RMSNorm):  # w * x / rms(x); Gemma's gain is 1 + w
        weight = norm.gain().double()
    else:
        raise UserError(f"direct logit attribution freezes LayerNorm and RMSNorm; this "
                        f"model's norm is a {type(norm).__name__}")
    inv = float(1.0 / torch.sqrt(x.pow(2).mean() + eps))
    return (lambda c: weight * c * inv), torch.zeros_like(weight), inv


def _frozen_layer_norm(ln: nn.LayerNorm, x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """``parts`` (N, E) through ``ln`` with its scale frozen at input ``x`` (E,)."""
    inv = 1.0 / torch.sqrt(x.double().var(unbiased=False) + ln.eps)
    return ln.weight.double() * (parts - parts.mean(-1, keepdim=True)) * inv


@torch.no_grad()
def _masked_lm(model, ids, t_id, t_name, f_id, f_name, position, text) -> LogitAttribution:
    """The post-norm walk of the module docstring, one part per row of ``parts``."""
    with capture(model, ["z", "out", "resid_pre", "resid_mid", "resid_post"]) as cap:
        logits = model(ids).logits[0, position].double()  # (V,)
    pos = position % ids.shape[1]
    names = ["embeddings"]
    parts = cap["blocks.0.resid_pre"][0, pos].double()[None]  # (N, E)

    def add(name: str, vector: torch.Tensor) -> None:
        nonlocal parts
        names.append(name)
        parts = torch.cat([parts, vector.double()[None]])

    def through(ln: nn.LayerNorm, x: torch.Tensor) -> None:
        nonlocal parts
        parts = _frozen_layer_norm(ln, x, parts)
        add("norm_bias", ln.bias.double())

    for i, block in enumerate(model.blocks):
        attn = block.attn
        z = cap[f"blocks.{i}.attn.z"][0, pos].double()  # (H, D)
        w_o = attn.o_proj.weight.double().view(attn.d_model, attn.n_heads, attn.head_dim)
        for p, h in enumerate(cap.head_ids[f"blocks.{i}.attn.z"]):
            add(f"head.{i}.{h}", torch.einsum("d,ed->e", z[p], w_o[:, p]))
        attn_out = cap[f"blocks.{i}.attn.out"][0, pos].double()
        heads_sum = parts[-attn.n_heads:].sum(0) if attn.n_heads else 0.0
        add(f"attn_bias.{i}", attn_out - heads_sum)
        through(block.ln_1, cap[f"blocks.{i}.resid_pre"][0, pos] + attn_out)
        mid = cap[f"blocks.{i}.resid_mid"][0, pos]
        mlp_out = block.mlp(mid[None])[0]
        add(f"mlp.{i}", mlp_out)
        through(block.ln_2, mid + mlp_out)
    head = model.mlm
    h = cap[f"blocks.{model.n_layers - 1}.resid_post"][0, pos].double()
    pre = head.dense(h[None].to(head.dense.weight.dtype))[0].double()  # (E,)
    parts = parts @ head.dense.weight.double().T
    add("unembed_bias", head.dense.bias.double())
    act = head.act(pre)
    gate = torch.where(pre.abs() > 1e-12, act / torch.where(pre == 0, 1.0, pre), 0.5)
    parts = parts * gate
    through(head.ln, act)
    direction = model.wte.weight.double()[t_id] - model.wte.weight.double()[f_id]
    values = (parts @ direction).tolist()
    heads = [[math.nan] * model.n_original_heads for _ in range(model.n_layers)]
    rest: dict[str, float] = {}
    for name, v in zip(names, values, strict=True):
        if name.startswith("head."):
            _, layer, h = name.split(".")
            heads[int(layer)][int(h)] = v
        else:
            rest[name] = rest.get(name, 0.0) + v
    bias = head.bias.double()
    rest["unembed_bias"] += float(bias[t_id] - bias[f_id])
    scale = float(1.0 / torch.sqrt(act.var(unbiased=False) + head.ln.eps))
    return LogitAttribution(heads, rest, float(logits[t_id] - logits[f_id]), t_name, f_name,
                            pos, scale, text)
