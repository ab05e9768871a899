"""One objective per kind of model: what its blocks need, its loss, its metric.

    causal-lm   mean next-token loss (nats); perplexity
    masked-lm   masked-token loss under a fixed-seed BERT masking; its perplexity
    classifier  cross-entropy against labels; accuracy
    embedding   ``1 - cos`` between the model's sentence embedding and the unpruned
                model's (the reference); fidelity, the mean cosine

Everything that differs by ``model.kind`` lives here: the text layout its blocks are
cut in, its loss and metric, its distillation loss, whether the papers' window protocol
applies, where direct logit attribution reads. Evaluation, importance scoring,
recovery, attribution and the run ask ``objective_for(model)``. The objectives share
one per-example loss contract: ``losses`` returns (mean loss (B,), scored count (B,),
hits (B,)), where a hit is a correct prediction (an agreement, the cosine, for
embeddings).

Shape notation: B batch, S sequence length, T scored positions, V vocabulary or
classes, E embedding width.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from headlab._util.checks import check_int, check_seed
from headlab._util.kl import weighted_kl
from headlab.data.blocks import Blocks, check_blocks, layout_blocks
from headlab.data.texts import TextData
from headlab.errors import DataError, UserError

if TYPE_CHECKING:  # the models import generation, which asks objectives
    from headlab.models.base import HeadModel

DEFAULT_BATCH_SIZE = 8
_MAX_LOG_PERPLEXITY = 700.0  # exp(700) is near float64's largest: report that, not inf

Batch = dict[str, torch.Tensor]
Losses = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Objective:
    """What a kind of model is measured by; one instance per kind, see `objective_for`.

    ``layout``: how text is cut into blocks for it (`headlab.data.LAYOUTS`).
    ``default_seq_len`` is the block length a run uses unless told; `seq_len_for`
    caps it by the model's positions. ``needs_reference``: the metric compares with
    the unpruned model, so evaluating a pruned one needs the original to prepare the
    blocks. ``generates``: the model continues text (`headlab.models.generation`).
    ``reads_windows``: the papers' calibration and evaluation windows, plain slices of
    one token stream (`headlab.data.protocol`), are text as this kind reads it.
    """

    kind: str
    metric: str
    higher_is_better: bool
    default_seq_len: int
    layout: str
    needs_reference = False
    generates = False
    reads_windows = False

    def __repr__(self) -> str:
        return f"<objective {self.kind}: {self.metric}>"

    def seq_len_for(self, model: HeadModel) -> int:
        return min(self.default_seq_len, model.max_positions)

    def make_blocks(self, data: TextData, tokenizer, *, seq_len: int,
                    max_tokens: int | None = None) -> Blocks:
        """``data`` cut into blocks as this kind reads text (see `make_blocks`)."""
        return layout_blocks(data, tokenizer, layout=self.layout, seq_len=seq_len,
                             max_tokens=max_tokens)

    def check_blocks(self, blocks: Blocks, *, what: str) -> None:
        """Raise DataError unless ``blocks`` are non-empty Blocks in this kind's layout
        (where known); ``what`` names the caller in the message."""
        check_blocks(blocks, what=what)
        if blocks.layout is not None and blocks.layout != self.layout:
            raise DataError(f"{what}: these blocks are laid out as {blocks.layout!r}, a "
                            f"{self.kind} model reads {self.layout!r}; make them with "
                            f"make_blocks(kind={self.kind!r}) or the model's objective")

    def prepare(self, model: HeadModel, blocks: Blocks, *,
                batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0) -> Blocks:
        """Add to ``blocks`` what the loss needs and that must not change across a run;
        call it on the unpruned model. Prepared blocks come back as they are."""
        return blocks

    def check_prepared(self, blocks: Blocks, *, what: str) -> None:
        """Raise if ``blocks`` lack what `prepare` adds and cannot be evaluated; ``what``
        names the caller in the message."""

    def forward(self, model: HeadModel, batch: Batch):
        """The model's forward on a batch of blocks (the output `losses` reads)."""
        return model(batch["input_ids"].to(model.device),
                     attention_mask=batch["attention_mask"].to(model.device))

    def losses(self, model: HeadModel, out, batch: Batch, *, scoring: bool = False) -> Losses:
        """Per example (mean loss (B,), scored count (B,), hits (B,)) from `forward`'s
        output. ``scoring=True`` asks for the loss whose gradient importance scoring
        reads, where that differs (embedding)."""
        raise NotImplementedError

    def example_losses(self, model: HeadModel, batch: Batch, *, scoring: bool = False) -> Losses:
        return self.losses(model, self.forward(model, batch), batch, scoring=scoring)

    def curvature_probes(self, model: HeadModel, out, batch: Batch, n: int,
                         generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` random probes of the curvature of each example's loss, as (output,
        cotangent) pairs: the gradient g of a parameter xi backpropagated from ``output``
        with ``cotangent`` has, per example, E[g^2] = J^T H J, with J = d output / d xi
        and H the Hessian of the loss in the output (its Gauss-Newton curvature).
        Draws come from ``generator`` (CPU), so a seeded run repeats."""
        raise NotImplementedError

    def value(self, loss: float, hit_rate: float) -> float:
        """The metric from the mean loss and the mean hit over scored positions."""
        return hit_rate

    def distill_loss(self, student: HeadModel, s_out, reference: HeadModel, t_out,
                     batch: Batch, temperature: float) -> torch.Tensor:
        """The scalar loss that distils the teacher (``reference``, output ``t_out``)
        into the student (``student``, ``s_out``) on ``batch`` (`headlab.recovery.distill`)."""
        raise NotImplementedError

    def logit_position(self, input_ids: torch.Tensor, tokenizer) -> int:
        """The position of ``input_ids`` (1, S) whose token logits direct logit
        attribution reads by default (`headlab.analysis.attribution`)."""
        raise UserError(f"direct logit attribution reads logits over a vocabulary; a "
                        f"{self.kind} model has none: attribute a causal or masked LM")


class _CrossEntropy(Objective):
    """Softmax outputs scored by cross-entropy: probes by the Fisher identity."""

    def _scored(self, model: HeadModel, out, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The scored logits (B, T, V) in float32 and their weights (B, T), 0 or 1."""
        raise NotImplementedError

    def curvature_probes(self, model, out, batch, n, generator):
        """Output the logits z_t, cotangent (p_t - onehot(y_t)) / sqrt(T) with
        y_t ~ p_t = softmax(z_t): the gradient of the cross-entropy of a label the model
        draws itself (the Fisher identity), over an example's T scored tokens (the loss
        is their mean; independent draws leave no cross terms in expectation)."""
        logits, valid = self._scored(model, out, batch)
        probs, drawn, scale = _fisher_draws(logits, valid, n, generator)
        for j in range(n):  # (p - onehot(y)) * scale, built in one (B, T, V) tensor
            cotangent = probs * scale
            yield logits, cotangent.scatter_add_(-1, drawn[..., j:j + 1], -scale)

    def distill_loss(self, student, s_out, reference, t_out, batch, temperature):
        """T^2 KL(teacher || student) at temperature T, averaged over the scored
        positions (`_scored`: the output alone cannot say which positions count)."""
        s, valid = self._scored(student, s_out, batch)  # (B, T, V), (B, T)
        t, _ = self._scored(reference, t_out, batch)
        return weighted_kl(s, t.to(s.device), valid, temperature) * temperature**2


def _fisher_draws(logits: torch.Tensor, valid: torch.Tensor, n: int, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `_CrossEntropy.curvature_probes`: p = softmax(logits) (B, T, V), ``n`` labels
    drawn from it (B, T, n), and each example's scale 1 / sqrt(T) on its scored
    positions, 0 elsewhere (B, T, 1)."""
    probs = logits.detach().softmax(-1)
    # torch draws a single sample per row by another path, an exponential variate per
    # class (5.7 s for 1016 rows of 262k classes, where four draws take 0.25 s): draw two
    drawn = torch.multinomial(probs.reshape(-1, probs.shape[-1]).cpu(), max(n, 2),
                              replacement=True, generator=generator).to(logits.device)
    scale = (valid / valid.sum(1, keepdim=True).clamp(min=1).sqrt())[..., None]
    return probs, drawn[:, :n].reshape(*probs.shape[:2], n), scale


class _TokenLM(_CrossEntropy):
    """A language model scored token by token: the mean NLL of an example's scored
    tokens, perplexity as the metric."""

    higher_is_better = False
    default_seq_len = 256

    def _targets(self, model: HeadModel, batch: Batch) -> torch.Tensor:
        """The token each scored logit predicts (B, T); class ids even where unscored."""
        raise NotImplementedError

    def losses(self, model, out, batch, *, scoring=False):
        logits, valid = self._scored(model, out, batch)  # (B, T, V), (B, T)
        target = self._targets(model, batch)
        nll = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # (B, T)
        count = valid.sum(1)
        correct = ((logits.argmax(-1) == target).float() * valid).sum(1)
        return (nll * valid).sum(1) / count.clamp(min=1), count, correct

    def value(self, loss, hit_rate):
        return math.exp(min(loss, _MAX_LOG_PERPLEXITY))

    def logit_position(self, input_ids, tokenizer):
        """The last position."""
        return -1


class CausalLM(_TokenLM):
    kind = "causal-lm"
    metric = "perplexity"
    layout = "stream"
    generates = True
    reads_windows = True

    def _scored(self, model, out, batch):
        mask = batch["attention_mask"].to(model.device)
        # position t predicts token t+1; a pair counts where both tokens are real
        return out.logits[:, :-1].float(), (mask[:, 1:] * mask[:, :-1]).float()  # (B, S-1, V)

    def _targets(self, model, batch):
        return batch["input_ids"].to(model.device)[:, 1:]

    def curvature_probes(self, model, out, batch, n, generator):
        """`_CrossEntropy`'s probes taken back through the output head: the output is
        the final hidden states h_t (B, T, E) of the scored positions, the cotangent
        J_t^T (p_t - onehot(y_t)) scale_t with J_t = d logits_t / d h_t. J^T p scale is
        one pass back through the head, shared by the draws; J^T onehot(y) is the
        gradient of the drawn token's logit alone (`DecoderLM.logits_at`). The gradients
        are the same; each draw skips a (B, T, V) cotangent and its product with the
        (V, E) unembedding, most of its cost at a large vocabulary."""
        logits, valid = self._scored(model, out, batch)  # (B, S-1, V): positions 0 .. S-2
        probs, drawn, scale = _fisher_draws(logits, valid, n, generator)
        hidden = out.last_hidden_state  # (B, S, E), lm_head's input
        T = logits.shape[1]
        scored = hidden[:, :T]  # (B, T, E)
        shared = torch.autograd.grad(logits, hidden, probs * scale,
                                     retain_graph=True)[0][:, :T]  # (B, T, E)
        rows = scored.detach().requires_grad_(True)
        picked = model.logits_at(rows, drawn)  # (B, T, n)
        for j in range(n):
            (own,) = torch.autograd.grad(picked[..., j:j + 1], rows, scale.to(picked.dtype),
                                         retain_graph=j < n - 1)
            yield scored, shared - own


class MaskedLM(_TokenLM):
    kind = "masked-lm"
    metric = "mlm-perplexity"
    layout = "wrapped-stream"

    def prepare(self, model, blocks, *, batch_size=DEFAULT_BATCH_SIZE, seed=0):
        """The fixed-seed masking (`mask_tokens`), unless the blocks carry token labels."""
        if blocks.labels is None or blocks.labels.dim() != 2:
            return mask_tokens(blocks, model.tokenizer, seed=seed)
        return blocks

    def _scored(self, model, out, batch):
        return out.logits.float(), (batch["labels"].to(model.device) != -100).float()

    def _targets(self, model, batch):
        return batch["labels"].to(model.device).clamp(min=0)  # -100 (unscored) -> a class

    def logit_position(self, input_ids, tokenizer):
        """The first [MASK] token, else the last position."""
        mask_id = getattr(tokenizer, "mask_token_id", None)
        masked = (input_ids[0] == mask_id).nonzero() if mask_id is not None else []
        return int(masked[0]) if len(masked) else -1


class Classifier(_CrossEntropy):
    kind = "classifier"
    metric = "accuracy"
    higher_is_better = True
    default_seq_len = 128
    layout = "rows"

    def prepare(self, model, blocks, *, batch_size=DEFAULT_BATCH_SIZE, seed=0):
        """Nothing to add, but a classifier is measured against labels: refuse without."""
        if blocks.labels is None:
            raise UserError(
                f"{blocks.spec}: a sequence classifier is evaluated against labels, and this "
                "data has no label column; give a labelled dataset (e.g. "
                "glue:mnli:validation_matched) or --label-column"
            )
        return blocks

    def _scored(self, model, out, batch):
        logits = out.logits.float()[:, None, :]  # (B, 1, V): one scored position
        return logits, torch.ones(logits.shape[:2], device=model.device)

    def losses(self, model, out, batch, *, scoring=False):
        labels = batch["labels"].to(model.device)
        loss = F.cross_entropy(out.logits.float(), labels, reduction="none")
        return loss, torch.ones_like(loss), (out.logits.argmax(-1) == labels).float()

    def distill_loss(self, student, s_out, reference, t_out, batch, temperature):
        """The KL over the classes plus the mean cross-entropy to the labels."""
        loss, _, _ = self.losses(student, s_out, batch)  # (B,)
        return super().distill_loss(student, s_out, reference, t_out, batch,
                                    temperature) + loss.mean()


class Embedding(Objective):
    kind = "embedding"
    metric = "fidelity"
    higher_is_better = True
    default_seq_len = 128
    layout = "sentences"  # a sentence embedding and its fidelity are about a sentence
    needs_reference = True

    def prepare(self, model, blocks, *, batch_size=DEFAULT_BATCH_SIZE, seed=0):
        """The unpruned model's embeddings as the reference, and per row a seeded random
        unit direction orthogonal to it, for gradient scoring (see `losses`)."""
        if "reference" in blocks.extras:
            return blocks
        refs = []
        with torch.no_grad():
            for batch in blocks.batches(batch_size):
                refs.append(self.forward(model, batch).embeddings.float().cpu())
        gen = torch.Generator().manual_seed(seed)
        ref = torch.cat(refs)  # (N, E)
        direction = torch.randn(ref.shape, generator=gen)
        unit = F.normalize(ref, dim=-1)
        direction = F.normalize(direction - (direction * unit).sum(-1, keepdim=True) * unit, dim=-1)
        extras = {**blocks.extras, "reference": ref, "direction": direction}
        return Blocks(blocks.input_ids, blocks.attention_mask, blocks.labels, blocks.spec, extras,
                      blocks.layout)

    def check_prepared(self, blocks, *, what):
        if "reference" not in blocks.extras:
            raise UserError(f"{what}: blocks lack the reference embeddings that embedding "
                            "fidelity compares with; call prepare first: "
                            "headlab.prepare(model, blocks) on the unpruned model")

    def losses(self, model, out, batch, *, scoring=False):
        """``1 - cos`` to the reference. With ``scoring=True`` the loss is the projection
        of the normalised embedding on the fixed direction orthogonal to the reference:
        ``1 - cos`` has a zero gradient at the unpruned model, while this projection's
        gradient measures how much each head moves the embedding (first-order,
        unbiased up to a constant)."""
        device = model.device
        emb = F.normalize(out.embeddings.float(), dim=-1)  # (B, E)
        cos = (emb * F.normalize(batch["reference"].to(device), dim=-1)).sum(-1)
        loss = (emb * batch["direction"].to(device)).sum(-1) if scoring else 1 - cos
        return loss, torch.ones_like(loss), cos

    def curvature_probes(self, model, out, batch, n, generator):
        """Output the normalised embedding u, cotangent r ~ N(0, I): ``1 - cos(u, ref)``
        has second derivative ||du/dxi||^2 = E[(r^T du/dxi)^2] at the unpruned model,
        where u = ref."""
        emb = F.normalize(out.embeddings.float(), dim=-1)  # (B, E)
        for _ in range(n):
            yield emb, torch.randn(emb.shape, generator=generator).to(model.device)

    def distill_loss(self, student, s_out, reference, t_out, batch, temperature):
        """1 - cos to the teacher's sentence embedding, averaged over the batch."""
        s = s_out.embeddings.float()  # (B, E)
        return (1 - F.cosine_similarity(s, t_out.embeddings.float().to(s.device), dim=-1)).mean()


OBJECTIVES: dict[str, Objective] = {o.kind: o for o in (CausalLM(), MaskedLM(), Classifier(),
                                                         Embedding())}


def objective_for(model_or_kind: HeadModel | str) -> Objective:
    """The objective of a model (by its ``kind``) or of a kind named directly."""
    kind = (model_or_kind if isinstance(model_or_kind, str)
            else getattr(model_or_kind, "kind", None))
    try:
        return OBJECTIVES[kind]
    except (KeyError, TypeError):
        raise UserError(f"no objective for model kind {kind!r}; headlab knows "
                        f"{', '.join(OBJECTIVES)}") from None


def prepare(model: HeadModel, blocks: Blocks, *, batch_size: int = DEFAULT_BATCH_SIZE,
            seed: int = 0) -> Blocks:
    """``blocks`` with what ``model``'s objective needs fixed once per run: the masking
    for masked-LM, the unpruned reference embeddings for encoders. Call it on the
    unpruned model."""
    objective = objective_for(model)
    objective.check_blocks(blocks, what="prepare")
    batch_size = check_int(batch_size, "batch_size", low=1)
    seed = check_seed(seed)
    return objective.prepare(model, blocks, batch_size=batch_size, seed=seed)


def loss(model: HeadModel, ids: torch.Tensor | str,
         attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """A causal LM's mean next-token loss (nats) on input ids (B, S) or a text, as a
    scalar tensor (gradients flow; wrap in ``torch.no_grad()`` to skip them). Hooks in
    force (`headlab.hooks`, an ablation) apply, so a loss change reads directly."""
    objective = objective_for(model)
    if not isinstance(objective, CausalLM):
        raise UserError(f"headlab.loss reads next-token loss, which a {model.kind} model "
                        "has not; measure it on prepared blocks instead: "
                        "headlab.evaluate(model, headlab.prepare(model, blocks)).loss")
    if isinstance(ids, str):
        ids = torch.tensor([model.tokenizer(ids)["input_ids"]])
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    mean, count, _ = objective.example_losses(model, {"input_ids": ids, "attention_mask": mask})
    if not float(count.sum()):
        raise UserError(f"input ids of shape {tuple(ids.shape)} hold no pair of real tokens "
                        "to score: give at least two tokens")
    return (mean * count).sum() / count.sum()


def make_blocks(data: TextData, tokenizer, *, kind: str, seq_len: int,
                max_tokens: int | None = None) -> Blocks:
    """Tokenise ``data`` for a model of ``kind`` into at most ``max_tokens`` tokens, in
    the kind's layout (`headlab.data.LAYOUTS`):

    causal-lm: one stream of texts joined by EOS, cut into full blocks of seq_len.
    masked-lm: the same stream cut into blocks wrapped in [CLS] ... [SEP].
    classifier / embedding: one (padded, truncated) row per example or pair; an
    embedding model reads prose (``data.prose``) one sentence per row, the unit its
    embeddings and their fidelity are about.
    """
    if kind not in OBJECTIVES:
        raise DataError(f"no text layout for model kind {kind!r}; known kinds: "
                        f"{', '.join(OBJECTIVES)}")
    return OBJECTIVES[kind].make_blocks(data, tokenizer, seq_len=seq_len, max_tokens=max_tokens)


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
    return Blocks(ids, blocks.attention_mask, labels, blocks.spec, dict(blocks.extras),
                  blocks.layout)
