"""Quality metrics per kind of model, and the per-example losses importance scoring uses.

    causal-lm   mean token loss (nats) and perplexity
    masked-lm   masked-LM loss with a fixed-seed masking, and its perplexity
    classifier  accuracy (and cross-entropy loss) against labels
    embedding   fidelity: mean cosine between the model's sentence embeddings and the
                unpruned model's (``1 - cosine`` is the loss)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from headlab import distributed
from headlab._progress import track
from headlab.data import Blocks
from headlab.models.base import HeadModel

METRICS = {
    "causal-lm": ("perplexity", False),
    "masked-lm": ("mlm-perplexity", False),
    "classifier": ("accuracy", True),
    "embedding": ("fidelity", True),
}


@dataclass
class Quality:
    """One measurement of a model on held-out blocks."""

    metric: str
    value: float
    loss: float
    n_tokens: int
    higher_is_better: bool

    def to_json(self) -> dict:
        return asdict(self)

    def _repr_html_(self) -> str:
        return (f"<b>{self.metric}</b> {self.value:.4g} (loss {self.loss:.4f}, "
                f"{self.n_tokens} tokens)")


def prepare(model: HeadModel, blocks: Blocks, *, batch_size: int = 8, seed: int = 0) -> Blocks:
    """Add what the model's metric needs and that must not change across a run:
    the fixed masking for masked-LM, the unpruned reference embeddings for encoders.
    Call it on the unpruned model."""
    if model.kind == "masked-lm" and (blocks.labels is None or blocks.labels.dim() != 2):
        return mask_tokens(blocks, model.tokenizer, seed=seed)
    if model.kind == "embedding" and "reference" not in blocks.extras:
        refs = []
        with torch.no_grad():
            for batch in blocks.batches(batch_size):
                out = model(batch["input_ids"].to(model.device),
                            attention_mask=batch["attention_mask"].to(model.device))
                refs.append(out.embeddings.float().cpu())
        gen = torch.Generator().manual_seed(seed)
        ref = torch.cat(refs)
        # random unit directions orthogonal to each reference, for gradient scoring
        direction = torch.randn(ref.shape, generator=gen)
        unit = F.normalize(ref, dim=-1)
        direction = F.normalize(direction - (direction * unit).sum(-1, keepdim=True) * unit, dim=-1)
        extras = {**blocks.extras, "reference": ref, "direction": direction}
        return Blocks(blocks.input_ids, blocks.attention_mask, blocks.labels, blocks.spec, extras)
    if model.kind == "classifier" and blocks.labels is None:
        raise ValueError(
            f"{blocks.spec}: a sequence classifier is evaluated against labels, and this data "
            "has no label column; give a labelled dataset (e.g. glue:mnli:validation_matched) "
            "or --label-column"
        )
    return blocks


def mask_tokens(blocks: Blocks, tokenizer, *, seed: int = 0, rate: float = 0.15) -> Blocks:
    """BERT-style fixed-seed masking: ``rate`` of the real non-special tokens become
    [MASK]; labels (N, S) hold the original ids there and -100 elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    ids = blocks.input_ids.clone()
    special = torch.tensor(
        [tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id]
    )
    candidates = blocks.attention_mask.bool() & ~torch.isin(ids, special)
    chosen = (torch.rand(ids.shape, generator=gen) < rate) & candidates
    # at least one masked token per row that has a candidate
    first = candidates.float().argmax(dim=1)
    rows = candidates.any(dim=1) & ~chosen.any(dim=1)
    chosen[rows, first[rows]] = True
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    ids[chosen] = tokenizer.mask_token_id
    return Blocks(ids, blocks.attention_mask, labels, blocks.spec, dict(blocks.extras))


