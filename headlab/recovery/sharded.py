"""The layer-wise walk on a model sharded by FSDP2 (`headlab.parallel.sharding`).

Every rank runs the walk in lockstep on every batch, so every rank sums the same normal
equations; what differs is where the weights live. Each block is a ``fully_shard``
unit whose parameters are DTensors split by rows (dim 0); the walk calls its sublayers
alone, which FSDP's hooks (on the block's own forward) do not gather for. So:

- `ready`: one token through the whole model first (FSDP makes its root the first
  module to run forward), and the root's own parameters (final norm, tied embeddings)
  gathered, as FSDP keeps them after a forward, for the embeddings the walk calls alone;
- `gathered`: block i of each model whole on every rank for the layer's step (one
  ``unshard``, kept across its forwards, ``reshard`` after), so a rank holds at most
  the pruned and the reference block whole at once, the two that the memory guard
  allows for (`headlab.parallel.memory`);
- `RowWriter`: a refitted projection is not replaced, as elsewhere (FSDP's parameter
  group holds the modules it gathers into, and would keep gathering into the old one),
  but written into the rows each rank holds, rank 0's solution scattered to all
  (``distribute_tensor`` with the parameter's own placements, FSDP's padding for
  uneven rows included), then the block gathered again. The rows written over are
  kept on the CPU, so a failure puts them back. A bias that recovery gives a W_O
  without one is a plain parameter, whole on every rank (E values, as the gates are),
  outside FSDP's units.

Distillation (`headlab.recovery.distill`) trains the sharded parameters as they are,
through FSDP's own forward and backward; `local` and `all_sum` serve it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is a ``fully_shard`` unit."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def ready(model: nn.Module, input_ids: torch.Tensor) -> None:
    """Make the embeddings of a sharded ``model`` callable alone (see the module
    docstring); ``input_ids`` (B, S): any batch, its first token is run."""
    model(input_ids[:1, :1])
    model.unshard()


@contextlib.contextmanager
def gathered(*blocks: nn.Module) -> Iterator[None]:
    """These ``fully_shard`` blocks whole on every rank inside, each gathered once; a
    block that is not sharded is left alone."""
    units = [b for b in blocks if is_fsdp(b)]
    try:
        for b in units:
            b.set_reshard_after_forward(False, recurse=False)
            b.unshard()
        yield
    finally:
        for b in units:
            b.reshard()
            b.set_reshard_after_forward(True, recurse=False)  # `shard`'s setting


class RowWriter:
    """Writes refitted projections into the rows of a sharded model, keeping the rows
    it wrote over; `undo` puts them back."""

    def __init__(self) -> None:
        # (module, name, its rows as they came on the CPU, or None: it had no such tensor)
        self.saved: list[tuple[nn.Module, str, torch.Tensor | None]] = []

    def install(self, block: nn.Module, owner: nn.Module, name: str, weight: torch.Tensor,
                bias: torch.Tensor | None) -> None:
        """``owner.name``'s new weight (and bias), whole; ``block`` (gathered, see
        `gathered`) is the unit holding it, gathered again after with the new rows."""
        lin = getattr(owner, name)
        weight = weight.to(lin.weight.dtype, copy=True)  # the gathered one is freed next
        block.reshard()
        mesh = lin.weight.device_mesh
        self._write(lin, "weight", weight, mesh)
        if bias is not None:
            if lin.bias is None:  # a W_O alone gains one (`ensure_out_bias`)
                self.saved.append((lin, "bias", None))
                _set_rows(owner.ensure_out_bias(), bias, mesh)
            else:
                self._write(lin, "bias", bias, mesh)
        block.unshard()

    def keep(self, module: nn.Module, name: str) -> None:
        """Keep ``module.name``'s rows as they are now (or that it has none) for `undo`."""
        param = getattr(module, name)
        self.saved.append((module, name, None if param is None
                           else local(param).detach().to("cpu", copy=True)))

    def _write(self, module: nn.Module, name: str, value: torch.Tensor, mesh) -> None:
        self.keep(module, name)
        _set_rows(getattr(module, name), value, mesh)

    @torch.no_grad()
    def undo(self) -> None:
        """Every written tensor as it came (the blocks resharded, as `gathered` leaves
        them); no collective, so a rank can undo alone."""
        for module, name, rows in reversed(self.saved):
            if rows is None:
                setattr(module, name, None)
            else:
                local(getattr(module, name)).copy_(rows)
        self.saved.clear()


def all_sum(model: nn.Module, value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the ranks where ``model`` is sharded (itself elsewhere)."""
    if not is_fsdp(model):
        return value
    value = value.clone()
    dist.all_reduce(value)
    return value


def local(param: torch.Tensor) -> torch.Tensor:
    """The rows of ``param`` this rank holds (all of a tensor that is not sharded)."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


@torch.no_grad()
def _set_rows(param: torch.Tensor, value: torch.Tensor, mesh) -> None:
    """This rank's rows of ``param`` from ``value`` (whole) as rank 0 holds it: scattered
    by the parameter's placements, or, for a tensor whole on every rank, broadcast."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    placements = param.placements if isinstance(param, DTensor) else [Replicate()]
    value = value.to(device=local(param).device, dtype=param.dtype)
    rows = distribute_tensor(value, mesh, placements).to_local()
    mine = local(param)
    if rows.shape != mine.shape:
        raise RuntimeError(f"rows {tuple(rows.shape)} for a shard of {tuple(mine.shape)}")
    mine.copy_(rows)
