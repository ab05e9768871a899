"""The quality of a model on held-out blocks, measured through its objective.

What is measured (perplexity, accuracy, fidelity, ...) and how is the model's
objective (`headlab.objectives`); this module runs it over the blocks and sums.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from headlab._util.checks import check_int
from headlab._util.progress import tokens_in, track
from headlab.data.blocks import Blocks
from headlab.models.base import HeadModel
from headlab.objectives import DEFAULT_BATCH_SIZE, objective_for
from headlab.parallel import distributed


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


@torch.no_grad()
def evaluate(model: HeadModel, blocks: Blocks, *, batch_size: int = DEFAULT_BATCH_SIZE) -> Quality:
    """Quality of ``model`` on ``blocks`` (prepared with `headlab.prepare` on the
    unpruned model).

    Under torchrun each rank evaluates a disjoint shard and the sums are all-reduced."""
    objective = objective_for(model)
    objective.check_blocks(blocks, what="evaluate")
    objective.check_prepared(blocks, what="evaluate")
    batch_size = check_int(batch_size, "batch_size", low=1)
    total_loss = total_count = total_correct = 0.0
    n_tokens = 0
    blocks = blocks.subset(distributed.shard_rows(len(blocks), batch_size))
    for batch in track(blocks.batches(batch_size), total=blocks.n_tokens, size=tokens_in,
                       unit="tokens", description=f"evaluating {objective.metric}"):
        loss, count, correct = objective.example_losses(model, batch)
        _check_finite(loss, "evaluation loss")
        total_loss += float((loss * count).sum())
        total_count += float(count.sum())
        total_correct += float(correct.sum())
        n_tokens += int(batch["attention_mask"].sum())
    total_loss, total_count, total_correct, n_tokens = distributed.sum_floats(
        total_loss, total_count, total_correct, n_tokens)
    n_tokens = int(n_tokens)
    mean = total_loss / max(total_count, 1.0)
    value = objective.value(mean, total_correct / max(total_count, 1.0))
    return Quality(objective.metric, value, mean, n_tokens, objective.higher_is_better)


def _check_finite(t: torch.Tensor, what: str) -> None:
    if not torch.isfinite(t).all():
        raise FloatingPointError(
            f"{what} is not finite (NaN or inf): the model's weights or outputs are broken "
            "for this input; check the checkpoint and the dtype (try --dtype float32)"
        )