def example_losses(
    model: HeadModel, batch: dict[str, torch.Tensor], *, scoring: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-example (mean loss (B,), token count (B,), correct predictions (B,)).

    With ``scoring=True`` an embedding model's loss is the projection of its normalised
    embedding on a fixed random direction orthogonal to the reference: ``1 - cos`` has
    a zero gradient at the unpruned model, while this projection's gradient measures
    how much each head moves the embedding (first-order, unbiased up to a constant).
    """
    return losses_of(model, run(model, batch), batch, scoring=scoring)


def run(model: HeadModel, batch: dict[str, torch.Tensor]):
    """The model's forward on a batch of blocks (the output `losses_of` reads)."""
    return model(batch["input_ids"].to(model.device),
                 attention_mask=batch["attention_mask"].to(model.device))


def losses_of(
    model: HeadModel, out, batch: dict[str, torch.Tensor], *, scoring: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`example_losses` from an output of `run`."""
    device = model.device
    ids = batch["input_ids"].to(device)
    mask = batch["attention_mask"].to(device)
    if model.kind == "causal-lm":
        logits = out.logits[:, :-1].float()  # (B, S-1, V)
        target = ids[:, 1:]
        valid = (mask[:, 1:] * mask[:, :-1]).float()
        nll = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # (B, S-1)
        count = valid.sum(1)
        correct = ((logits.argmax(-1) == target).float() * valid).sum(1)
        return (nll * valid).sum(1) / count.clamp(min=1), count, correct
    if model.kind == "masked-lm":
        labels = batch["labels"].to(device)
        valid = (labels != -100).float()
        nll = F.cross_entropy(out.logits.float().transpose(1, 2), labels.clamp(min=0),
                              reduction="none")
        count = valid.sum(1)
        correct = ((out.logits.argmax(-1) == labels).float() * valid).sum(1)
        return (nll * valid).sum(1) / count.clamp(min=1), count, correct
    if model.kind == "classifier":
        labels = batch["labels"].to(device)
        loss = F.cross_entropy(out.logits.float(), labels, reduction="none")
        return loss, torch.ones_like(loss), (out.logits.argmax(-1) == labels).float()
    if model.kind == "embedding":
        emb = F.normalize(out.embeddings.float(), dim=-1)
        ref = batch["reference"].to(device)
        cos = (emb * F.normalize(ref, dim=-1)).sum(-1)
        loss = (emb * batch["direction"].to(device)).sum(-1) if scoring else 1 - cos
        return loss, torch.ones_like(loss), cos
    raise ValueError(f"unknown model kind {model.kind!r}")


def curvature_probes(
    model: HeadModel, out, batch: dict[str, torch.Tensor], n: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` random probes of the curvature of each example's loss, as (output,
    cotangent) pairs: the gradient g of a parameter xi backpropagated from ``output``
    with ``cotangent`` has, per example, E[g^2] = J^T H J, with J = d output / d xi
    and H the Hessian of the loss in the output (its Gauss-Newton curvature).

    causal-lm, masked-lm, classifier: output the logits z_t, cotangent
    (p_t - onehot(y_t)) / sqrt(T) with y_t ~ p_t = softmax(z_t): the gradient of the
    cross-entropy of a label the model draws itself (the Fisher identity), over an
    example's T scored tokens (the loss is their mean; independent draws leave no
    cross terms in expectation).
    embedding: output the normalised embedding u, cotangent r ~ N(0, I). ``1 - cos(u,
    ref)`` has second derivative ||du/dxi||^2 = E[(r^T du/dxi)^2] at the unpruned
    model, where u = ref.
    Labels and directions come from ``generator`` (CPU), so a seeded run repeats.
    """
    device = model.device
    if model.kind == "embedding":
        emb = F.normalize(out.embeddings.float(), dim=-1)  # (B, E)
        for _ in range(n):
            yield emb, torch.randn(emb.shape, generator=generator).to(device)
        return
    if model.kind == "classifier":
        logits = out.logits.float()[:, None, :]  # (B, 1, C)
        valid = torch.ones(logits.shape[:2], device=device)
    elif model.kind == "causal-lm":
        mask = batch["attention_mask"].to(device)
        logits = out.logits[:, :-1].float()  # (B, S-1, V)
        valid = (mask[:, 1:] * mask[:, :-1]).float()
    elif model.kind == "masked-lm":
        logits = out.logits.float()
        valid = (batch["labels"].to(device) != -100).float()
    else:
        raise ValueError(f"unknown model kind {model.kind!r}")
    probs = logits.detach().softmax(-1)  # (B, T, V)
    drawn = torch.multinomial(probs.reshape(-1, probs.shape[-1]).cpu(), n, replacement=True,
                              generator=generator).to(device)  # (B*T, n)
    scale = (valid / valid.sum(1, keepdim=True).clamp(min=1).sqrt())[..., None]  # (B, T, 1)
    for j in range(n):  # (p - onehot(y)) * scale, built in one (B, T, V) tensor
        cotangent = probs * scale
        index = drawn[:, j].view(*probs.shape[:2], 1)
        yield logits, cotangent.scatter_add_(-1, index, -scale.expand_as(index))


@torch.no_grad()
def evaluate(model: HeadModel, blocks: Blocks, *, batch_size: int = 8) -> Quality:
    """Quality of ``model`` on ``blocks`` (prepared with `prepare` on the unpruned model).

    Under torchrun each rank evaluates a disjoint shard and the sums are all-reduced."""
    metric, higher = METRICS[model.kind]
    if model.kind == "embedding" and "reference" not in blocks.extras:
        raise ValueError("embedding fidelity needs reference embeddings: call prepare() first")
    total_loss = total_count = total_correct = 0.0
    n_tokens = 0
    blocks = blocks.subset(distributed.shard_rows(len(blocks), batch_size))
    for batch in track(blocks.batches(batch_size), total=blocks.n_batches(batch_size),
                       description=f"evaluating {metric}"):
        loss, count, correct = example_losses(model, batch)
        _check_finite(loss, "evaluation loss")
        total_loss += float((loss * count).sum())
        total_count += float(count.sum())
        total_correct += float(correct.sum())
        n_tokens += int(batch["attention_mask"].sum())
    total_loss, total_count, total_correct, n_tokens = distributed.sum_floats(
        total_loss, total_count, total_correct, n_tokens)
    n_tokens = int(n_tokens)
    mean = total_loss / max(total_count, 1.0)
    if metric in ("perplexity", "mlm-perplexity"):
        value = math.exp(min(mean, 700.0))
    else:
        value = total_correct / max(total_count, 1.0)
    return Quality(metric, value, mean, n_tokens, higher)


def _check_finite(t: torch.Tensor, what: str) -> None:
    if not torch.isfinite(t).all():
        raise FloatingPointError(
            f"{what} is not finite (NaN or inf): the model's weights or outputs are broken "
            "for this input; check the checkpoint and the dtype (try --dtype float32)"
        )
