"""How much memory a rank needs to score or evaluate a model, and a guard that refuses
runs that would not fit, before any weight is read.

Per rank, with the weights sharded over W ranks by FSDP (`headlab.parallel.sharding`):

    parameters   all parameters / W, once per model a rank holds (a prune keeps the
                 pruned model beside the one it came from: ``models=2``)
    gathered     what stays in the root unit (the final norm, tied embeddings), gathered
                 for the whole forward, and two whole units: the one computing and the
                 next, which FSDP prefetches (none when W = 1); the units are the
                 blocks and the embeddings and head where they are not tied (`units`)
    activations  per token, a block keeps about its parameters / E + 4 E values for the
                 backward pass (its input, Q, K, V, the attention output, the MLP's inner
                 activations); with gradients (scoring) every block keeps them, without
                 (evaluation) two blocks' worth are alive; plus the logits, in the model's
                 dtype and twice in float32 (log-softmax and its gradient).

Every rank sees every batch under sharding, so activations do not shrink with W. The
count is an estimate (attention through SDPA, no S x S matrices; no allocator slack):
the guard leaves a tenth of the device free for what it leaves out. Nor does it count
a distillation's gradients and optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from headlab.errors import UserError
from headlab.models.base import HeadModel
from headlab.parallel.distributed import available

GIB = 2**30
HEADROOM = 0.9  # the share of a device the estimate may fill
MAX_RANKS = 1024


@dataclass(frozen=True)
class Estimate:
    """Bytes one rank needs, by part."""

    ranks: int
    batch_size: int
    seq_len: int
    parameters: int
    gathered: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gathered + self.activations

    def line(self) -> str:
        return (f"{self.total / GIB:.1f} GiB per rank (parameters {self.parameters / GIB:.1f}"
                f", gathered {self.gathered / GIB:.1f}, activations "
                f"{self.activations / GIB:.1f}) at batch size {self.batch_size} x "
                f"{self.seq_len} tokens on {self.ranks} rank{'s' if self.ranks > 1 else ''}")


def units(model: HeadModel) -> list[nn.Module]:
    """The modules FSDP shards on their own (`headlab.parallel.sharding`): every block, and every
    other child of the model whose parameters no other child shares (an untied
    embedding or head); tied ones stay with the root. A unit's weights are whole only
    during its own forward, so a module that reads another's weight must hold it as
    its own Parameter, the tie this sees (GPT-2's ``lm_head.weight = wte.weight``, an
    encoder's `headlab.models.encoder.TiedDecoder`)."""
    owners: dict[int, int] = {}
    for child in model.children():
        for p in child.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    rest = [c for c in model.children() if c is not model.blocks
            and any(True for _ in c.parameters())
            and all(owners[id(p)] == 1 for p in c.parameters())]
    return [*model.blocks, *rest]


def estimate(model: HeadModel, *, ranks: int, batch_size: int, seq_len: int,
             backward: bool, dtype: torch.dtype, models: int = 1) -> Estimate:
    """Per-rank memory for ``model`` (real or on the meta device) in ``dtype``, with
    ``models`` models of its size sharded on each rank."""
    size = torch.finfo(dtype).bits // 8
    per_block = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    per_unit = [sum(p.numel() for p in unit.parameters()) for unit in units(model)]
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    root = total - sum(per_unit)
    E = model.attentions[0].o_proj.out_features
    head = getattr(model, "lm_head", None)
    vocab = head.out_features if head is not None else 0
    tokens = batch_size * seq_len
    per_token = max(per_block) / E + 4 * E  # values a block keeps per token
    kept_blocks = model.n_layers if backward else 2
    activations = tokens * (kept_blocks * per_token * size + vocab * (size + 8))
    gathered = (root + 2 * max(per_unit)) * size if ranks > 1 else 0
    return Estimate(ranks, batch_size, seq_len, models * -(-total // ranks) * size,
                    int(gathered), int(activations))


def check_memory(model: HeadModel, *, ranks: int, batch_size: int, seq_len: int,
                 backward: bool, dtype: torch.dtype, device: str,
                 limit: int | None = None, models: int = 1) -> Estimate:
    """The estimate, or a one-line UserError naming a batch size or a number of ranks
    that would fit when it exceeds ``limit`` (default: `HEADROOM` of `available`)."""
    limit = int(HEADROOM * available(device)) if limit is None else limit

    def need(r: int, b: int) -> Estimate:
        return estimate(model, ranks=r, batch_size=b, seq_len=seq_len, backward=backward,
                        dtype=dtype, models=models)

    est = need(ranks, batch_size)
    if est.total <= limit:
        return est
    ways = []
    batch = _largest(lambda b: need(ranks, b).total <= limit, 1, batch_size - 1)
    if batch is not None:
        ways.append(f"--batch-size {batch}")
    more = _smallest(lambda r: need(r, batch_size).total <= limit, ranks + 1, MAX_RANKS)
    if more is not None:
        ways.append(f"{more} ranks (torchrun --nproc_per_node {more} ... --shard fsdp)")
    both = None if ways or batch_size == 1 else _smallest(
        lambda r: need(r, 1).total <= limit, ranks + 1, MAX_RANKS)
    if both is not None:
        ways.append(f"{both} ranks at --batch-size 1")
    fix = (" or ".join(ways) + " would fit") if ways else (
        f"neither a smaller batch nor up to {MAX_RANKS} ranks would fit: shorten --seq-len")
    raise UserError(f"not enough memory: the run needs about {est.line()}, and each rank "
                    f"has {limit / GIB:.1f} GiB to use on {device}; {fix}")


def _largest(fits, lo: int, hi: int) -> int | None:
    """The largest n in [lo, hi] that fits, memory falling as n falls (bisection)."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _smallest(fits, lo: int, hi: int) -> int | None:
    """The smallest n in [lo, hi] that fits, memory falling as n grows (bisection)."""
    if hi < lo or not fits(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo
